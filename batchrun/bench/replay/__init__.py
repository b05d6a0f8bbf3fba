"""Whole jobs replayed on the CPU through the engine's scheduler and speculator, each step
priced by a cost model (hand-written, or fitted to a `batchrun bench --jobs` result file)."""
