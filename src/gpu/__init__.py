"""lanes.gpu: devices, CUDA streams and events, the KV block pool, attention, collectives."""
