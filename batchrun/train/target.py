"""Train the demo target (transformers' Qwen3ForCausalLM) on packed tokens of stdlib train files.

    python -m batchrun.train.target --out DIR [--steps N] [--seq-len N] [--batch-size N]
                                    [--device auto] [--seed 0] [--tokenizer DIR] ...

The defaults fit a few minutes on one H200. The embedding has a few rows beyond the tokenizer's
length, as real Qwen3 checkpoints do, so the drafter's mask token can be a real row that no text
maps to (docs/dflash.md section 7). Weights are saved in bfloat16; batchrun upcasts them on CPU.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from batchrun.device import resolve_device
from batchrun.tools.bpe import ENDOFTEXT, build_tokenizer
from batchrun.train import (
    LossLog,
    autocast,
    environment,
    log,
    lr_factor,
    seed_everything,
    write_report,
)
from batchrun.train.corpus import Corpus, load_corpus, token_stream


@dataclass(frozen=True)
class TargetShape:
    vocab_size: int = 4096  # the tokenizer's; the embedding adds padded_rows
    padded_rows: int = 8
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_positions: int = 1024


@dataclass(frozen=True)
class TargetRun:
    steps: int = 2000
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    eval_tokens: int = 1_000_000
    seed: int = 0
    device: str = "auto"
    time_limit: float = 330.0  # seconds of training; a safety net, the steps should fit
    log_every: int = 50


def prepare_tokenizer(
    out: Path, corpus: Corpus, tokenizer_dir: Path | None, vocab_size: int, max_bytes: int
) -> PreTrainedTokenizerBase:
    """Copy tokenizer_dir, or train bpe's tokenizer on the train files; save it to out.

    A base code model ends documents with <|endoftext|> (as Qwen3 base models do), so that is
    its eos everywhere: tokenizer, config and generation config.
    """
    tokenizer: PreTrainedTokenizerBase
    if tokenizer_dir is None:
        tokenizer = build_tokenizer(
            out, vocab_size=vocab_size, files=corpus.train, max_bytes=max_bytes
        )
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.eos_token = ENDOFTEXT
    tokenizer.save_pretrained(str(out))
    return tokenizer


def qwen3_config(shape: TargetShape, tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    eos = tokenizer.get_vocab()[ENDOFTEXT]
    return Qwen3Config(
        vocab_size=len(tokenizer) + shape.padded_rows,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=None,
    )


def sample_windows(
    stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator
) -> torch.Tensor:
    """batch_size windows of seq_len tokens at random offsets of the packed stream."""
    starts = torch.randint(0, len(stream) - seq_len + 1, (batch_size,), generator=gen)
    index = starts[:, None] + torch.arange(seq_len)
    return stream[index.to(stream.device)]


def optimizer_for(model: torch.nn.Module, run: TargetRun) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; norms' gains stay free."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": run.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = params[0].device.type == "cuda"  # one kernel per step instead of one per tensor
    return torch.optim.AdamW(groups, lr=run.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


@torch.no_grad()
def heldout_loss(
    model: Qwen3ForCausalLM, stream: torch.Tensor, run: TargetRun
) -> tuple[float, int]:
    """Mean next-token loss over non-overlapping windows of the held-out stream, and its count."""
    model.eval()
    windows = min(len(stream) // run.seq_len, max(1, run.eval_tokens // run.seq_len))
    rows = stream[: windows * run.seq_len].view(windows, run.seq_len)
    total, count = 0.0, 0
    for batch in rows.split(run.batch_size):
        with autocast(stream.device):
            logits = model(input_ids=batch).logits[:, :-1]
        labels = batch[:, 1:]
        total += float(
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        )
        count += labels.numel()
    model.train()
    return total / max(count, 1), count


def train_target(
    model: Qwen3ForCausalLM, stream: torch.Tensor, run: TargetRun
) -> tuple[LossLog, int, float]:
    """The training loop: (loss log, steps done, seconds). Stops early past run.time_limit."""
    gen = torch.Generator().manual_seed(run.seed)
    optimizer = optimizer_for(model, run)
    losses = LossLog(every=run.log_every)
    model.train()
    start = time.monotonic()
    step = 0
    while step < run.steps and time.monotonic() - start < run.time_limit:
        for group in optimizer.param_groups:
            group["lr"] = run.lr * lr_factor(step, run.steps, run.warmup, run.min_lr_ratio)
        batch = sample_windows(stream, run.batch_size, run.seq_len, gen)
        with autocast(stream.device):
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        point = losses.add(step, loss)
        step += 1
        if point is not None:
            rate = step * run.batch_size * run.seq_len / (time.monotonic() - start)
            log(f"target step {step}/{run.steps} loss {point['loss']:.4f} ({rate:,.0f} tok/s)")
    return losses, step, time.monotonic() - start


def save_target(model: Qwen3ForCausalLM, out: Path) -> int:
    """save_pretrained in bfloat16 with a generation config; returns the weights' bytes."""
    eos = model.config.eos_token_id
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos)
    model.to(torch.bfloat16).save_pretrained(str(out))  # type: ignore[arg-type]
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def run_target(
    out: Path,
    shape: TargetShape,
    run: TargetRun,
    corpus: Corpus,
    tokenizer_dir: Path | None = None,
    tokenizer_bytes: int = 4_000_000,
) -> dict[str, Any]:
    """Tokenizer, packed corpus, model, training, held-out loss, checkpoint and report."""
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(run.device)
    seed_everything(run.seed)
    tokenizer = prepare_tokenizer(out, corpus, tokenizer_dir, shape.vocab_size, tokenizer_bytes)
    eos = tokenizer.get_vocab()[ENDOFTEXT]
    log(f"tokenizing {len(corpus.train)} train and {len(corpus.heldout)} held-out files")
    train_ids = token_stream(tokenizer, corpus.train, eos)
    heldout_ids = token_stream(tokenizer, corpus.heldout, eos)
    if len(train_ids) <= run.seq_len or len(heldout_ids) <= run.seq_len:
        raise ValueError(f"the corpus under {corpus.root} is too small for seq_len {run.seq_len}")
    train_stream = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    heldout_stream = torch.from_numpy(heldout_ids.astype(np.int64)).to(device)

    model = Qwen3ForCausalLM(qwen3_config(shape, tokenizer)).to(device)  # type: ignore[arg-type]
    losses, steps_done, seconds = train_target(model, train_stream, run)
    loss, eval_tokens = heldout_loss(model, heldout_stream, run)
    log(f"held-out loss {loss:.4f} per token over {eval_tokens:,} tokens")
    weight_bytes = save_target(model, out)
    report = {
        "environment": environment(device),
        "corpus": {
            "root": str(corpus.root),
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout),
            "train_tokens": int(len(train_ids)),
            "heldout_tokens": int(len(heldout_ids)),
        },
        "tokenizer": {"length": len(tokenizer), "eos_token_id": eos},
        "shape": asdict(shape) | {"embedding_rows": model.config.vocab_size},
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_bytes": weight_bytes,
        "run": asdict(run),
        "steps_done": steps_done,
        "stopped_early": steps_done < run.steps,
        "train_seconds": round(seconds, 1),
        "tokens_seen": steps_done * run.batch_size * run.seq_len,
        "train_loss": losses.summary(),
        "heldout": {"loss_per_token": loss, "perplexity": math.exp(loss), "tokens": eval_tokens},
    }
    write_report(out, report)
    return report


def main(argv: list[str] | None = None) -> None:
    d, r = TargetShape(), TargetRun()
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.train.target",
        description="Train the demo Qwen3 code model on this interpreter's standard library.",
    )
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=r.steps)
    parser.add_argument("--batch-size", type=int, default=r.batch_size)
    parser.add_argument("--seq-len", type=int, default=r.seq_len)
    parser.add_argument("--lr", type=float, default=r.lr)
    parser.add_argument("--warmup", type=int, default=r.warmup, help="warmup steps")
    parser.add_argument("--weight-decay", type=float, default=r.weight_decay)
    parser.add_argument("--eval-tokens", type=int, default=r.eval_tokens)
    parser.add_argument("--seed", type=int, default=r.seed)
    parser.add_argument("--device", default=r.device, help="auto, cpu or cuda")
    parser.add_argument("--time-limit", type=float, default=r.time_limit, help="seconds")
    parser.add_argument("--log-every", type=int, default=r.log_every)
    parser.add_argument("--hidden", type=int, default=d.hidden_size)
    parser.add_argument("--layers", type=int, default=d.num_layers)
    parser.add_argument("--heads", type=int, default=d.num_heads)
    parser.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    parser.add_argument("--head-dim", type=int, default=d.head_dim)
    parser.add_argument("--intermediate", type=int, default=d.intermediate_size)
    parser.add_argument("--max-positions", type=int, default=d.max_positions)
    parser.add_argument("--padded-rows", type=int, default=d.padded_rows)
    parser.add_argument("--vocab", type=int, default=d.vocab_size, help="BPE vocab to train")
    parser.add_argument("--tokenizer-bytes", type=int, default=4_000_000)
    parser.add_argument("--tokenizer", type=Path, default=None, help="reuse this tokenizer")
    parser.add_argument("--corpus-root", type=Path, default=None, help="default: the stdlib")
    a = parser.parse_args(argv)
    if a.padded_rows < 1:
        parser.error("--padded-rows must be >= 1: the drafter's mask token is a padded row")
    shape = TargetShape(
        vocab_size=a.vocab,
        padded_rows=a.padded_rows,
        hidden_size=a.hidden,
        num_layers=a.layers,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.intermediate,
        max_positions=a.max_positions,
    )
    run = TargetRun(
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        lr=a.lr,
        warmup=a.warmup,
        weight_decay=a.weight_decay,
        eval_tokens=a.eval_tokens,
        seed=a.seed,
        device=a.device,
        time_limit=a.time_limit,
        log_every=a.log_every,
    )
    corpus = load_corpus(a.corpus_root)
    report = run_target(a.out, shape, run, corpus, a.tokenizer, a.tokenizer_bytes)
    log(f"wrote {a.out} ({report['weights_bytes'] / 1e6:.2f} MB of weights)")


if __name__ == "__main__":
    main()
