"""Sampling with noise keyed by (request seed, absolute position).

The Gumbel noise for a token depends only on the request's seed, the token's absolute position and the
vocabulary index, never on how many tokens were sampled before or in which launch. Plain decoding and a
speculative tree node at the same logical position therefore draw the same noise, so seeded sampling
emits the same tokens with and without speculation (DESIGN.md, Exactness). The GPU sampler implements
the same hash.

Order of the operations on a row (vLLM's): the raw logits, a structured output's mask (lumo.engine.grammar:
the tokens its grammar refuses at -inf), the stop tokens banned below min_tokens, +
logit_bias, the penalties (repetition over the prompt and the output, then frequency and presence over the
output), greedy argmax or: / temperature, min-p, top-k, top-p, Gumbel-max. The penalties read the tokens
generated so far (`TokenHistory`); a tree node's history is the committed one plus the drafted tokens on
its path, which is what plain decoding has seen when it samples at that position, so penalised decoding
stays exact under speculation too. The bias is the same at every position, and the ban depends on the
position alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    min_p: float = 0.0  # keep tokens with probability >= min_p x the best one's (after temperature); 0 = off
    # Penalties (OpenAI's / vLLM's semantics): repetition divides a positive logit (multiplies a negative
    # one) of every token in the prompt or the output; frequency subtracts penalty x count and presence
    # the penalty once, for tokens of the output. 1 / 0 / 0 = off.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, value) pairs, ids ascending and distinct, each value added to that
    # token's raw logit before the penalties (bias_vector; LLM.sampling_params checks the ids and values).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: the stop tokens (end-of-sequence and stop_token_ids) are banned while sampling
    # positions below ban_until (the prompt's length + min_tokens: the request's first min_tokens tokens)
    stop_ids: tuple[int, ...] = ()
    ban_until: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def bans(self, position: int) -> bool:
        """The stop tokens are banned at this absolute position."""
        return bool(self.stop_ids) and position < self.ban_until

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def min_p_threshold(self) -> float:
        """log(min_p) as f32 (-inf: off): a token is kept iff f32(x - max x) >= it, x the tempered logits.
        Computed once on the host, so the CPU and the GPU sampler compare the same numbers."""
        return float(torch.tensor(math.log(self.min_p) if self.min_p > 0 else -math.inf, dtype=torch.float32))


class TokenHistory:
    """What the penalties read: counts [V] int32 of each token generated so far, prompt [V] bool."""

    def __init__(self, vocab_size: int, prompt_ids: Iterable[int] = ()):
        self.counts = torch.zeros(vocab_size, dtype=torch.int32)
        self.prompt = torch.zeros(vocab_size, dtype=torch.bool)
        ids = list(prompt_ids)
        if ids:
            self.prompt[torch.tensor(ids)] = True

    @classmethod
    def of(cls, counts: torch.Tensor, prompt: torch.Tensor) -> TokenHistory:
        """A history holding these tensors (counts [V] int32, prompt [V] bool), not copies."""
        h = cls.__new__(cls)
        h.counts, h.prompt = counts, prompt
        return h

    def add(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.counts[t] += 1

    def with_tokens(self, tokens: Iterable[int]) -> TokenHistory:
        """This history plus `tokens` generated (a tree node's: the drafted tokens on its path)."""
        h = TokenHistory.of(self.counts.clone(), self.prompt)
        h.add(tokens)
        return h

    def select(self, ids: torch.Tensor) -> TokenHistory:
        """The history of the tokens `ids` only, in that order (a draft vocabulary's columns)."""
        return TokenHistory.of(self.counts[ids], self.prompt[ids])


def bias_vector(logit_bias: tuple[tuple[int, float], ...], vocab_size: int, device=None) -> torch.Tensor:
    """[V] f32: each biased token's value, 0 elsewhere (what the GPU sampler reads)."""
    bias = torch.zeros(vocab_size, dtype=torch.float32)
    if logit_bias:
        ids, values = zip(*logit_bias, strict=True)
        bias[torch.tensor(ids)] = torch.tensor(values, dtype=torch.float32)
    return bias.to(device)


def adjust(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None = None) -> torch.Tensor:
    """[V] f32 logits as the sampler sees them before the temperature: + logit_bias (every entry: x + 0
    for the others, as the GPU sampler adds its [V] vector), then the penalties (they need `history`)."""
    x = logits.float()
    if params.logit_bias:
        x = x + bias_vector(params.logit_bias, x.numel(), x.device)
    if params.penalized:
        if history is None:
            raise ValueError("penalties need the token history")
        x = penalize(x, params, history)
    return x


def penalize(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """[V] f32 logits with the repetition, frequency and presence penalties applied (sampling.cu's
    operations, one IEEE rounding each, so the GPU sampler gets the same bits). The divisor is a tensor:
    torch on CUDA divides by a Python number as a multiplication by its reciprocal."""
    x = logits.float()
    counts = history.counts.to(x.device)
    seen = history.prompt.to(x.device) | (counts > 0)
    rep = torch.tensor(params.repetition_penalty, dtype=torch.float32, device=x.device)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - params.frequency_penalty * counts.float()
    return x - params.presence_penalty * (counts > 0).float()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """[V] logits with the tokens outside `allowed` ([V] bool; None: every token) at -inf."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


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
    """[V] f32 logits / temperature with tokens outside min-p / top-k / top-p set to -inf."""
    x = logits.float() / params.temperature
    if params.min_p > 0:
        x = x.masked_fill(x - x.max() < params.min_p_threshold, float("-inf"))
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


def sample(
    logits: torch.Tensor, params: SamplingParams, position: int, history: TokenHistory | None = None
) -> int:
    """One token from [V] logits for absolute position `position` (Gumbel-max; greedy = argmax), after the
    stop-token ban (min_tokens), the logit bias and the penalties when `params` has any (penalties need
    `history`). A structured output's mask comes before (mask_logits: the decoders' logprobs see it too)."""
    if params.bans(position):
        stops = torch.tensor(params.stop_ids, device=logits.device)
        logits = logits.float().index_fill(0, stops, float("-inf"))
    if params.logit_bias or params.penalized:
        logits = adjust(logits, params, history)
    if params.greedy:
        return int(torch.argmax(logits))
    x = filter_logits(logits, params)
    u = uniform_noise(params.seed, position, x.numel(), x.device)
    return int(torch.argmax(x + gumbel_of_uniform(u)))
