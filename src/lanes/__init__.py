"""lanes: an LLM inference server on Trio."""
