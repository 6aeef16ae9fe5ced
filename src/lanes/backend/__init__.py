"""lanes.backend: a loaded family on a device as the lane core's backend (torch): passes, draws, penalties, vision lanes."""
