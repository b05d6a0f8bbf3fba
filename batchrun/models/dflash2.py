"""The DFlash2 drafter (docs/dflash.md, section DFlash2): DFlash's drafter (models/dflash.py),
whose context K/V, attention and caches it keeps, with two additions.

- Around each sublayer (attention, MLP) a two-tap dynamic depthwise convolution along the block
  (BlockConv): each block row mixes with its predecessor in the block, channel by channel, with
  a kernel that is a static part plus a part projected from the row's normed sublayer input,
  one value per group of channels; the first row of a block has no predecessor (zero across
  the block boundary). Context rows pass through no convolution.
- A candidate selector: the head's top-K tokens per block row and their (softcapped, scaled)
  logits, and a low-rank projection of the row, which spec_decode/dflash2/'s walk turns into
  the block's tokens (scored transitions instead of an argmax per row).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.attention.base import AttentionBackend
from batchrun.kernels.dispatch import cuda_kernel
from batchrun.layers.rotary import RotaryEmbedding
from batchrun.layers.top_k import top_k
from batchrun.models.block_attention import BlockAttention
from batchrun.models.dflash import DFlashDraft, DraftLayer
from batchrun.models.qwen3 import Qwen3ForCausalLM, Qwen3Shape

CONV_TAPS = 2  # conv_kernel_size: the taps implemented (the published drafters' only value)


class BlockConv(nn.Module):
    """A depthwise convolution along each block of B rows (z-lab's GroupedDynamicCausalConv):
    out[t, c] = sum over taps o of (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c],
    x[t - o] zero where t - o < 0 in the block. `prepare` convolves the sublayer's input with
    kernel 0 and keeps kernel 1's dynamic part for `finish`, which convolves its output; both
    dynamic parts are projected from the sublayer's (normed) input. On CUDA, when triton imports,
    one Triton kernel convolves (kernels/triton_block_conv.py); block_conv_torch is the
    reference and the CPU path."""

    def __init__(self, hidden_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.groups, self.group_size, self.block_size = (
            hidden_size // group_size,
            group_size,
            block_size,
        )
        # [side (0: input, 1: output), tap, channel]
        self.base_kernel = nn.Parameter(torch.empty(2, CONV_TAPS, hidden_size))
        # [rows, side * tap * group] in that order, group innermost
        self.kernel_projection = nn.Linear(hidden_size, 2 * CONV_TAPS * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R * B, H] -> (x convolved with kernel 0, kernel 1's dynamic part [R * B, taps,
        groups])."""
        dynamic = self.kernel_projection(x).view(x.shape[0], 2, CONV_TAPS, self.groups)
        return self._convolve(x, dynamic[:, 0], self.base_kernel[0]), dynamic[:, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, dynamic, self.base_kernel[1])

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        kernel = _kernel(x)
        convolve = block_conv_torch if kernel is None else kernel
        return convolve(x, dynamic, base, self.block_size, self.group_size)


BlockConvKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def _kernel(x: torch.Tensor) -> BlockConvKernel | None:
    kernel: BlockConvKernel | None = cuda_kernel(
        x, "batchrun.kernels.triton_block_conv", "block_conv_triton"
    )
    return kernel


def block_conv_torch(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> torch.Tensor:
    """BlockConv's convolution, the reference (kernels/triton_block_conv.py fuses it on CUDA):
    x [rows, H], dynamic [rows, taps, H / group_size], base [taps, H] -> [rows, H]."""
    rows, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    blocks = x.view(rows // block_size, block_size, groups, group_size)
    dynamic = dynamic.view(blocks.shape[0], block_size, taps, groups, 1)
    base = base.view(taps, groups, group_size)
    out = (base[0] + dynamic[:, :, 0]) * blocks
    for tap in range(1, taps):  # row t reads row t - tap of its own block
        shifted = F.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))
        out = out + (base[tap] + dynamic[:, :, tap]) * shifted
    return out.view(rows, hidden)


class DFlash2Layer(DraftLayer):
    def __init__(self, shape: Qwen3Shape, group_size: int, block_size: int) -> None:
        super().__init__(shape)
        self.attention_conv = BlockConv(shape.hidden_size, group_size, block_size)
        self.mlp_conv = BlockConv(shape.hidden_size, group_size, block_size)

    def forward(
        self,
        x: torch.Tensor,  # block rows
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        attn = self.self_attn
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        q, k, v = attn.qkv(h, positions, rope)
        backend.write_kv(k, v, kv_cache[0], kv_cache[1])
        x = x + self.attention_conv.finish(attn.attend(q, backend, kv_cache), kernel)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), kernel)


class CandidateSelector(nn.Module):
    """edge(p -> c) at a block row = <predecessor_codebook[p] * hidden_projection(row),
    successor_codebook[c]> + the row's logit of c (spec_decode/dflash2/walk.py scores it)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))


class BlockCandidates:
    """What the walk reads of one drafted block per request."""

    def __init__(
        self, unary: torch.Tensor, candidates: torch.Tensor, hidden_proj: torch.Tensor
    ) -> None:
        self.unary = unary  # [R, B-1, K] float32: the top-K logits of each row, descending
        self.candidates = candidates  # [R, B-1, K] int64: their target ids
        self.hidden_proj = hidden_proj  # [R, B-1, rank] float32


class DFlash2Draft(DFlashDraft):
    def __init__(
        self,
        shape: Qwen3Shape,
        target_layer_ids: list[int],
        block_size: int,
        mask_token_id: int,
        max_positions: int,
        attention: BlockAttention | None = None,
        *,
        conv_group_size: int,
        selector_rank: int,
        selector_top_k: int,
        softcapping: float | None = None,
        output_multiplier: float = 1.0,
    ) -> None:
        """softcapping: the head's logits become c * tanh(logits / c) (None: as they are),
        after the multiplication by output_multiplier."""
        super().__init__(
            shape, target_layer_ids, block_size, mask_token_id, max_positions, attention
        )
        self.layers = nn.ModuleList(
            DFlash2Layer(shape, conv_group_size, block_size) for _ in range(shape.num_layers)
        )
        self.candidate_selector = CandidateSelector(
            shape.hidden_size, shape.vocab_size, selector_rank
        )
        self.selector_top_k = selector_top_k
        self.softcapping, self.output_multiplier = softcapping, output_multiplier

    def block_candidates(
        self,
        target: Qwen3ForCausalLM,
        block_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        window_backend: AttentionBackend | None,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> BlockCandidates:
        """The walk's inputs for one block per request (draft_block's arguments)."""
        rows = self.block_rows(target, block_ids, positions, backend, window_backend, kv_caches)
        # The multiplier (> 0, as the loader checks) and the softcapping rise with the logit:
        # the top-K of the raw logits are the top-K of the scaled ones, so only K values a row
        # are scaled, not the vocabulary (full-vocabulary float passes cost ~8% of a round at
        # batch 32 on an H100: bench/results/jobs-h100-b1-w2-dflash2.json).
        # top_k: a Triton kernel on CUDA (torch.topk's ~0.57 ms a round at batch 32, H100).
        raw, candidates = top_k(target.full_logits(target.lm_head(rows)), self.selector_top_k)
        unary = raw.float() * self.output_multiplier
        if self.softcapping is not None:
            unary = torch.tanh(unary / self.softcapping) * self.softcapping
        hidden_proj = self.candidate_selector.hidden_projection(rows).float()
        return BlockCandidates(unary, candidates, hidden_proj)
