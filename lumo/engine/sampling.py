"""Sampling with noise keyed by (request seed, absolute position).

The Gumbel noise for a token depends only on the request's seed, the token's absolute position and the
vocabulary index, never on how many tokens were sampled before or in which launch. Plain decoding and a
speculative tree node at the same logical position therefore draw the same noise, so seeded sampling
emits the same tokens with and without speculation (DESIGN.md, Exactness). The GPU sampler implements
the same hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on int64 tensors holding uint32 values; int64 products wrap mod 2^64,
    # which keeps the low 32 bits exact.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_noise(seed: int, position: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n] f32 in (0, 1): a counter-based draw for (seed, position, index)."""
    key = _fmix32(torch.tensor((seed & _M32) ^ 0x9E3779B9, dtype=torch.int64))
    key = _fmix32(key ^ _fmix32(torch.tensor((position * 0x632BE5AB) & _M32, dtype=torch.int64)))
    idx = torch.arange(n, dtype=torch.int64, device=device)
    h = _fmix32(_fmix32(idx ^ key.to(device)) ^ ((seed >> 32) & _M32))
    # 23 bits: ((h >> 9) + 0.5) * 2^-23 is exact in fp32 and < 1 (with 24 bits the top value rounds to 1.0).
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_of_uniform(u: torch.Tensor) -> torch.Tensor:
    """g = rn32(-log(rn32(-log(u)))) with each log in double, so every step is correctly rounded and the
    CPU and the GPU kernel agree bit for bit (an fp32 log is off by an ulp on ~0.1% of inputs somewhere,
    enough to flip a near-tie of logits + noise)."""
    e = (-torch.log(u.double())).float()
    return (-torch.log(e.double())).float()


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] f32 logits / temperature with tokens outside top-k / top-p set to -inf."""
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
        drop = before >= params.top_p
        drop[0] = False
        x = x.clone()
        x[order[drop]] = float("-inf")
    return x


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token from [V] logits for absolute position `position` (Gumbel-max; greedy = argmax)."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = filter_logits(logits, params)
    u = uniform_noise(params.seed, position, x.numel(), x.device)
    return int(torch.argmax(x + gumbel_of_uniform(u)))
