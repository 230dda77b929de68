"""Plain decoding on the GPU kernels: `GPUDecoder` has decode.PlainDecoder's interface over a GPURunner.

`GPUBackend` is what an LLM keeps: the packed weights (packed once) and one runner whose caches and
captured graph are reused by every request; it grows (a new runner, a new capture) only when a request
needs more positions than it has.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..weights import ModelWeights
from .gpu_weights import GPUWeights, pack_weights
from .runner import PREFILL_CHUNK, GPURunner
from .sampling import SamplingParams

MIN_CAPACITY = 4096  # smallest runner: short requests all share one capture


class GPUDecoder:
    """One token per step from a GPURunner; one host sync per step (reading the sampled token).

    Sampling positions are decode.PlainDecoder's: the first token at position len(prompt), each later one
    at the new cache length, so seeded sampling draws the CPU sampler's noise (sample_tokens kernel).
    """

    extra_positions = 0

    def __init__(self, runner: GPURunner, params: SamplingParams, use_graph: bool = True):
        self.runner, self.params, self.use_graph = runner, params, use_graph
        runner.reset()
        runner.set_sampling(params)
        if use_graph and runner.graph is None:
            runner.capture()  # at length 0: the warm-up touches nothing committed
        self.pending: int | None = None

    def prefill(self, prompt_ids: list[int]) -> list[int]:
        self.runner.prefill(prompt_ids)
        self.pending = self.runner.token()
        return [self.pending]

    def step(self) -> list[int]:
        self.runner.decode_step(use_graph=self.use_graph)
        self.pending = self.runner.token()
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
    ):
        self.cfg, self.device = cfg, torch.device(device)
        self.max_model_len, self.use_graph, self.prefill_chunk = max_model_len, use_graph, prefill_chunk
        self.weights = weights if isinstance(weights, GPUWeights) else pack_weights(cfg, weights, self.device)
        self.runner: GPURunner | None = None

    def capacity_for(self, max_len: int) -> int:
        """Runner size for a request of max_len positions: a power of two >= MIN_CAPACITY, at most the model
        length (few distinct sizes, so few re-allocations and captures)."""
        if max_len > self.max_model_len:
            raise ValueError(f"{max_len} positions exceed the context length {self.max_model_len}")
        cap = MIN_CAPACITY
        while cap < max_len:
            cap *= 2
        return max(min(cap, self.max_model_len), max_len)

    def decoder(self, params: SamplingParams, max_len: int) -> GPUDecoder:
        if self.runner is None or self.runner.max_len < max_len:
            self.runner = None  # free the old caches before allocating the new ones
            torch.cuda.empty_cache()
            self.runner = GPURunner(
                self.cfg, self.weights, self.capacity_for(max_len), self.prefill_chunk, self.device
            )
        return GPUDecoder(self.runner, params, self.use_graph)
