"""Sampling as the engine runs it: Philox noise (philox.py), the torch sampler (sampler.py) and
its Triton kernel (triton_sampling.py). It imports nothing of the engine."""
