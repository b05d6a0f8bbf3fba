"""Compiles DFlash2's walk kernel for Hopper (sm_90) ahead of time, with and without its own
uniforms, and prints each configuration's resources: the interpreter runs a kernel as Python
and accepts what Triton's compiler refuses (a non-constexpr global, for one). Run without
TRITON_INTERPRET (tests/spec_decode/test_dflash2_triton_walk.py does)."""

from batchrun.kernels.compile_check import Case, compile_case
from batchrun.spec_decode.dflash2.triton_walk import _walk_kernel

pointers = {
    "unary_ptr": "fp32",
    "cand_ptr": "i64",
    "hproj_ptr": "fp32",
    "anchors_ptr": "i64",
    "pred_ptr": "bf16",
    "succ_ptr": "bf16",
    "temp_ptr": "fp32",
    "u_ptr": "fp32",
    "seed_ptr": "i64",
    "step_ptr": "i64",
    "tokens_ptr": "i64",
    "q_ptr": "fp32",
}
strides = tuple(n for n in _walk_kernel.arg_names if n.startswith("s_"))
for draw in (True, False):
    constants = {"BLOCK_K": 16, "BLOCK_R": 256, "DRAW": draw}
    case = Case("walk", _walk_kernel, pointers, (), constants, 4, unaligned=strides)
    print(f"DRAW={draw}", compile_case(case))
