"""Tensor parallelism's process group (group.py). Its layers are in layers/ (tensor_parallel.py,
parallel_logits.py), the sharded Qwen3 in models/qwen3_sharding.py, launching in
runners/torchrun.py."""
