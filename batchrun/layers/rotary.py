"""Rotary position embedding tables, neox (rotate-half) layout, in float32: plain RoPE, YaRN
(frequencies blended between the original and the interpolated ones, and cos/sin scaled by its
attention factor) or Llama 3's (long wavelengths divided by factor, smoothed between), as
transformers computes them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Yarn:
    """rope_type yarn: a context of factor x original_max_position_embeddings."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: from factor (and mscale, mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def context(self) -> int:
        return int(self.factor * self.original_max_position_embeddings)

    def scale(self) -> float:
        """The attention factor cos and sin are multiplied by."""
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(weight: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * weight * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.mscale) / mscale(self.mscale_all_dim)
        return mscale(1.0)

    def inv_freq(self, head_dim: int, theta: float, cpu: torch.device) -> torch.Tensor:
        """Each dimension pair's frequency: extrapolated (the original) where a pair turns more
        than beta_fast times over the original context, interpolated (divided by factor) where
        it turns less than beta_slow times, linearly blended between."""

        def dimension(rotations: float) -> float:  # the pair that turns `rotations` times
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(theta))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high += 0.001 if low == high else 0.0  # no division by zero
        pairs = torch.arange(head_dim // 2, dtype=torch.float32, device=cpu)
        extrapolated = 1 - ((pairs - low) / (high - low)).clamp(0, 1)
        wavelengths = _wavelengths(head_dim, theta, cpu)
        interpolated = 1.0 / (self.factor * wavelengths)
        return interpolated * (1 - extrapolated) + 1.0 / wavelengths * extrapolated


@dataclass(frozen=True)
class Llama3:
    """rope_type llama3 (Llama 3.1 and later): the context stays max_position_embeddings."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def scale(self) -> float:
        return 1.0  # cos and sin are not scaled

    def inv_freq(self, head_dim: int, theta: float, cpu: torch.device) -> torch.Tensor:
        """transformers' _compute_llama3_parameters, op for op in float32: pairs of wavelength
        below original / high_freq_factor keep their frequency, above original /
        low_freq_factor divide it by factor, and those between blend the two by how many turns
        they make over the original context."""
        inv_freq = 1.0 / _wavelengths(head_dim, theta, cpu)
        original = self.original_max_position_embeddings
        low_wavelength = original / self.low_freq_factor
        high_wavelength = original / self.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        scaled = torch.where(wavelength > low_wavelength, inv_freq / self.factor, inv_freq)
        smooth = (original / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
        return torch.where(medium, smoothed, scaled)


RopeScaling = Yarn | Llama3


def _wavelengths(head_dim: int, theta: float, cpu: torch.device) -> torch.Tensor:
    dims = torch.arange(0, head_dim, 2, dtype=torch.float32, device=cpu)
    return theta ** (dims / head_dim)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        # Computed on the host whatever the default device: on the meta device (the start-up
        # checks build models there) these ops would first import torch._dynamo, a second.
        cpu = torch.device("cpu")
        if scaling is None:
            inv_freq = 1.0 / _wavelengths(head_dim, theta, cpu)
        else:
            inv_freq = scaling.inv_freq(head_dim, theta, cpu)
        scale = 1.0 if scaling is None else scaling.scale()
        positions = torch.arange(max_positions, dtype=torch.float32, device=cpu)
        freqs = torch.outer(positions, inv_freq)
        self.cos: torch.Tensor  # [max_positions, head_dim / 2]
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)
