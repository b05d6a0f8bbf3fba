"""Stop strings against the real tokenizer: found however many tokens (special ones included) a
stop string is split across, at the first token whose text holds it, with a constant amount of
decoding per committed token, and the completion text of a plain decode cut at the stop."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from batchrun.engine.core.requests import Request
from batchrun.engine.core.stopping import Stopper
from batchrun.sampling.params import SamplingParams
from batchrun.tools.bpe import ENDOFTEXT, IM_END, IM_START, split_files

MAX_TOKENS = 10**6


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def skipped_specials(tok: PreTrainedTokenizerBase) -> list[int]:
    """Special tokens that are not eos: decode skips them, and they finish nothing."""
    return [tok.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START)]


def make_stopper(tok: PreTrainedTokenizerBase) -> Stopper:
    return Stopper(tok, {tok.convert_tokens_to_ids(IM_END)}, max_model_len=MAX_TOKENS)


def commit(stopper: Stopper, ids: list[int], stops: tuple[str, ...], round_size: int) -> Request:
    """Commits ids in rounds of round_size, as decode (1) or verify (B) steps do."""
    req = Request(0, [1], SamplingParams(max_tokens=len(ids), stop=stops))
    for start in range(0, len(ids), round_size):
        stopper.commit(req, ids[start : start + round_size])
        if req.output.finish_reason:
            break
    return req


def source_text() -> str:
    return split_files()[1][5].read_text(encoding="utf-8")[:3000]


@pytest.mark.parametrize("round_size", [1, 5, 16])
def test_a_stop_string_split_across_many_tokens_and_special_tokens_is_found(
    tok: PreTrainedTokenizerBase, round_size: int
) -> None:
    stop = "done → ok"
    before = tok.encode("x = 1\n# ")
    pieces = [t for ch in stop for t in tok.encode(ch)]  # one token per byte of "→"
    assert len(pieces) == len(stop) + 2
    specials = skipped_specials(tok) * 5  # 10 special tokens between every two pieces
    split = [t for piece in pieces[:-1] for t in (piece, *specials)] + pieces[-1:]
    ids = before + split + tok.encode(" and more")
    assert tok.decode(ids, skip_special_tokens=True) == "x = 1\n# done → ok and more"
    req = commit(make_stopper(tok), ids, ("never there", stop), round_size)
    assert req.output.finish_reason == "stop"
    assert req.output.token_ids == before + split  # cut at the token that completes the stop
    assert req.output.completion == "x = 1\n# "


def test_stops_at_the_first_token_whose_text_holds_a_stop(tok: PreTrainedTokenizerBase) -> None:
    """Random stop strings cut from a text with multi-byte characters and special tokens strewn
    in it, against the plain rule: decode every prefix, stop at the first holding a stop."""
    text = source_text().replace("self", "sélf→").replace("return", "ret\u00a0urn")
    rng = random.Random(0)
    ids: list[int] = []
    for t in tok.encode(text)[:300]:
        ids += [t] + [rng.choice(skipped_specials(tok)) for _ in range(rng.choice([0, 0, 0, 3]))]
    clean = tok.decode(ids, skip_special_tokens=True)
    for trial in range(40):
        stops = []
        for _ in range(rng.randint(1, 3)):
            at, size = rng.randrange(len(clean)), rng.randint(1, 12)
            stops.append(clean[at : at + size] if trial % 5 else f"absent{trial}")
        stops = [s for s in stops if s]
        want = next(
            (
                i
                for i in range(1, len(ids) + 1)
                if any(s in tok.decode(ids[:i], skip_special_tokens=True) for s in stops)
            ),
            None,
        )
        req = commit(make_stopper(tok), ids, tuple(stops), round_size=trial % 4 + 1)
        if want is None:
            assert req.output.finish_reason == "length" and req.output.completion == clean, stops
            continue
        assert (req.output.finish_reason, len(req.output.token_ids)) == ("stop", want), stops
        kept = tok.decode(ids[:want], skip_special_tokens=True)
        assert req.output.completion == kept[: min(kept.find(s) for s in stops if s in kept)], stops


class CountingDecode:
    """Wraps a tokenizer's decode, counting calls and token ids decoded."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self.decode, self.calls, self.ids = tok.decode, 0, 0

    def __call__(self, ids: list[int], *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.ids += len(ids)
        return self.decode(ids, *args, **kwargs)


@pytest.fixture
def counting(
    tok: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> Iterator[CountingDecode]:
    counter = CountingDecode(tok)
    monkeypatch.setattr(tok, "decode", counter)
    yield counter


def test_decoding_per_committed_token_is_constant(
    tok: PreTrainedTokenizerBase, counting: CountingDecode
) -> None:
    """However long the stop strings: at most two small decodes per token, and one of the whole
    completion when the request finishes."""
    ids = tok.encode(source_text())[:400]
    stopper = make_stopper(tok)
    counting.calls = counting.ids = 0
    req = commit(stopper, ids, ("a stop string this text never holds, " * 3,), round_size=1)
    assert req.output.finish_reason == "length"
    calls, decoded = counting.calls - 1, counting.ids - len(ids)  # less the final decode
    assert calls <= 2 * len(ids)
    assert decoded <= 6 * len(ids)


def test_ignore_eos_outputs_the_eos_and_goes_on(tok: PreTrainedTokenizerBase) -> None:
    stopper = make_stopper(tok)
    eos = tok.convert_tokens_to_ids(IM_END)
    text = tok.encode("x = 1", add_special_tokens=False)
    ids = [*text, eos, *text]
    stops = Request(0, [1], SamplingParams(max_tokens=len(ids)))
    assert stopper.commit(stops, ids) == len(text) + 1 and stops.output.finish_reason == "stop"
    assert stops.output.completion == "x = 1"
    goes_on = Request(0, [1], SamplingParams(max_tokens=len(ids), ignore_eos=True))
    assert stopper.commit(goes_on, ids) == len(ids) and goes_on.output.finish_reason == "length"
    assert (
        goes_on.output.token_ids == ids and goes_on.output.completion == "x = 1x = 1"
    )  # eos decodes to ""
