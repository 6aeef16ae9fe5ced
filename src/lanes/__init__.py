"""lanes: an LLM inference server on Trio."""

import os

# OpenMP's threads sleep between parallel regions rather than spin (libgomp spins some 300,000 times first):
# on the CPU the kernels' own threads (lanes/quant/cpu_pool.h) need the cores that spinning holds (a one-row
# decode step of the default model 16.7 -> 12.1 ms on 2 cores). libgomp reads it once, as torch loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
