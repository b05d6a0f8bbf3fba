"""DFlash drafts beyond z-lab's first format, part by part: the speculators config read as the
same draft in z-lab's format, which layers are causal in the block, the ring of pages that holds
a sliding layer's context (bounded over a 2,000-token generation that wraps it over a hundred
times, outputs and drafts unchanged), and what the KV budget counts for a sliding draft.

Every kind against target-only decoding and the plain reference is in test_dflash_engine.py;
the prefix-cache rule for sliding drafts in test_prefix_cache.py and test_scheduler.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchrun.engine.config import EngineConfig
from batchrun.engine.core.requests import Request
from batchrun.engine.engine import Engine
from batchrun.engine.memory import CPU_KV_BUDGET_BYTES, kv_pages, layer_page_bytes
from batchrun.engine.startup import ROPE_HEADROOM, Models
from batchrun.models.block_attention import BlockAttention
from batchrun.models.dflash_loader import check_draft, load_dflash
from batchrun.models.loader import load_qwen3, qwen3_shape, read_config
from batchrun.models.qwen3 import Qwen3Shape
from batchrun.sampling.params import SamplingParams
from batchrun.spec_decode.dflash.rings import DraftRing
from batchrun.spec_decode.dflash.speculator import DFlashSpeculator
from batchrun.tools.tiny_draft import make_tiny_draft
from tests.helpers.dflash_reference import load_target, reference_drafts
from tests.helpers.dflash_train import TARGET_SHAPE

MakeModel = Callable[..., Path]
pytestmark = pytest.mark.usefixtures("one_thread_module")  # module fixtures (drafts) too
CPU = torch.device("cpu")


def engine(target: Path, draft: Path | None, **config: Any) -> Engine:
    """An engine without stop tokens (the tiny target would stop at random), float32."""
    settings: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "attention_backend": "torch",
        "cuda_graphs": False,
        "page_size": 4,
        "max_batch_size": 4,
        "max_batched_tokens": 64,
        "verify_width": "full",
    }
    cfg = EngineConfig(target=target, draft=draft, **(settings | config))
    model, _ = load_qwen3(target, "float32", CPU, ROPE_HEADROOM)
    positions = model.shape.max_position_embeddings + ROPE_HEADROOM
    loaded = load_dflash(draft, model, CPU, positions) if draft is not None else None
    built = Engine(cfg, models=Models(model, loaded))
    built.instruments.rounds = []
    return built


def generate(built: Engine, prompts: list[list[int]], max_tokens: int) -> list[Request]:
    requests = [Request(i, p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    for req in requests:
        built.add(req)
    while built.num_unfinished:
        built.step()
    return requests


def check_drafts(
    built: Engine, target: Path, draft: Path, requests: list[Request], every: int = 1
) -> int:
    """Every `every`-th round of each request drafted what the reference drafts from the same
    context; returns how many rounds were checked."""
    assert built.instruments.rounds is not None
    checked = 0
    for req in requests:
        mine = [t for t in built.instruments.rounds if t.row_index == req.row_index][::every]
        sequence = req.prompt_ids + req.output.token_ids
        expected = reference_drafts(target, draft, sequence, [t.position for t in mine])
        for t in mine:
            assert t.anchor == sequence[t.position]
            assert list(t.drafts) == expected[t.position], (req.row_index, t.position)
        checked += len(mine)
    return checked


def check_greedy(target: Path, requests: list[Request]) -> None:
    """Each output token is the target's argmax after the tokens before it (transformers' own
    forward over the whole sequence): the target-only greedy output."""
    model = load_target(target)
    for req in requests:
        with torch.no_grad():
            logits = model(torch.tensor([req.prompt_ids + req.output.token_ids])).logits[0]
        start = len(req.prompt_ids) - 1
        assert logits[start:-1].argmax(-1).tolist() == req.output.token_ids, req.row_index


def test_a_speculators_draft_is_its_zlab_twin(target: Path, tmp_path: Path) -> None:
    """The same weights under either config: the speculators one lists hidden-state indices
    (aux ids [1, 4] for layers [0, 3]) and leaves out what equals Qwen3Config's defaults; both
    read as one draft and draft the same tokens."""
    kw: dict[str, Any] = {
        "num_layers": 2,
        "target_layer_ids": [0, 3],
        "sliding_window": 6,
        "sliding_layers": [0],
        "draft_vocab": list(range(1, 1088, 3)),
        "seed": 4,
    }
    zlab = make_tiny_draft(tmp_path / "zlab", target, **kw)
    speculators = make_tiny_draft(tmp_path / "speculators", target, speculators=True, **kw)
    config = json.loads((speculators / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [1, 4]
    assert not {"rms_norm_eps", "hidden_act", "attention_bias"} & set(
        config["transformer_layer_config"]
    )
    shape = qwen3_shape(read_config(target))
    a, b = check_draft(zlab, shape), check_draft(speculators, shape)
    assert (a.format, b.format) == ("z-lab", "speculators")
    fields = (
        "shape",
        "target_layer_ids",
        "block_size",
        "mask_token_id",
        "attention",
        "head_rows",
        "vocab_map",
    )
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert a.attention == BlockAttention((True, False), 6, False, True)
    assert (a.head_rows, a.vocab_map) == (363, True)

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (3, 17, 30)]
    traces = []
    for draft in (zlab, speculators):
        built = engine(target, draft, num_pages=64)
        generate(built, prompts, 24)
        assert built.instruments.rounds is not None
        traces.append([(t.row_index, t.position, t.drafts) for t in built.instruments.rounds])
    assert traces[0] == traces[1]


CAUSALITY: dict[str, tuple[dict[str, Any], tuple[bool, bool]]] = {
    # (full layers causal, sliding layers causal), as vLLM and speculators resolve them.
    "z-lab": ({}, (False, True)),
    "z-lab-dflash-config-causal": (
        {"extra_config": {"dflash_config": {"causal": True}}},
        (True, True),
    ),
    "z-lab-is-causal-first": (
        {"extra_config": {"is_causal": False, "dflash_config": {"causal": True}}},
        (False, False),
    ),
    "speculators": ({"speculators": True}, (False, True)),
    "speculators-non-causal-window": (
        {"speculators": True, "extra_config": {"sliding_window_non_causal": True}},
        (False, False),
    ),
}


@pytest.mark.parametrize("case", list(CAUSALITY))
def test_which_layers_are_causal_in_the_block(target: Path, tmp_path: Path, case: str) -> None:
    kw, (full, sliding) = CAUSALITY[case]
    kw = {"num_layers": 2, "sliding_window": 8, "sliding_layers": [1], **kw}
    if "dflash_config" in kw.get("extra_config", {}):
        kw["extra_config"]["dflash_config"]["mask_token_id"] = 1024
    draft = make_tiny_draft(tmp_path / "draft", target, **kw)
    attention = check_draft(draft, qwen3_shape(read_config(target))).attention
    assert (attention.full_causal, attention.sliding_causal) == (full, sliding)
    assert attention.sliding == (False, True) and attention.window == 8


def test_layer_types_default_as_transformers_derives_them(target: Path, tmp_path: Path) -> None:
    """No layer_types: with use_sliding_window, the layers from max_window_layers on slide."""
    extra = {
        "layer_types": None,
        "use_sliding_window": True,
        "sliding_window": 5,
        "max_window_layers": 2,
    }
    draft = make_tiny_draft(tmp_path / "draft", target, num_layers=3, extra_config=extra)
    attention = check_draft(draft, qwen3_shape(read_config(target))).attention
    assert attention.sliding == (False, False, True) and attention.window == 5


def test_a_chunk_longer_than_the_ring_stores_only_its_last_positions() -> None:
    """Slot 1 prefills positions 5 .. 44 in one write, slot 0 positions 0 .. 2: the ring (3
    pages of 4 per slot for W 8 and B 4) keeps each slot's last 12 positions, each in its own
    cache index, position i in ring page (i // 4) % 3 of its slot."""
    ring = DraftRing(num_slots=2, max_pages=16, window=8, block_size=4, page_size=4, device=CPU)
    assert (ring.pages_per_slot, ring.capacity, ring.num_pages) == (3, 12, 9)
    positions = torch.cat([torch.arange(5, 45), torch.arange(3)])
    slot = torch.tensor([1] * 40 + [0] * 3)
    end = torch.tensor([45] * 40 + [3] * 3)
    index = ring.kv_index(slot, positions, end, torch.ones(43, dtype=torch.bool))
    kept = index >= 0
    assert positions[kept].tolist() == list(range(33, 45)) + [0, 1, 2]
    assert len(set(index[kept].tolist())) == 15
    page = (slot * 3 + (positions // 4) % 3) * 4 + positions % 4
    assert torch.equal(index[kept], page[kept])
    skipped = ring.kv_index(slot, positions, end, torch.zeros(43, dtype=torch.bool))
    assert bool((skipped == -1).all())


def test_a_long_generation_keeps_the_draft_cache_bounded(
    make_model: MakeModel, tmp_path: Path
) -> None:
    """Every draft layer sliding over 8 positions: two requests generate 2,000 tokens each.
    The draft's cache is its rings alone (3 pages per slot, no page of the pool), overwritten
    in place over 160 times per request while the target's pages grow to the whole context;
    the outputs are the target's greedy ones and the rounds (every 10th checked) draft the
    reference's tokens."""
    target = make_model(**TARGET_SHAPE, max_position_embeddings=2048)
    draft = make_tiny_draft(tmp_path / "draft", target, num_layers=2, sliding_window=8, seed=6)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (9, 30)]
    built = engine(target, draft, num_pages=1100, max_batch_size=2)
    spec = generate(built, prompts, 2000)
    assert all(len(r.output.token_ids) == 2000 for r in spec)
    check_greedy(target, spec)

    speculator = built.speculator
    assert isinstance(speculator, DFlashSpeculator) and speculator.ring is not None
    ring = speculator.ring
    assert ring.capacity == 12 and ring.num_pages == 3 * 3  # 2 slots + scratch
    assert all(k.shape[0] == v.shape[0] == 9 for k, v in speculator.kv_caches)
    assert 2000 / ring.capacity > 160
    assert check_drafts(built, target, draft, spec, every=10) >= 300


def test_the_kv_budget_counts_a_sliding_layer_once_per_slot(target: Path) -> None:
    """On a CPU's fixed budget (a batch too large for it): a draft's full layers share the
    pages, so each page costs more; its sliding layers cost nothing per page, only their rings,
    taken out of the budget first. The draft here has the target's shape: four layers."""
    shape = qwen3_shape(read_config(target))
    config = EngineConfig(target=target, page_size=4, max_batch_size=4096)
    layer = layer_page_bytes(shape, 4, 4)  # one layer's K and V, a page, in float32

    def pages(draft: Qwen3Shape | None, paged: int, rings: int) -> int:
        return kv_pages(
            config, shape, draft, 1, 4, 4, CPU, draft_paged_layers=paged, ring_pages=rings
        )

    rings = 4097 * 3  # a ring of 3 pages for every slot and the scratch one
    assert pages(None, 0, 0) == CPU_KV_BUDGET_BYTES // (4 * layer)
    assert pages(shape, 4, 0) == CPU_KV_BUDGET_BYTES // (8 * layer)
    assert pages(shape, 0, rings) == (CPU_KV_BUDGET_BYTES - 4 * rings * layer) // (4 * layer)
    assert pages(shape, 2, rings) == (CPU_KV_BUDGET_BYTES - 2 * rings * layer) // (6 * layer)
