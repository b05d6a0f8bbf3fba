"""Raw Triton kernels: paged attention and K/V writes, fused layer ops, sampling."""
