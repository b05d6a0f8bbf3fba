"""Raw Triton kernels: paged attention and K/V writes, fused layer ops. The sampling kernel is
in sampling/."""
