"""Plain decoding on the GPU kernels: `GPUDecoder` has decode.PlainDecoder's interface over a GPURunner.

`GPUBackend` is what an LLM keeps: the packed weights (packed once) and one runner whose caches and
captured graph are reused by every request; it grows (a new runner, a new capture, an empty prefix
cache) only when a request needs more positions than it has, unless `reserve()` sized it for the whole
context first (what `LLM.warm_up`, and so `lumo serve`, does). With `prefix_snapshots` > 0 the runner
keeps prompt prefixes across requests (lumo.engine.prefix: a hit computes the bits a miss does).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..config import DEFAULT_PREFIX_LINES, ConfigError, ModelConfig
from ..weights import ModelWeights
from .decode import slot_capacity
from .gpu_weights import GPUWeights, pack_weights
from .grammar import Constraint
from .logprobs import PromptLogprobs, ScoresTokens
from .runner import PREFILL_CHUNK, GPURunner, cache_bytes
from .sampling import SamplingParams

# What runner.cache_bytes does not count: the CUDA graphs' pools, cuBLAS workspaces, a speculative engine's
# tree buffers other than its attention partials (~0.15 GB on the 27B), the allocator's rounding
GPU_MEMORY_MARGIN = 1 << 30


def free_gpu_bytes(device: torch.device | str) -> int:
    """Memory a runner could still take on `device`: the driver's free memory plus what torch's allocator
    holds unused. On an integrated GPU (a GB10: one memory with the CPU) at least the OS's MemAvailable,
    which counts the page cache (the checkpoint just read) that the driver's figure leaves out."""
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if torch.cuda.get_device_properties(device).is_integrated:
        free = max(free, _mem_available())
    return free


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fit_context(
    need: Callable[[int], int], free: int, max_len: int, explicit: bool, margin: int = GPU_MEMORY_MARGIN
) -> int:
    """The context to serve, given `need(n)`, the bytes a context of n tokens takes beside the weights, and
    the `free` bytes: max_len when it fits (with `margin` to spare); else, for the model's own context
    (explicit False), the longest that fits, a multiple of 256 (a line on stderr says so); a context the
    user asked for (explicit) is a ConfigError naming the longest that fits, as is a GPU where not even
    256 tokens fit."""
    budget = free - margin
    if need(max_len) <= budget:
        return max_len
    lo, hi = 0, max_len // 256  # the longest fitting multiple of 256: need grows with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid * 256) <= budget else (lo, mid - 1)
    fit = lo * 256

    def gb(n: int) -> str:
        return f"{n / 1e9:.2f} GB"

    have = f"{gb(max(free, 0))} of GPU memory is free after the weights ({gb(margin)} of it kept in reserve)"
    if fit == 0:
        raise ConfigError(f"{have}; the caches of even a 256-token context need {gb(need(256))}")
    if explicit:
        raise ConfigError(
            f"max_model_len {max_len} needs {gb(need(max_len))} for its caches but {have}: at most {fit} "
            f"tokens fit (--max-model-len {fit})"
        )
    print(
        f"lumo: context limited to {fit} tokens: the caches of the model's {max_len} would need "
        f"{gb(need(max_len))}, {have} (--max-model-len sets it)",
        file=sys.stderr,
    )
    return fit


class GPUDecoder(ScoresTokens):
    """One token per step from a GPURunner; one host sync per step (reading the sampled token).

    Sampling positions are decode.PlainDecoder's: the first token at position len(prompt), each later one
    at the new cache length, so seeded sampling draws the CPU sampler's noise (sample_tokens kernel).
    With `constraint` set (before prefill), each step's logits are masked by it (apply_token_mask).
    """

    extra_positions = 0
    constraint: Constraint | None = None

    def __init__(self, runner: GPURunner, params: SamplingParams, use_graph: bool = True):
        self.runner, self.params, self.use_graph = runner, params, use_graph
        runner.reset()
        runner.set_sampling(params)
        if use_graph and runner.graph is None:
            runner.capture()  # at length 0: the warm-up touches nothing committed
        self.pending: int | None = None
        self._init_scores()
        self.cached_tokens = 0  # prompt tokens the latest prefill took from the prefix cache

    def prefill(self, prompt_ids: list[int]) -> list[int]:
        r = self.runner
        scored = None
        if self.prompt_logprobs is not None:
            scored = PromptLogprobs(prompt_ids, self.prompt_logprobs, head=r.w.lm_head)
        self.cached_tokens = start = r.resume(prompt_ids, reuse=scored is None)
        self._mask_next()
        r.prefill(prompt_ids[start:], hidden_hook=None if scored is None else scored.hidden)
        self.last_prompt_logprobs = [] if scored is None else scored.out
        return self._emit()

    def step(self) -> list[int]:
        self._mask_next()
        self.runner.decode_step(use_graph=self.use_graph)
        return self._emit()

    def _mask_next(self) -> None:
        if self.constraint is not None:
            self.runner.set_token_mask(self.constraint.bitmask())

    def _emit(self) -> list[int]:
        self.pending = self.runner.token()
        self._note_logprobs(self.runner.logits_bf16, [self.pending])
        if self.constraint is not None:
            self.constraint.advance([self.pending])
        return [self.pending]


class GPUBackend:
    """Packed weights + a reusable runner. `decoder(params, max_len)` is the per-request entry point."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: ModelWeights | GPUWeights,
        max_model_len: int,
        device: torch.device | str = "cuda",
        use_graph: bool = True,
        prefill_chunk: int = PREFILL_CHUNK,
        prefix_snapshots: int = 0,
        prefix_park: int = 0,
        prefix_lines: int = DEFAULT_PREFIX_LINES,
    ):
        self.cfg, self.device = cfg, torch.device(device)
        self.max_model_len, self.use_graph, self.prefill_chunk = max_model_len, use_graph, prefill_chunk
        self.prefix_snapshots = prefix_snapshots
        self.prefix_park, self.prefix_lines = prefix_park, prefix_lines
        self.weights = weights if isinstance(weights, GPUWeights) else pack_weights(cfg, weights, self.device)
        self.runner: GPURunner | None = None

    def fit_context(self, explicit: bool, extra: int = 0, mtp_layers: int = 0, attn_rows: int = 0) -> int:
        """Check that the longest request, max_model_len positions plus `extra` (a speculative tree's
        slots) with `mtp_layers` drafter layers' cache and `attn_rows` more rows of attention partials (a
        speculative engine's), fits the GPU's free memory (fit_context); the context the backend then
        serves (max_model_len, lowered where the model's own did not fit)."""

        def need(n: int) -> int:
            cap = slot_capacity(n + extra, n)
            snaps, park, lines = self.prefix_snapshots, self.prefix_park, self.prefix_lines
            return cache_bytes(self.cfg, cap, self.prefill_chunk, snaps, mtp_layers, park, attn_rows, lines)

        self.max_model_len = fit_context(need, free_gpu_bytes(self.device), self.max_model_len, explicit)
        return self.max_model_len

    def capacity_for(self, max_len: int) -> int:
        """Runner size for a request of max_len positions (decode.slot_capacity)."""
        self._check(max_len)
        return slot_capacity(max_len, self.max_model_len)

    def _check(self, max_len: int) -> None:
        if max_len > self.max_model_len:
            raise ValueError(f"{max_len} positions exceed the context length {self.max_model_len}")

    def runner_for(self, max_len: int, extra: int = 0) -> GPURunner:
        """The runner, replaced by a larger one (new caches: the prefix cache starts empty) when it holds
        fewer than max_len + extra positions (extra: a speculative tree's slots)."""
        self._check(max_len)
        need = max_len + extra
        if self.runner is None or self.runner.max_len < need:
            self.runner = None  # free the old caches before allocating the new ones
            torch.cuda.empty_cache()
            cap = slot_capacity(need, self.max_model_len)
            self.runner = GPURunner(self.cfg, self.weights, cap, self.prefill_chunk, self.device)
            self.runner.enable_prefix_cache(self.prefix_snapshots, self.prefix_park, self.prefix_lines)
        return self.runner

    def reserve(self) -> GPURunner:
        """The runner sized for the whole context (max_model_len positions), allocated now: no request then
        grows it, so none pays for a new runner and its captures, and the prefix cache, which a new runner
        starts without, outlives every request. What fit_context checked against the free memory."""
        return self.runner_for(self.max_model_len)

    def decoder(self, params: SamplingParams, max_len: int) -> GPUDecoder:
        return GPUDecoder(self.runner_for(max_len), params, self.use_graph)
