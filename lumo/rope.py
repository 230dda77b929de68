"""RoPE frequency tables: the plain one and the scalings a config.json may ask for (`rope_type` linear or
yarn in rope_parameters / rope_scaling, lumo.config.RopeScaling), computed as transformers computes them
(modeling_rope_utils), so a checkpoint extended to a longer context runs the positions it was tuned for.

- linear: every frequency divided by `factor` (positions interpolated).
- yarn (Peng et al. 2023, "YaRN", NTK-by-parts): frequencies that turn fewer than `beta_slow` times over
  the original context are interpolated (divided by `factor`), those that turn more than `beta_fast` times
  are kept, a linear ramp between; cos and sin are then scaled by the attention factor (0.1 ln(factor) + 1
  unless the config gives it), which multiplies the rotated dims of q and k.
"""

from __future__ import annotations

import math

import torch

from .config import RopeScaling


def rope_table(
    rotary_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, float]:
    """inv_freq [rotary_dim / 2] (dtype) and the factor cos / sin are multiplied by (1.0 unscaled)."""
    ar = torch.arange(0, rotary_dim, 2, device=device, dtype=dtype)
    if scaling is None:
        return 1.0 / (theta ** (ar / rotary_dim)), 1.0
    if scaling.rope_type == "linear":
        return 1.0 / (theta ** (ar / rotary_dim)) / scaling.factor, 1.0
    pos_freqs = theta ** (ar / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    low, high = yarn_range(rotary_dim, theta, scaling)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, device=device, dtype=dtype) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, scaling.attention_factor


def yarn_range(rotary_dim: int, theta: float, scaling: RopeScaling) -> tuple[float, float]:
    """The frequency indices where yarn's ramp starts and ends: where a frequency turns beta_fast and
    beta_slow times over the original context (floored / ceiled unless `truncate` is false)."""

    def index(turns: float) -> float:
        context = scaling.original_max_position_embeddings
        return rotary_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index(scaling.beta_fast), index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)
