"""Structured outputs with a reasoning parser (issue 32, item 3): the grammar holds on the answer
only, from the token after the think block's `</think>` (the prompt's template opens the block,
or `<think>` as the first output token does), as vLLM's structured outputs do with a reasoning
parser; rows inside the block are unmasked, with a draft too, where a round's drafts cross
`</think>`; a thinking budget's forced end closes the block and the grammar starts after it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from batchrun.bench.hooks import BenchHooks
from batchrun.bench.oracle import AcceptanceOracle
from batchrun.config.job import JobSpec
from batchrun.engine.core.requests import Request
from batchrun.runners.local import run_job
from batchrun.sampling.constraint import Constraint
from batchrun.sampling.grammar import Grammars
from batchrun.sampling.grammar_masks import ConstrainedRows, build_masks
from batchrun.sampling.params import SamplingParams
from batchrun.sampling.row_grammar import Phase, RowGrammar
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.engine_runs import cpu_engine, run_to_end

pytestmark = pytest.mark.usefixtures("one_thread_module")

BLOCK = 4
REGEX = r"def [a-z_]{1,12}\((x|y|z)\): return [0-9]{1,3}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
# A thinking-only template (Qwen3-2507's): the generation prompt opens the think block.
OPENS_THINKING = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def model(make_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target whose tokenizer has <think> and </think> (its vocabulary covers them) and
    whose template opens the think block."""
    out = tmp_path_factory.mktemp("thinks") / "model"
    shutil.copytree(make_model(vocab_size=1040), out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = OPENS_THINKING
    tokenizer.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def draft(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_draft(tmp_path_factory.mktemp("draft"), model, block_size=BLOCK)


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def grammars(model: Path, tokenizer: PreTrainedTokenizerBase) -> Grammars:
    return Grammars(tokenizer, 1040, [tokenizer.eos_token_id])


def think_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return int(start), int(end)


def allowed(bits: torch.Tensor, row: int, vocab: int) -> set[int]:
    unpacked = (bits[row, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(unpacked.view(-1)[:vocab].nonzero().view(-1).tolist())


# -- the masks of one row's states -------------------------------------------------------------


def test_rows_inside_the_block_are_unmasked_and_a_drafted_end_starts_the_grammar(
    grammars: Grammars, tokenizer: PreTrainedTokenizerBase
) -> None:
    start, end = think_ids(tokenizer)
    vocab = grammars.vocab_size
    matcher = grammars.matcher(Constraint("choice", ("yes", "no")))
    fresh = grammars.bitmask(1)
    matcher.fill_next_token_bitmask(fresh, 0)
    grammar_start = allowed(fresh, 0, vocab) - {start, end}
    y, word = (
        tokenizer.encode("yes", add_special_tokens=False)[0],
        tokenizer.encode("why", add_special_tokens=False)[0],
    )
    # The prompt opened the block: the drafts think, close it, answer, then go wrong.
    grammar = RowGrammar.of(matcher, (start, end), [5, start])
    assert grammar.phase is Phase.THINKING
    masks = build_masks(
        grammars,
        [ConstrainedRows(grammar, 0, 6, [word, end, y, word, y])],
        torch.device("cpu"),
    )
    rows = [allowed(masks.bits, j, vocab) for j in range(6)]
    assert len(rows[0]) == len(rows[1]) == vocab  # inside the block: no mask
    assert rows[2] == grammar_start  # after the drafted </think>: the grammar, fed nothing
    assert end not in rows[2] and start not in rows[2]  # the answer holds no think token
    assert word not in rows[3] and 0 < len(rows[3]) < len(rows[2])  # after "y..."
    assert len(rows[4]) == len(rows[5]) == vocab  # after a forbidden draft: never committed
    # Taken back: still thinking, the matcher at its start.
    assert grammar.phase is Phase.THINKING and matcher.accept_token(
        tokenizer.encode("no", add_special_tokens=False)[0]
    )


def test_the_first_token_may_open_a_block_and_the_answer_holds_no_think_token(
    grammars: Grammars, tokenizer: PreTrainedTokenizerBase
) -> None:
    start, end = think_ids(tokenizer)
    vocab = grammars.vocab_size
    constraint = Constraint("choice", ("yes", "no"))
    grammar = RowGrammar.of(grammars.matcher(constraint), (start, end), [5, 6])
    assert grammar.phase is Phase.MAY_THINK
    word = tokenizer.encode("why", add_special_tokens=False)[0]
    masks = build_masks(
        grammars, [ConstrainedRows(grammar, 0, 3, [start, word])], torch.device("cpu")
    )
    first = allowed(masks.bits, 0, vocab)
    assert start in first and end not in first and word not in first
    assert len(allowed(masks.bits, 1, vocab)) == vocab  # the block <think> opened
    # Committed: <think>, thought, </think>: the answer's grammar starts fed nothing.
    grammar.commit([start, word, end])
    assert grammar.phase is Phase.ANSWER
    masks = build_masks(grammars, [ConstrainedRows(grammar, 0, 2, [start])], torch.device("cpu"))
    assert start not in allowed(masks.bits, 0, vocab)
    assert len(allowed(masks.bits, 1, vocab)) == vocab  # <think> in the answer: forbidden
    # No block: the first token is the grammar's, and the grammar holds from it.
    other = RowGrammar.of(grammars.matcher(constraint), (start, end), [5, 6])
    other.commit(tokenizer.encode("no", add_special_tokens=False))
    assert other.phase is Phase.ANSWER and other.matcher.is_completed()
    # A forced end (a thinking budget): the grammar starts after it, fed nothing.
    forced = RowGrammar.of(grammars.matcher(constraint), (start, end), [5, start])
    forced.commit([word, *tokenizer.encode("\n</think>\n\n", add_special_tokens=False)], 3)
    assert forced.phase is Phase.ANSWER and forced.matcher.accept_token(
        tokenizer.encode("no", add_special_tokens=False)[0]
    )


# -- the engine: exactly constrained decoding after the block, with and without a draft --------


def reference(
    model_dir: Path,
    grammars: Grammars,
    constraint: Constraint,
    prompt: list[int],
    bias: tuple[int, float],
    max_tokens: int,
) -> list[int]:
    """Greedy decoding over transformers' logits (the bias added): unmasked until </think>, then
    the grammar's mask without the think tokens, its matcher fed from the token after."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start, end = think_ids(tokenizer)
    matcher, bits = grammars.matcher(constraint), grammars.bitmask(1)
    ids, out, thinking = list(prompt), [], True
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        logits[bias[0]] += bias[1]
        if not thinking:
            matcher.fill_next_token_bitmask(bits, 0)
            ok = (bits[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
            logits[ok.view(-1)[: logits.shape[0]] == 0] = float("-inf")
            logits[[start, end]] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token == tokenizer.eos_token_id:
            break
        if thinking:
            thinking = token != end
        else:
            assert matcher.accept_token(token)
        ids.append(token)
    return out


def end_bias(model_dir: Path, prompt: list[int], end: int) -> tuple[int, float]:
    """A logit bias on </think> that makes the greedy row close its block after 2 or more
    thought tokens: between the margin by which it loses there and where it loses before."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, gaps = list(prompt), []
    for _ in range(12):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        gaps.append(float(logits.max() - logits[end]))
        ids.append(int(logits.argmax()))
    k = max(range(2, 12), key=lambda i: min(gaps[:i]) - gaps[i])
    assert min(gaps[:k]) - gaps[k] > 1e-2, gaps
    return end, (min(gaps[:k]) + gaps[k]) / 2


def test_the_engine_is_greedy_decoding_with_the_grammar_after_the_block(
    model: Path, draft: Path, grammars: Grammars, tokenizer: PreTrainedTokenizerBase
) -> None:
    start, end = think_ids(tokenizer)
    prompt = [*tokenizer.encode("def add(a, b):"), start]
    bias = end_bias(model, prompt, end)
    constraint = Constraint("regex", REGEX)
    params = SamplingParams(
        max_tokens=40, constraint=constraint, reasoning=True, logit_bias=(bias,)
    )
    expected = reference(model, grammars, constraint, prompt, bias, 40)
    assert 2 <= expected.index(end) < len(expected) - 2 and expected[-1] == tokenizer.eos_token_id
    answer = tokenizer.decode(expected[expected.index(end) + 1 : -1], skip_special_tokens=True)
    assert re.fullmatch(REGEX, answer), answer
    settings = {"max_batch_size": 4, "num_pages": 128, "verify_width": "full"}
    (plain,) = run_to_end(cpu_engine(model, None, **settings), [Request(0, prompt, params)])
    assert plain.output.token_ids == expected and plain.output.finish_reason == "stop"
    # Drafts the target accepts (its own continuation) cross </think> inside verify rounds.
    engine = cpu_engine(model, draft, **settings)
    oracle = AcceptanceOracle({0: expected}, BLOCK, BLOCK, 4, engine.vocab_size, engine.device)
    engine.speculator.hooks = BenchHooks(oracle=oracle)
    engine.instruments.rounds = []
    (drafted,) = run_to_end(engine, [Request(0, prompt, params)])
    assert drafted.output.token_ids == expected
    crossed = [r for r in engine.instruments.rounds if end in r.committed[:-1]]
    assert crossed, [r.committed for r in engine.instruments.rounds]


def test_a_thinking_budget_closes_the_block_and_the_grammar_holds_after_it(
    model: Path, draft: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    start, _ = think_ids(tokenizer)
    prompt = [*tokenizer.encode("def add(a, b):"), start]
    params = SamplingParams(
        max_tokens=48, constraint=Constraint("regex", REGEX), reasoning=True, max_thinking_tokens=3
    )
    assert params.problem() is None  # refused before a reasoning row's grammar waited
    assert "reasoning_parser" in (
        SamplingParams(constraint=Constraint("regex", REGEX), max_thinking_tokens=3).problem() or ""
    )
    forced = tokenizer.encode("\n</think>\n\n", add_special_tokens=False)
    outputs = []
    for drafter in (None, draft):
        engine = cpu_engine(model, drafter, max_batch_size=4, num_pages=128)
        (req,) = run_to_end(engine, [Request(0, prompt, params)])
        ids = req.output.token_ids
        assert ids[3 : 3 + len(forced)] == forced and req.output.finish_reason == "stop"
        answer = tokenizer.decode(ids[3 + len(forced) : -1], skip_special_tokens=True)
        assert re.fullmatch(REGEX, answer), answer
        outputs.append(ids)
    assert outputs[0] == outputs[1]


# -- a job: the completion is the answer, held to its schema --------------------------------


def test_a_reasoning_job_holds_the_answer_to_the_schema(model: Path, tmp_path: Path) -> None:
    """The issue's job: a template that opens the think block, --reasoning-parser qwen3 and a
    json_schema; a thinking budget closes the block (a tiny model never does)."""
    messages = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    chats = [[{"role": "user", "content": "def add(a, b):"}]] * 3
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"messages": pa.array(chats, messages)}), tmp_path / "in" / "c.parquet")
    spec = JobSpec.from_keys(
        dict(
            input=str(tmp_path / "in"),
            output=str(tmp_path / "out"),
            target=str(model),
            max_tokens=64,
            device="cpu",
            dtype="float32",
            quiet=True,
            reasoning_parser="qwen3",
            max_thinking_tokens=4,
            json_schema=json.dumps(SCHEMA),
        )
    )
    run_job(spec)
    rows = pq.read_table(sorted((tmp_path / "out").glob("part-*.parquet"))[0]).to_pylist()
    assert len(rows) == 3
    for row in rows:
        assert row["error"] is None and row["finish_reason"] == "stop", row
        assert row["reasoning"] is not None and row["reasoning_tokens"] >= 4
        jsonschema.validate(json.loads(row["completion"]), SCHEMA)
