"""Prompts cut from the stdlib corpus: a def or class line plus a few lines of its body.

    python -m batchrun.train.prompts --tokenizer DIR --out jobs/demo/prompts.parquet --count 48
                                     [--split heldout|train] [--seed 0]

The demo job uses the held-out split, so the target never saw the files its prompts come from.
The train split serves to make the drafter's training data (the target's completions of them).
Files are visited in a seeded order, one prompt per file per pass, so prompts spread over many
modules; the result is a pure function of the corpus, the tokenizer and the arguments.
"""

from __future__ import annotations

import argparse
import ast
import random
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchrun.train import log
from batchrun.train.corpus import Corpus, load_corpus

MAX_PROMPT_LINES = 30
Definition = tuple[int, int, int]  # 0-based lines: header, first body line, end (exclusive)


@dataclass(frozen=True)
class PromptSpec:
    count: int = 48
    min_tokens: int = 30
    max_tokens: int = 80
    seed: int = 0


def definitions(source: str) -> list[Definition]:
    """Every def and class, nested ones included, as located by the parser (decorators aside)."""
    nodes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [
        (node.lineno - 1, node.body[0].lineno - 1, node.end_lineno or node.lineno)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, nodes)
    ]


def prompt_at(
    lines: list[str],
    definition: Definition,
    tokenizer: PreTrainedTokenizerBase,
    spec: PromptSpec,
    rng: random.Random,
) -> str | None:
    """The header plus the first few lines of the body, dedented, within spec's token bounds.

    The cut is chosen by rng among those that fit and end on a non-blank line; at least one
    line of the definition is left for the model to write. None when no cut fits.
    """
    header, body, end = definition
    fits: list[str] = []
    for stop in range(max(body, header + 1) + 1, min(end, header + MAX_PROMPT_LINES + 1)):
        text = textwrap.dedent("".join(lines[header:stop]))
        n = len(tokenizer.encode(text))
        if n > spec.max_tokens:
            break
        if n >= spec.min_tokens and lines[stop - 1].strip():
            fits.append(text if text.endswith("\n") else text + "\n")
    return rng.choice(fits) if fits else None


def file_prompts(
    path: Path, tokenizer: PreTrainedTokenizerBase, spec: PromptSpec, rng: random.Random
) -> Iterator[str]:
    """Prompts from one file, its definitions visited in an rng order."""
    try:
        source = path.read_text(encoding="utf-8")
        found = definitions(source)
    except (UnicodeDecodeError, OSError, SyntaxError, ValueError):
        return  # the stdlib ships deliberately broken files (test data); skip them
    lines = source.splitlines(keepends=True)
    rng.shuffle(found)
    for definition in found:
        text = prompt_at(lines, definition, tokenizer, spec, rng)
        if text is not None:
            yield text


def make_prompts(
    corpus: Corpus, split: str, tokenizer: PreTrainedTokenizerBase, spec: PromptSpec
) -> list[tuple[str, str]]:
    """Up to spec.count distinct (prompt, source) pairs, one per file per round-robin pass."""
    rng = random.Random(spec.seed)
    files = list(corpus.files(split))
    rng.shuffle(files)
    # Each file draws from its own generator, so how far one file is read never shifts another.
    live = [
        (corpus.relative(f), file_prompts(f, tokenizer, spec, random.Random(rng.random())))
        for f in files
    ]
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    while live and len(out) < spec.count:
        still = []
        for source, prompts in live:
            text = next((t for t in prompts if t not in seen), None)
            if text is None:
                continue
            seen.add(text)
            out.append((text, source))
            still.append((source, prompts))
            if len(out) == spec.count:
                break
        live = still
    return out


def write_prompts(rows: list[tuple[str, str]], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "prompt": pa.array([r[0] for r in rows], pa.string()),
            "source": pa.array([r[1] for r in rows], pa.string()),
        }
    )
    pq.write_table(table, out)


def main(argv: list[str] | None = None) -> None:
    d = PromptSpec()
    parser = argparse.ArgumentParser(
        prog="python -m batchrun.train.prompts",
        description="Cut Python code prompts from the stdlib's held-out (or train) files.",
    )
    parser.add_argument("--tokenizer", type=Path, required=True, help="the target's directory")
    parser.add_argument("--out", type=Path, required=True, help="Parquet file to write")
    parser.add_argument("--count", type=int, default=d.count)
    parser.add_argument("--split", choices=("heldout", "train"), default="heldout")
    parser.add_argument("--min-tokens", type=int, default=d.min_tokens)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--corpus-root", type=Path, default=None, help="default: the stdlib")
    a = parser.parse_args(argv)
    spec = PromptSpec(a.count, a.min_tokens, a.max_tokens, a.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(a.tokenizer))
    rows = make_prompts(load_corpus(a.corpus_root), a.split, tokenizer, spec)
    if len(rows) < spec.count:
        log(f"only {len(rows)} prompts fit the bounds in the {a.split} files (asked {a.count})")
    write_prompts(rows, a.out)
    log(f"wrote {len(rows)} prompts to {a.out}")


if __name__ == "__main__":
    main()
