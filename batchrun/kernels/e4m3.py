"""Rounding to float8_e4m3fn in float32, exactly as torch's cast rounds, for the Triton kernels
that write FP8 (the KV cache, quantized activations)."""

import triton
import triton.language as tl


@triton.jit
def e4m3_rounded(x):
    """x (float32, |x| <= 448) rounded to its nearest float8_e4m3fn value, ties to even, still
    in float32: its cast is then exact. Triton's interpreter casts float32 to fp8 without
    carrying a rounded-up mantissa into the exponent (7.98 became 4.0); the GPU's cast rounds
    so itself, and gets an exact value here. A value's quantum is 2^(e - 3) in binade 2^e, and
    2^-9 below e4m3's normals (2^-6); adding and taking away 1.5 * 2^23 rounds x / quantum to an
    integer, nearest even. Powers of two are built from their bits: every product is exact."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    per_quantum = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)  # 1 / quantum
    magnitude = ((tl.abs(x) * per_quantum + 12582912.0) - 12582912.0) * quantum
    # x's sign bit set by hand (a negation may be compiled to 0 - m, which loses -0.0's sign)
    sign = bits & -2147483648
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
