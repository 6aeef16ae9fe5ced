"""Image and video inputs: decoding and Qwen-style preprocessing."""
