"""Compiles the Triton kernels for a Hopper GPU (sm_90) ahead of time, on a machine without one,
and reports each configuration's registers, stack frame (spills), shared memory and matrix
instructions, from the ptxas and cuobjdump that Triton's wheel carries.

    python -m batchrun.kernels.compile_check [--quick | --top-k]

Exit status 1 when a configuration fails to compile or spills (a stack frame over 16 bytes). Run
it after changing tile shapes: GPU time is short, this costs none. Integer arguments are
compiled with the divisibility by 16 that Triton's launcher finds at real shapes; without it
the gathers lose their 16-byte vector loads and spill.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from batchrun.kernels import triton_attention as ta
from batchrun.kernels import triton_fused as fused
from batchrun.kernels import triton_topk as topk

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
MAX_STACK = 16  # bytes; a few words of stack are not spills


@dataclass(frozen=True)
class Case:
    label: str
    fn: Any  # a triton JITFunction
    pointers: dict[str, str]  # argument -> element type
    floats: tuple[str, ...]
    constants: dict[str, Any]
    num_warps: int
    num_stages: int = 2
    unaligned: tuple[str, ...] = ()  # integer arguments not known divisible by 16
    aligned: tuple[str, ...] = ()  # integer arguments, not named stride*, divisible by 16


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def available() -> bool:
    """True where Triton's NVIDIA backend and its binary tools are installed."""
    return os.path.exists(_tool("ptxas")) and os.path.exists(_tool("cuobjdump"))


def compile_case(case: Case, arch: int = 90) -> dict[str, Any]:
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(case.fn.arg_names):
        if name in case.constants:
            signature[name] = "constexpr"
        elif name in case.pointers:
            signature[name] = "*" + case.pointers[name]
        else:
            signature[name] = "fp32" if name in case.floats else "i32"
        aligned = name in case.aligned or (name.startswith("stride") and name not in case.unaligned)
        if signature[name].startswith("*") or aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=case.fn, signature=signature, constexprs=case.constants, attrs=attrs)
    options = {"num_warps": case.num_warps, "num_stages": case.num_stages}
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True
        ).stdout
        sass = subprocess.run(
            [_tool("cuobjdump"), "--dump-sass", path], capture_output=True, text=True
        ).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    mma = next((op for op in ("HGMMA", "HMMA") if op in sass), "none")
    return {
        "regs": int(regs.group(1)) if regs else -1,
        "stack": int(stack.group(1)) if stack else -1,
        "shared": kernel.metadata.shared,
        "mma": mma,
    }


def attention_case(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    max_q: int,
    causal: bool,
    splits: int,
    windowed: bool = False,
    kv_fp8: bool = False,
) -> Case:
    """kv_fp8: the caches in float8_e4m3fn (fp8e4nv) with their scales."""
    cfg = ta._config(dtype, head_dim, max_q, group, kv_fp8)
    t = _TYPES[dtype]
    part = "fp32" if splits > 1 else t
    cache = "fp8e4nv" if kv_fp8 else t
    return Case(
        label=f"attention {t} D={head_dim} group={group} max_q={max_q} "
        f"{'causal' if causal else 'non-causal'}{' windowed' if windowed else ''} "
        f"splits={splits}{' fp8 kv' if kv_fp8 else ''} {cfg}",
        fn=ta._paged_attention_kernel,
        pointers=dict(
            q_ptr=t,
            k_cache_ptr=cache,
            v_cache_ptr=cache,
            out_ptr=t,
            part_out_ptr=part,
            part_lse_ptr=part,
            active_ptr="i32",
            cu_q_ptr="i32",
            kv_lens_ptr="i32",
            page_table_ptr="i32",
            kv_scale_ptr="fp32" if kv_fp8 else "i32",
        ),
        floats=("scale_log2",),
        constants=dict(
            GROUP=group,
            HEAD_DIM=head_dim,
            PAGE_SIZE=16,
            BLOCK_Q=cfg.block_q,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            CAUSAL=causal,
            WINDOWED=windowed,
            NUM_SPLITS=splits,
            MIN_SPLIT_KV=ta.MIN_SPLIT_KV,
            DOT_F32=dtype == torch.float32,
            PRECISION=ta._dot_precision(dtype),
            KV_FP8=kv_fp8,
            FP8_WORDS=cfg.fp8_words,
        ),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        unaligned=("stride_pt",),
    )


def topk_cases(quick: bool) -> Iterator[Case]:
    """The vocabulary top-K's two stages at a 152k vocabulary, K 1, 16 (DFlash2's) and 64 (quick:
    bf16 and K 16 only). The launcher specializes a unit element stride to 1 and finds V
    (151936) divisible by 16, which lets the row's loads be 16 bytes wide."""
    dtypes, ks = (
        ([torch.bfloat16], [16])
        if quick
        else ([torch.bfloat16, torch.float32], [1, 16, topk.MAX_K])
    )
    for dtype, k in itertools.product(dtypes, ks):
        t = _TYPES[dtype]
        chunks = -(-151_936 // topk._CHUNK)
        # the groups' buffer [N, chunks, K]: its strides as the launcher finds them
        grouped = tuple(n for n, d in (("s_gn", chunks * k), ("s_gc", k)) if d % 16 == 0)
        yield Case(
            f"top-K chunks {t} K={k} CHUNK={topk._CHUNK}",
            topk._chunk_groups_kernel,
            dict(x_ptr=t, groups_ptr="i64"),
            (),
            dict(K=k, CHUNK=topk._CHUNK, GROUP=topk._GROUP, s_xv=1),
            topk._WARPS,
            aligned=("V", "s_xn", *grouped),
        )
        yield Case(
            f"top-K rows {t} K={k} chunks={chunks}",
            topk._row_topk_kernel,
            dict(x_ptr=t, groups_ptr="i64", values_ptr=t, indices_ptr="i64"),
            (),
            dict(K=k, GROUP=topk._GROUP, BLOCK_C=triton.next_power_of_2(chunks * k), s_xv=1),
            topk._WARPS,
            aligned=("V", "s_xn", *grouped),
        )


def cases(quick: bool) -> Iterator[Case]:
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    dims = [128] if quick else [64, 128, 256]
    groups = [4] if quick else [1, 4, 8]
    for dtype, dim, group, max_q, causal, splits in itertools.product(
        dtypes, dims, groups, [1, 16, 512], [True, False], [1, 4]
    ):
        if max_q == 512 and (not causal or splits > 1):
            continue
        if quick and (max_q == 512 or not causal or (max_q > 1 and splits > 1)):
            continue  # decode with and without splits, and verify
        yield attention_case(dtype, dim, group, max_q, causal, splits)
        if max_q == 16 and not quick:  # a sliding-window draft layer's block
            yield attention_case(dtype, dim, group, max_q, causal, splits, windowed=True)
        if dtype != torch.float32:  # over an FP8 KV cache
            yield attention_case(dtype, dim, group, max_q, causal, splits, kv_fp8=True)
    if quick:
        return
    yield from topk_cases(quick=False)
    for dtype, heads, dim, splits in [
        (torch.bfloat16, 32, 128, 4),
        (torch.float32, 32, 128, 16),
        (torch.bfloat16, 64, 128, 16),
        (torch.bfloat16, 32, 256, 2),
    ]:
        t = _TYPES[dtype]
        block_s, block_h = ta._combine_blocks(splits, heads)
        yield Case(
            f"combine {t} heads={heads} D={dim} splits={splits}",
            ta._combine_kernel,
            dict(
                out_ptr=t,
                part_out_ptr="fp32",
                part_lse_ptr="fp32",
                active_ptr="i32",
                cu_q_ptr="i32",
            ),
            (),
            dict(
                NUM_HEADS=heads,
                HEAD_DIM=dim,
                BLOCK_S=block_s,
                BLOCK_H=block_h,
            ),
            4,
        )
    for dtype, kv_fp8 in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        t = _TYPES[dtype]
        cache = "fp8e4nv" if kv_fp8 else t
        yield Case(
            f"write_kv {t}{' to fp8' if kv_fp8 else ''} kv_heads=8 D=128",
            ta._write_kv_kernel,
            dict(k_ptr=t, v_ptr=t, k_cache_ptr=cache, v_cache_ptr=cache, kv_index_ptr="i64")
            | dict(kv_scale_ptr="fp32" if kv_fp8 else "i64"),
            (),
            dict(NUM_HEADS=8, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=8, KV_FP8=kv_fp8),
            4,
        )
        if kv_fp8:
            continue
        yield Case(
            f"add + rms_norm {t} N=4096",
            fused._rms_norm_kernel,
            dict(x_ptr=t, residual_ptr=t, w_ptr=t, out_ptr=t),
            ("eps",),
            dict(N=4096, BLOCK=4096, ADD_RESIDUAL=True),
            fused._warps(4096),
        )
        yield Case(
            f"qk_norm_rope {t} heads=32/8 D=128",
            fused._qk_norm_rope_kernel,
            dict(
                q_ptr=t,
                k_ptr=t,
                qw_ptr=t,
                kw_ptr=t,
                cos_ptr="fp32",
                sin_ptr="fp32",
                pos_ptr="i64",
            ),
            ("eps",),
            dict(Q_HEADS=32, K_HEADS=8, BLOCK_HQ=32, BLOCK_HK=8, HALF=64, HAS_K=True),
            fused._warps(32 * 128),
        )
        yield Case(
            f"silu_and_mul {t} I=12288",
            fused._silu_and_mul_kernel,
            dict(gu_ptr=t, out_ptr=t),
            (),
            dict(N=12288, BLOCK=1024),
            fused._warps(1024),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Qwen3-8B attention shapes only")
    parser.add_argument(
        "--top-k",
        action="store_true",
        help="the vocabulary top-K's stages only (with --quick: DFlash2's)",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    if not available():
        print("Triton's NVIDIA backend tools (ptxas, cuobjdump) are not installed", file=sys.stderr)
        return 2
    bad = 0
    for case in topk_cases(args.quick) if args.top_k else cases(args.quick):
        try:
            r = compile_case(case)
        except Exception as e:  # a compile error is a finding, report it and go on
            bad += 1
            print(f"FAIL {case.label}: {type(e).__name__}: {str(e)[:500]}", flush=True)
            continue
        spills = r["stack"] > MAX_STACK
        bad += spills
        print(
            f"{'SPILL' if spills else 'ok'} {case.label}: regs {r['regs']} stack {r['stack']} "
            f"shared {r['shared']} mma {r['mma']}",
            flush=True,
        )
    print(f"{bad} failing or spilling configurations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
