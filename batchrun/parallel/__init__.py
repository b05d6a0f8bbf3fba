"""Tensor parallelism: one process per GPU (torchrun), the target's weights split across them."""
