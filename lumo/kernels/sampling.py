"""GPU token sampling (sampling.cu): penalties, then greedy / temperature / min-p / top-k / top-p
Gumbel-max, no host sync.

The noise is the CPU sampler's (lumo/engine/sampling.py): a counter hash of (seed, position, vocab index),
so a token at a given absolute position gets the same noise in plain decoding and in a tree, and the GPU
draws the same token as the CPU on bitwise-equal logits. `gumbel_noise_ref` is the exact fp32 noise.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..engine.sampling import SamplingParams, TokenHistory, gumbel_of_uniform, uniform_noise
from .compile import Kernel, compile_kernel

NCAND = 256  # candidates per row for top-k / top-p (sampling.cu); top_k > NCAND acts as NCAND
SPAN = 8192  # vocab entries per partial CTA (sampling.cu)
PATH_MAX = 64  # path tokens per row (penalty.cuh)
THREADS = 512
_M32 = 0xFFFFFFFF


@functools.cache
def _kernel(name: str, logits_bf16: bool = False) -> Kernel:
    return compile_kernel("sampling.cu", name, {"LOGITS_BF16": 1} if logits_bf16 else None)


def sample_workspace(t: int, v: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Per-CTA partials for t rows of a v-entry vocabulary: (val f32, idx i32, sum f32, keys i64)."""
    nb = -(-v // SPAN)
    return (
        torch.empty(t, nb, dtype=torch.float32, device=device),
        torch.empty(t, nb, dtype=torch.int32, device=device),
        torch.empty(t, nb, dtype=torch.float32, device=device),
        torch.empty(t, nb, NCAND, dtype=torch.int64, device=device),
    )


@dataclass
class Penalties:
    """What the logit bias and the penalties read on the device (lumo.engine.sampling.adjust; sampling.cu,
    penalty.cuh)."""

    params: torch.Tensor  # [T, 4] f32 per row: repetition, frequency, presence (1, 0, 0: off), bias on (1)
    counts: torch.Tensor  # [V] int32: how often each token was generated so far
    prompt: torch.Tensor  # [V] uint8: 1 for the prompt's tokens
    path: torch.Tensor | None = None  # [T, E] int32: node ids of each row's path below the root, -1 padded
    node_tokens: torch.Tensor | None = None  # [R] int32: the token of each node (with path)
    bias: torch.Tensor | None = None  # [V] f32: the logit bias of the rows whose flag is set (None: none)
    stop_mask: torch.Tensor | None = None  # [V] uint8: 1 for the stop tokens min_tokens bans (None: none)
    ban_until: torch.Tensor | None = None  # [T] int64: row t bans them at positions below ban_until[t]

    @staticmethod
    def row(params: SamplingParams) -> list[float]:
        """A row of `params` for these settings."""
        bias = 1.0 if params.logit_bias else 0.0
        return [params.repetition_penalty, params.frequency_penalty, params.presence_penalty, bias]

    def settings(self, row: int) -> SamplingParams:
        """Row `row`'s ban, bias and penalties as SamplingParams fields (the references' view), sampling
        unset."""
        rep, freq, pres, on = self.params[row].tolist()
        bias = ()
        if on and self.bias is not None:
            vec = self.bias.cpu()
            bias = tuple((i, float(vec[i])) for i in torch.nonzero(vec).flatten().tolist())
        stops, until = (), 0
        if self.stop_mask is not None and self.ban_until is not None:
            stops = tuple(torch.nonzero(self.stop_mask.cpu()).flatten().tolist())
            until = int(self.ban_until[row])
        return SamplingParams(
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
            logit_bias=bias,
            stop_ids=stops,
            ban_until=until,
        )

    def history(self, row: int | None = None, extra: Iterable[int] = ()) -> TokenHistory:
        """The CPU sampler's view (the references'): counts and prompt, plus row `row`'s path tokens (when
        given) and `extra` as generated."""
        path = [] if row is None or self.path is None else [j for j in self.path[row].tolist() if j >= 0]
        tokens = [int(self.node_tokens[j]) for j in path] + list(extra)
        return TokenHistory.of(self.counts.cpu(), self.prompt.cpu().bool()).with_tokens(tokens)


_NULL = ctypes.c_void_p(None)


def _opt(x: torch.Tensor | None):
    return _NULL if x is None else x


def _check(x: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str, dev) -> None:
    if x.dtype != dtype or tuple(x.shape) != shape or not x.is_contiguous() or x.device != dev:
        raise ValueError(f"sample_tokens: {name} must be a contiguous {list(shape)} {dtype} tensor on {dev}")


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, ...] | None = None,
    min_p: torch.Tensor | None = None,
    penalties: Penalties | None = None,
    count_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens [T] int32 from logits [T, V] f32 or bf16 (read as their f32 values: the same tokens as
    `logits.float()`, without that cast) with per-row params on the device.

    temperature [T] f32 (<= 0: greedy), top_k [T] int32 (0: off), top_p [T] f32 (1: off), seed [T] int64,
    position [T] int64 (absolute position of the token being sampled), min_p [T] f32 (log(min_p), -inf:
    off; SamplingParams.min_p_threshold; None: off), penalties (min_tokens' stop-token ban, the logit bias
    and the penalties; None: off), count_out [V] int32: a histogram each row's token is added to (the
    runner's: the token its step emits).
    """
    if logits.dim() != 2:
        raise ValueError(f"sample_tokens: logits must be [T, V], got {list(logits.shape)}")
    T, V = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16) or not logits.is_contiguous():
        raise ValueError("sample_tokens: logits must be contiguous f32 or bf16 [T, V]")
    dev = logits.device
    for name, x, dt in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int32),
        ("top_p", top_p, torch.float32),
        ("seed", seed, torch.int64),
        ("position", position, torch.int64),
        ("min_p", min_p, torch.float32),
    ):
        if x is not None:
            _check(x, dt, (T,), name, dev)
    pen_args: list = [_NULL] * 8 + [0]
    if penalties is not None:
        pe = penalties
        _check(pe.params, torch.float32, (T, 4), "penalties.params", dev)
        if pe.bias is not None:
            _check(pe.bias, torch.float32, (V,), "penalties.bias", dev)
        if (pe.stop_mask is None) != (pe.ban_until is None):
            raise ValueError("sample_tokens: penalties.stop_mask and penalties.ban_until go together")
        if pe.stop_mask is not None:
            _check(pe.stop_mask, torch.uint8, (V,), "penalties.stop_mask", dev)
            _check(pe.ban_until, torch.int64, (T,), "penalties.ban_until", dev)
        _check(pe.counts, torch.int32, (V,), "penalties.counts", dev)
        _check(pe.prompt, torch.uint8, (V,), "penalties.prompt", dev)
        E = 0
        if pe.path is not None:
            E = pe.path.shape[1] if pe.path.dim() == 2 else -1
            _check(pe.path, torch.int32, (T, E), "penalties.path", dev)
            if not 0 <= E <= PATH_MAX or pe.node_tokens is None:
                raise ValueError(f"sample_tokens: a path of at most {PATH_MAX} nodes with node_tokens")
            _check(pe.node_tokens, torch.int32, (pe.node_tokens.shape[0],), "penalties.node_tokens", dev)
        ban = [_opt(pe.stop_mask), _opt(pe.ban_until)]
        pen_args = [
            pe.params,
            _opt(pe.bias),
            *ban,
            pe.counts,
            pe.prompt,
            _opt(pe.path),
            _opt(pe.node_tokens),
            E,
        ]
    if count_out is not None:
        _check(count_out, torch.int32, (V,), "count_out", dev)
    nb = -(-V // SPAN)
    if workspace is None:
        workspace = sample_workspace(T, V, logits.device)
    val, idx, ssum, keys = workspace
    if val.shape[0] < T or val.shape[1] != nb or keys.shape[1:] != (nb, NCAND):
        raise ValueError(f"sample_tokens: workspace too small for T={T}, V={V}")
    if out is None:
        out = torch.empty(T, dtype=torch.int32, device=logits.device)
    elif out.shape != (T,) or out.dtype != torch.int32:
        raise ValueError(f"sample_tokens: out must be [{T}] int32")
    params = (temperature, top_k, top_p, seed, position, _opt(min_p))
    _kernel("sample_partial", logits.dtype == torch.bfloat16).launch(
        (nb, T), THREADS, (logits, *params, *pen_args, val, idx, ssum, keys, V, nb), pdl=True
    )
    _kernel("sample_final").launch(
        T, THREADS, (*params, val, idx, ssum, keys, out, _opt(count_out), V, nb), pdl=True
    )
    return out


def sample_noise(seed: int, position: int, n: int, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (u, gumbel) [n] f32 for one (seed, position); raw: u's integer part = index (tests)."""
    s = torch.tensor([seed], dtype=torch.int64, device="cuda")
    p = torch.tensor([position], dtype=torch.int64, device="cuda")
    u = torch.empty(n, dtype=torch.float32, device="cuda")
    g = torch.empty_like(u)
    _kernel("sample_noise").launch(-(-n // 256), 256, (s, p, n, int(raw), u, g), pdl=True)
    return u, g


def gumbel_noise_ref(seed: int, position: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n] f32 Gumbel noise of the kernel, bit for bit: the engine's own formula."""
    return gumbel_of_uniform(uniform_noise(seed, position, n, device))


# The kernel's noise is specified by the engine's sampler; re-exported for the tests.
uniform_noise_ref = uniform_noise


def sample_tokens_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    min_p: torch.Tensor | None = None,
    penalties: Penalties | None = None,
    count_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU sampler (lumo.engine.sampling.sample) row by row: the specification of sample_tokens."""
    from ..engine.sampling import sample

    rows = []
    for t in range(logits.shape[0]):
        thr = -math.inf if min_p is None else float(min_p[t])
        params = SamplingParams() if penalties is None else penalties.settings(t)
        params = dataclasses.replace(
            params,
            temperature=float(temperature[t]),
            top_k=int(top_k[t]),
            top_p=float(top_p[t]),
            seed=int(seed[t]),
            min_p=math.exp(thr) if thr > -math.inf else 0.0,
        )
        assert params.min_p_threshold == thr, "min_p thresholds come from SamplingParams.min_p_threshold"
        history = None if penalties is None else penalties.history(t)
        rows.append(sample(logits[t].float().cpu(), params, int(position[t]), history))  # bf16: as f32
    tokens = torch.tensor(rows, dtype=torch.int32)
    if count_out is not None:
        for tok in rows:
            count_out[tok] += 1
    return tokens
