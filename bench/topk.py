"""What the vocabulary top-K costs on the GPU: the Triton kernel (batchrun/kernels/triton_topk.py)
against torch.topk, the path it replaced, and an argmax over the same rows (DFlash's cost for the
same head), each captured in a CUDA graph of REPEATS calls as the drafting graph runs it
(engine/device_rates.py's graph_ms).

    python bench/topk.py [--rows 15,16,480] [--vocab 151936] [--k 16] [--out FILE.json]

Rows: DFlash2's draft rows are (block size - 1) x batch, 15 at batch 1 and 480 at batch 32; the
logits are random bf16. Prints one line per row count and writes them to --out as JSON, with its
provenance (commit, device, command).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from batchrun.bench.provenance import provenance
from batchrun.engine.device_rates import graph_ms
from batchrun.kernels.triton_topk import topk_triton

REPEATS = 20  # calls per graph: one replay's launch cost spread over them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="15,16,480")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    points = []
    for n in (int(r) for r in args.rows.split(",")):
        x = torch.randn(n, args.vocab, device="cuda").bfloat16()
        mine, want = topk_triton(x, args.k), x.topk(args.k)
        assert torch.equal(mine[0], want.values), "the kernel's values differ from torch.topk's"
        point = {
            "rows": n,
            "vocab": args.vocab,
            "k": args.k,
            "triton_topk_ms": graph_ms(lambda _, x=x: topk_triton(x, args.k), REPEATS),
            "torch_topk_ms": graph_ms(lambda _, x=x: torch.topk(x, args.k), REPEATS),
            "argmax_ms": graph_ms(lambda _, x=x: torch.argmax(x, dim=-1), REPEATS),
            "logits_read_gb": x.numel() * x.element_size() / 1e9,
        }
        points.append(point)
        print(point, flush=True)
    if args.out:
        result = {"points": points, "provenance": provenance()}
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
