"""The Python API: `LLM(model).generate(...)` and `LLM(model).generate_stream(...)`."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import operator
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import (
    DEFAULT_PREFIX_LINES,
    DEFAULT_PREFIX_PARK,
    DEFAULT_PREFIX_SNAPSHOTS,
    ConfigError,
    ModelConfig,
    TreeConfig,
    apply_overrides,
    check_draft_quant,
)
from ..tokenizer import IncrementalDetokenizer, Tokenizer, read_chat_template
from ..weights import load_model, resolve_model_path
from .decode import Slot, make_decoder
from .draft_vocab import draft_vocab_ids
from .grammar import Constraint, GrammarCompiler, StructuredOutputs
from .logprobs import TokenLogprob, check_logprobs
from .sampling import SamplingParams
from .tree import build_tree, chain_config

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily: logits / t would overflow float32
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the largest temperature the samplers can divide by


def _integer(v: object, what: str) -> int:
    """An integer argument (Python or numpy / torch integer; not a bool, a float or a string)."""
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {v!r}") from None


def _number(v: object, what: str) -> float:
    """A real number argument (Python's, numpy's; not a bool or a string)."""
    if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Real):
        raise ValueError(f"{what} must be a number, got {v!r}")
    return float(v)


EMBEDDED_NAME = "lumo-tiny"


class PromptTooLongError(ValueError):
    """The prompt (plus the tokens asked for) does not fit the context."""


def embedded_model_path() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / EMBEDDED_NAME


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    # what stopped it (vLLM's stop_reason): the stop string matched, or a stop token id other than the
    # model's end-of-sequence; None for the end-of-sequence token and for "length"
    stop_reason: str | int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not prefilled again)
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for
    # one per prompt token when asked for; None for the first (nothing before it scores it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    eos_logprob: TokenLogprob | None = None  # the end-of-sequence token's, when it ended the output
    # the end-of-sequence or stop_token_ids token that ended the output (not in token_ids); else None
    end_token: int | None = None


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # tokens produced since the previous chunk
    finish_reason: str | None = None  # set on the last chunk
    stop_reason: str | int | None = None  # on the last chunk: GenerationResult.stop_reason
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first chunk, when asked for
    # with logprobs, on a last chunk that an end-of-sequence token ended (not in token_ids, like its text)
    eos_logprob: TokenLogprob | None = None
    end_token: int | None = None  # on a last chunk that such a token ended: the token (GenerationResult's)


def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA GPU is visible")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or auto")
    return torch.device(device)


SMALL_HIDDEN = 1024  # below this hidden size a decode step's matrices are too small to split across threads
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _kernels_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """lumo's kernels need bf16 on a GPU with cp.async and bf16 mma.sync (sm_80+); sm_90+ adds PDL."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def _check_gpu_tree(tree: TreeConfig) -> None:
    """The GPU verifier runs the tree's rows through the batch-invariant GEMV (at most SMALL_M rows)."""
    from .gpu_weights import SMALL_M

    if tree.rows > SMALL_M:
        raise ValueError(
            f"the GPU tree verifier takes at most {SMALL_M} rows; this tree needs {tree.rows} "
            "(lower --spec-budget or --spec-depth)"
        )


class LLM:
    """A loaded model with its tokenizer. One generation at a time (they share the caches): a generation
    started while another is unfinished (a generate_stream not yet exhausted or closed, another thread's
    call) raises a RuntimeError instead of corrupting both."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "auto",
        dtype: str | None = None,
        max_model_len: int | None = None,
        progress: bool = False,
        spec: str = "auto",
        tree: TreeConfig | None = None,
        backend: str = "auto",
        draft_vocab: int | str | os.PathLike | None = None,
        draft_quant: str = "auto",
        prefix_snapshots: int = DEFAULT_PREFIX_SNAPSHOTS,
        adaptive_spec: bool = True,
        chat_template: str | os.PathLike | None = None,
        prefix_park: int = DEFAULT_PREFIX_PARK,
        prefix_lines: int = DEFAULT_PREFIX_LINES,
        hf_overrides: dict[str, Any] | None = None,
    ):
        """chat_template: a jinja chat template (a file's path or the text) used instead of the
        checkpoint's; prefix_park: the positions each prefix parked out of another prompt's way keeps
        aside, prefix_lines: how many are parked at once (lumo.engine.prefix; either 0: none parked);
        hf_overrides: merged into config.json (vLLM's --hf-overrides; lumo.config.apply_overrides), e.g.
        yarn rope parameters for a context past the checkpoint's; the other arguments are `lumo serve`'s
        flags (README)."""
        # checked before minutes of loading weights
        template = None if chat_template is None else read_chat_template(chat_template)
        if spec not in ("auto", "off", "chain", "tree"):
            raise ValueError(f"unknown spec mode {spec!r}: use auto, tree, chain or off")
        if backend not in ("auto", "torch", "kernels"):
            raise ValueError(f"unknown backend {backend!r}: use auto, torch or kernels")
        check_draft_quant(draft_quant)
        if _integer(prefix_snapshots, "prefix_snapshots") < 0:
            raise ValueError(f"prefix_snapshots must be >= 0 (0: no prefix caching), got {prefix_snapshots}")
        # Prompt prefixes reused across requests (lumo.engine.prefix: exact; snapshots of the recurrent
        # state on the prefill grid, this many kept; 0 = every prompt prefilled from its first token).
        self.prefix_snapshots = int(prefix_snapshots)
        if _integer(prefix_park, "prefix_park") < 0:
            raise ValueError(f"prefix_park must be >= 0 (0: no prefix parked), got {prefix_park}")
        if _integer(prefix_lines, "prefix_lines") < 0:
            raise ValueError(f"prefix_lines must be >= 0 (0: no prefix parked), got {prefix_lines}")
        parking = self.prefix_snapshots and prefix_park and prefix_lines
        self.prefix_park, self.prefix_lines = (int(prefix_park), int(prefix_lines)) if parking else (0, 0)
        # Tree speculation on the kernels falls back to plain steps while events do not pay (lumo.engine.
        # adaptive: the same tokens either way); False: always speculate.
        self.adaptive_spec = bool(adaptive_spec)
        self.spec, self.tree = spec, tree or TreeConfig()
        self.last_decoder = None  # the decoder of the latest request (its .stats after speculation)
        self._running = threading.Lock()  # held by the generation that owns the caches (_run)
        self.device = _pick_device(device)
        if dtype is None:
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(_DTYPES)}")
        self.dtype = _DTYPES[dtype]
        if model is None:
            path = embedded_model_path()
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"the embedded model is missing from this install ({path})")
            self.model_name = EMBEDDED_NAME
        else:
            path = resolve_model_path(str(model))
            self.model_name = (
                str(model).rstrip("/").split("/")[-1] if Path(str(model)).exists() else str(model)
            )
        self.path, self.hf_overrides = path, hf_overrides
        # "torch": the reference model in plain torch (CPU or GPU; speculation = the exact reference event).
        # "kernels": lumo's CUDA kernels (GPURunner; GPUSpecEngine for tree / chain), batch invariant, so
        # speculation is bitwise plain decoding. auto = kernels on a CUDA device in bf16, torch otherwise.
        if backend == "auto":
            backend = "kernels" if _kernels_supported(self.device, self.dtype) else "torch"
        self.backend = backend
        if self.backend == "kernels" and (self.device.type != "cuda" or self.dtype != torch.bfloat16):
            raise ValueError("--backend kernels needs --device cuda and bfloat16")
        if max_model_len is not None and _integer(max_model_len, "max_model_len") < 2:
            raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
        limit = _context_limit(path, hf_overrides)
        if max_model_len is not None and limit is not None and max_model_len > limit:  # vLLM refuses it too
            raise ValueError(  # before minutes of loading weights
                f"max_model_len {max_model_len} exceeds the model's context ({limit}: "
                "max_position_embeddings, or yarn's original context x factor)"
            )
        # The kernels pack each layer onto the GPU as it is read (lazy): the checkpoint is never held whole
        # beside its packed copy (on a GB10 both would be in the same 128 GB).
        kernels = self.backend == "kernels"
        self.config, self.weights = load_model(
            path,
            device="cpu" if kernels else self.device,
            dtype=self.dtype,
            progress=progress,
            lazy=kernels,
            overrides=hf_overrides,
        )
        self.tokenizer = Tokenizer.from_dir(path)
        # a tokenizer with ids past the weights' vocabulary: text that encodes to one is refused by name
        # (a torch IndexError, or a read out of bounds on the GPU, before session 47)
        self.tokenizer.model_vocab = self.config.vocab_size
        if template is not None:
            self.tokenizer.set_chat_template(template)
        self.max_model_len = max_model_len or self.config.context_length
        # auto: tree speculation on the kernels backend when the checkpoint has an MTP head; plain decoding
        # otherwise (the torch backend's tree event forwards each node separately: exact, but slower).
        if spec == "auto":
            has_mtp = self.weights is not None and self.weights.mtp is not None
            spec = "tree" if self.backend == "kernels" and has_mtp else "off"
        self.spec = spec
        shape = self.tree if spec == "tree" else chain_config(self.tree.depth)  # the speculated tree
        if spec != "off" and self.backend == "kernels":
            _check_gpu_tree(shape)
        if spec != "off":  # fail at start-up, not on every request
            if self.weights is None or self.weights.mtp is None:
                raise ValueError("speculative decoding needs a model with an MTP head (mtp.* tensors)")
            build_tree(self.tree)
        # A draft vocabulary (lumo.engine.draft_vocab): token ids the drafter may propose; None = all.
        self.draft_ids: list[int] | None = None
        if draft_vocab is not None:
            if spec == "off":
                raise ValueError(
                    "a draft vocabulary needs speculative decoding (--spec tree or chain; auto speculates "
                    "only on the kernels backend with an MTP head)"
                )
            ids = draft_vocab_ids(draft_vocab, self.config.vocab_size, self.tokenizer.added_token_ids())
            k = int(build_tree(shape).rank.max()) + 1  # the drafter's candidates per depth
            if len(ids) < k:
                raise ValueError(
                    f"a draft vocabulary of {len(ids)} tokens is smaller than the tree's top-{k}"
                )
            self.draft_ids = ids if len(ids) < self.config.vocab_size else None
        # The drafter's precision (gpu_weights.draft_quant): NVFP4 copies of the MTP head and lm_head, or
        # the checkpoint's; auto = NVFP4 for a 4-bit target on the kernels backend. Output is unchanged.
        if draft_quant == "nvfp4" and (spec == "off" or self.backend != "kernels"):
            raise ValueError(
                "--draft-quant nvfp4 needs speculative decoding (a model with an MTP head) on the kernels "
                "backend"
            )
        self.draft_quant = draft_quant
        self._defaults = _generation_defaults(path)
        try:  # a generation_config.json lumo cannot sample with fails here, not in every request
            self.sampling_params(seed=0)
        except ValueError as e:
            raise ConfigError(f"{path / 'generation_config.json'}: {e}") from None
        self._gpu = self._kernel_backend(max_model_len is not None) if self.backend == "kernels" else None
        # A small model's decode steps on the CPU run on one thread (_decode_threads), unless the user
        # chose the threads (OMP_NUM_THREADS)
        self._one_thread_steps = (
            self._gpu is None
            and self.device.type == "cpu"
            and self.config.hidden_size < SMALL_HIDDEN
            and "OMP_NUM_THREADS" not in os.environ
        )
        # the torch backend's caches
        prefix = (self.prefix_snapshots, self.prefix_park, self.prefix_lines)
        self._slot = Slot(*prefix) if self._gpu is None else None
        self._grammars: GrammarCompiler | None = None  # built by the first structured request
        self._grammars_lock = threading.Lock()

    def _kernel_backend(self, explicit_context: bool):
        """The packed weights and the runner's backend; max_model_len checked against the GPU's free memory
        (lowered with a notice when the model's own context does not fit, a ConfigError when the user's)."""
        from .gpu_decode import GPUBackend
        from .gpu_weights import draft_quant, pack_weights

        mtp = self.spec != "off"
        nvfp4 = mtp and draft_quant(self.weights, self.draft_quant)
        packed = pack_weights(
            self.config, self.weights, self.device, mtp=mtp, draft_ids=self.draft_ids, draft_nvfp4=nvfp4
        )
        self.weights = None  # the packed copy on the GPU is the only one kept
        backend = GPUBackend(
            self.config,
            packed,
            self.max_model_len,
            self.device,
            prefix_snapshots=self.prefix_snapshots,
            prefix_park=self.prefix_park,
            prefix_lines=self.prefix_lines,
        )
        if self.spec == "off":
            self.max_model_len = backend.fit_context(explicit_context)
            return backend
        from .gpu_spec import SpecBackend

        # Events replay CUDA graphs: bitwise the eager events (tests/test_gpu_spec_gpu.py, H200).
        spec = SpecBackend(
            backend, self.tree, chain=self.spec == "chain", use_graph=True, adaptive=self.adaptive_spec
        )
        mtp_layers = self.config.mtp_num_hidden_layers  # the drafter's own K/V cache
        self.max_model_len = backend.fit_context(
            explicit_context, spec.extra_positions, mtp_layers, spec.attn_rows
        )
        return spec

    # ---- public API ----
    def generate(self, prompt: str | list[int], max_tokens: int = 256, **kw) -> GenerationResult:
        """Keyword arguments: temperature, top_k, top_p, seed, min_p, repetition_penalty, frequency_penalty,
        presence_penalty, logit_bias (see sampling_params), stop (strings), stop_token_ids (tokens that end
        the request like an end-of-sequence token: not part of the result), ignore_eos (end-of-sequence
        tokens are generated like any other), include_stop_str_in_output (the text ends after the stop
        string, not before it), skip_special_tokens (default True: special tokens add no text),
        min_tokens (end-of-sequence and stop_token_ids tokens are not sampled before that many tokens,
        stop strings not looked for; vLLM's five options), structured_outputs (a StructuredOutputs or a
        mapping of its fields: json, regex, choice, grammar, json_object; the output follows it, after the
        reasoning when the prompt leaves the model thinking; lumo.engine.grammar), logprobs (None:
        off; k in 0..20: each token's logprob and its k most likely alternatives, lumo.engine.logprobs) and
        prompt_logprobs (the same for the prompt's tokens; its prefill then reuses no cached prefix)."""
        ids, text, reason, why, prompt_lps, eos_lp, end = [], [], None, None, None, None, None
        prompt_ids = self._encode(prompt)
        logprobs = [] if kw.get("logprobs") is not None else None
        t0 = time.perf_counter()
        t_first = None
        for chunk in self._stream(prompt_ids, max_tokens, **kw):
            t_first = t_first or time.perf_counter()
            ids += chunk.token_ids
            text.append(chunk.text)
            reason = chunk.finish_reason or reason
            why = chunk.stop_reason
            if logprobs is not None:
                logprobs += chunk.logprobs
            prompt_lps = prompt_lps or chunk.prompt_logprobs
            eos_lp = eos_lp or chunk.eos_logprob
            end = chunk.end_token if chunk.end_token is not None else end
        t1 = time.perf_counter()
        t_first = t_first or t1
        cached = getattr(self.last_decoder, "cached_tokens", 0)
        return GenerationResult(
            ids,
            "".join(text),
            reason or "length",
            why if reason == "stop" else None,
            prompt_ids,
            t_first - t0,
            t1 - t_first,
            cached,
            logprobs,
            prompt_lps,
            eos_lp,
            end,
        )

    def generate_stream(self, prompt: str | list[int], max_tokens: int = 256, **kw) -> Iterator[StreamChunk]:
        """generate()'s chunks as they come (the same keyword arguments). The stream owns the LLM until it
        is exhausted or closed (`close()`, or dropped): another generation meanwhile is a RuntimeError."""
        return self._stream(self._encode(prompt), max_tokens, **kw)

    def decoder(self, params: SamplingParams, max_len: int, spec: str | None = None, adaptive: bool = True):
        """A decoder (prefill(ids) -> tokens, step() -> tokens, no end-of-sequence handling) for a request of
        up to max_len positions; spec "off" decodes plainly with the same weights whatever the LLM's mode
        (lumo bench and lumo check compare the two), None: the LLM's own mode. adaptive=False: every step a
        speculative event (no adaptive plain steps; lumo check's exactness test)."""
        spec = self.spec if spec is None else spec
        if spec not in ("off", self.spec):
            raise ValueError(f"this LLM decodes with spec={self.spec!r}; it has no {spec!r} decoder")
        if self._gpu is not None:
            if spec == "off":
                return self._gpu_plain.decoder(params, max_len)
            return self._gpu.decoder(params, max_len, adaptive=adaptive)
        args = (self.config, self.weights, params, max_len, self.device, self.dtype, spec, self.tree)
        return make_decoder(*args, draft_ids=self.draft_ids, slot=self._slot)

    def warm_up(self) -> float:
        """Compile the kernels a request runs (NVRTC, or the disk cache's cubins), allocate the runner for
        the whole context and capture its CUDA graphs before the first request, which would pay for them
        otherwise (`lumo serve` calls this): the runner (and the speculative engine) reserved at
        max_model_len positions, the memory the start-up check found free, so that no later request grows
        it, which would recapture the graphs and start the prefix cache empty (a long conversation's next
        turn prefilled again from its first token); then greedy generations of a few tokens after
        prompts of the lengths whose prefill chunks run kernels of their own (2 x CHUNKED_MIN_TOKENS, then
        8, 16, 24 and 32), the first with logprobs, after which adaptive speculation forgets what it
        measured. Returns the seconds it
        took; on the torch backend nothing is done (0.0)."""
        if self._gpu is None:
            return 0.0
        from ..kernels.gdn import CHUNKED_MIN_TOKENS
        from ..kernels.linear import SMALL_M

        t0 = time.perf_counter()
        self._gpu.reserve()
        # A prompt long enough for the chunked GDN prefill (what prompts of CHUNKED_MIN_TOKENS and more run)
        # and 4 new tokens, fewer where the context is shorter (it holds at least 2)
        n = max(1, min(2 * CHUNKED_MIN_TOKENS, self.max_model_len - 5))
        line = self.tokenizer.encode("def main():\n    return 0\n") or [0]
        text = line * (max(n, SMALL_M) // len(line) + 1)
        new = min(4, self.max_model_len - n)
        self.generate(text[:n], max_tokens=new, temperature=0, logprobs=1, ignore_eos=True)
        # and prompts of up to SMALL_M tokens: the sequential GDN prefill and the projections' GEMV kernels
        # for each 8 rows (what a short prompt, or a prompt's last few tokens past the prefill grid, runs; 8
        # NVRTC compiles in 3.4 s on an H100 with an empty kernel cache for a 4-token chunk,
        # bench/results/probe_first_prompt_session43.log)
        for short in range(8, SMALL_M + 1, 8):
            if short < self.max_model_len:
                new = min(4, self.max_model_len - short)
                self.generate(text[:short], max_tokens=new, temperature=0, ignore_eos=True)
        self.reset_adaptive()
        return time.perf_counter() - t0

    def reset_adaptive(self) -> None:
        """Adaptive speculation forgets what earlier requests measured (its backoff carries over from one
        request to the next otherwise; lumo bench starts every timed request afresh)."""
        policy = getattr(self._gpu, "policy", None)
        if policy is not None:
            policy.reset()

    @property
    def _gpu_plain(self):
        """The kernels backend's plain GPUBackend (a SpecBackend wraps one)."""
        return getattr(self._gpu, "backend", self._gpu)

    @property
    def gpu_weights(self):
        """The packed GPUWeights on the kernels backend (lumo bench's floor), else None."""
        return None if self._gpu is None else self._gpu_plain.weights

    # ---- internals ----
    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            if isinstance(prompt, torch.Tensor):
                prompt = prompt.tolist()
            if not isinstance(prompt, list | tuple) or any(isinstance(t, str) for t in prompt):
                raise ValueError("the prompt must be one string or one list of token ids")
            ids = [_integer(t, "a prompt token id") for t in prompt]
            if any(t < 0 or t >= self.config.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def sampling_params(
        self,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
    ) -> SamplingParams:
        """Checked sampling settings (None: the checkpoint's generation_config, else temperature 1, no
        top-k / top-p / min-p, no penalties). Temperatures below GREEDY_BELOW are greedy; the seed is taken
        modulo 2^64. min_p in [0, 1]; repetition_penalty in (0, 10] (1: off; over the prompt and the output),
        frequency / presence penalties in [-2, 2] (0: off; over the output), as vLLM's. logit_bias: token id
        -> a value in [-100, 100] added to its logit before the penalties (OpenAI's; ids below the
        vocabulary size)."""
        d = self._defaults

        def number(value, key: str, default: float) -> float:
            x = _number(d.get(key, default) if value is None else value, key)
            if not math.isfinite(x):
                raise ValueError(f"need a finite {key}, got {x}")
            return x

        t = number(temperature, "temperature", 1.0)
        k = _integer(d.get("top_k", 0) if top_k is None else top_k, "top_k")
        p = number(top_p, "top_p", 1.0)
        if not (t >= 0 and 0.0 < p <= 1.0 and k >= 0):
            raise ValueError("need a finite temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if t > FLOAT32_MAX:  # the samplers divide f32 logits by it: an infinite one makes -inf / inf NaN
            raise ValueError(f"temperature must be at most {FLOAT32_MAX:.7g} (a float32), got {t}")
        mp = number(min_p, "min_p", 0.0)
        rep = number(repetition_penalty, "repetition_penalty", 1.0)
        freq = number(frequency_penalty, "frequency_penalty", 0.0)
        pres = number(presence_penalty, "presence_penalty", 0.0)
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must lie in [0, 1], got {mp}")
        if not 0.0 < rep <= 10.0:
            raise ValueError(f"repetition_penalty must lie in (0, 10], got {rep}")
        for name, x in (("frequency_penalty", freq), ("presence_penalty", pres)):
            if not -2.0 <= x <= 2.0:
                raise ValueError(f"{name} must lie in [-2, 2], got {x}")
        if t < GREEDY_BELOW:
            t = 0.0
        seed = int.from_bytes(os.urandom(8), "little") >> 1 if seed is None else _integer(seed, "seed")
        if not -(2**63) <= seed < 2**63:  # the GPU keeps it in an int64; vLLM's range too
            raise ValueError(f"seed must lie in [-2^63, 2^63), got {seed}")
        bias = self._logit_bias(logit_bias)
        return SamplingParams(
            temperature=t,
            top_k=k,
            top_p=p,
            seed=seed,
            min_p=mp,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
            logit_bias=bias,
        )

    def _logit_bias(self, logit_bias: Mapping[int, float] | None) -> tuple[tuple[int, float], ...]:
        if logit_bias is None:
            return ()
        if not isinstance(logit_bias, Mapping):
            raise ValueError(f"logit_bias must map token ids to numbers, got {type(logit_bias).__name__}")
        V = self.config.vocab_size
        out = {}
        for key, value in logit_bias.items():
            i = _integer(key, "a logit_bias token id")
            if not 0 <= i < V:
                raise ValueError(f"logit_bias token id {i} is outside the vocabulary [0, {V})")
            x = _number(value, f"logit_bias[{i}]")
            if not -100.0 <= x <= 100.0:  # OpenAI's range (the server clamps to it, as vLLM's does)
                raise ValueError(f"logit_bias[{i}] must lie in [-100, 100], got {x}")
            if x != 0.0:
                out[i] = x
        return tuple(sorted(out.items()))

    def _stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: list[str] | str | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        structured_outputs: StructuredOutputs | Mapping | None = None,
        **shaping,  # min_p, the penalties and logit_bias (sampling_params)
    ) -> Iterator[StreamChunk]:
        if _integer(max_tokens, "max_tokens") < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0 <= _integer(min_tokens, "min_tokens") <= max_tokens:
            raise ValueError(f"min_tokens must lie in [0, max_tokens = {max_tokens}], got {min_tokens}")
        structured = StructuredOutputs.of(structured_outputs)
        if structured is not None and min_tokens:
            # the grammar may allow only the end token before min_tokens, which the ban refuses
            raise ValueError("min_tokens cannot be combined with structured_outputs")
        flags = (ignore_eos, include_stop_str_in_output, skip_special_tokens)
        ending = self._ending(stop, stop_token_ids, *flags, min_tokens)
        n = len(prompt_ids)
        if n + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the prompt "
                f"has {n} tokens (the prompt and at least 1 new token must fit)"
            )
        max_tokens = min(max_tokens, self.max_model_len - n)
        params = self.sampling_params(temperature, top_k, top_p, seed, **shaping)
        if min_tokens and ending.stop_token_ids:  # the stop tokens banned for the first min_tokens
            stops = tuple(sorted(ending.stop_token_ids))
            params = replace(params, stop_ids=stops, ban_until=n + min_tokens)
        logprobs, prompt_logprobs = check_logprobs(logprobs), check_logprobs(prompt_logprobs)
        constraint = None if structured is None else self.constraint(structured, prompt_ids)
        return self._run(prompt_ids, max_tokens, params, ending, logprobs, prompt_logprobs, constraint)

    def constraint(self, structured: StructuredOutputs, prompt_ids: list[int]) -> Constraint:
        """A request's grammar state (ValueError for a grammar lumo cannot use). The grammar starts after
        `</think>` when the prompt leaves the model thinking, or lets it open `<think>` first
        (grammar.reasoning_start)."""
        tok = self.tokenizer
        with self._grammars_lock:  # the server checks a grammar on a thread of its own
            if self._grammars is None:
                V, think = self.config.vocab_size, (tok.token_to_id("<think>"), tok.token_to_id("</think>"))
                self._grammars = GrammarCompiler(tok.to_json(), V, tok.eos_token_ids, think=think)
        return self._grammars.constraint(structured, prompt_ids)

    def _ending(self, stop, stop_token_ids, ignore_eos, include_stop, skip_special, min_tokens) -> Ending:
        if not (
            stop is None
            or isinstance(stop, str)
            or (isinstance(stop, list | tuple) and all(isinstance(x, str) for x in stop))
        ):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        for name, flag in (
            ("ignore_eos", ignore_eos),
            ("include_stop_str_in_output", include_stop),
            ("skip_special_tokens", skip_special),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        if isinstance(stop_token_ids, str | bytes) or not isinstance(stop_token_ids, Iterable | None):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
        ids = frozenset(_integer(t, "a stop_token_ids entry") for t in stop_token_ids or ())
        V = self.config.vocab_size
        if bad := sorted(t for t in ids if not 0 <= t < V):
            raise ValueError(f"stop_token_ids {bad} lie outside the vocabulary [0, {V})")
        eos = frozenset() if ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
        return Ending(strings, eos | ids, include_stop, skip_special, min_tokens, eos)

    @torch.inference_mode()
    def _run(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        params: SamplingParams,
        ending: Ending,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        constraint: Constraint | None = None,
    ) -> Iterator[StreamChunk]:
        if not self._running.acquire(blocking=False):
            raise RuntimeError(
                "another generation on this LLM is unfinished (a generate_stream not exhausted or closed, "
                "or another thread's): an LLM runs one generation at a time"
            )
        try:
            yield from self._generate(
                prompt_ids, max_tokens, params, ending, logprobs, prompt_logprobs, constraint
            )
        finally:
            self._running.release()

    @contextlib.contextmanager
    def _decode_threads(self) -> Iterator[None]:
        """One torch thread while a small model decodes on the CPU (the prefill keeps them all): a step's
        matrices are too small to split, and torch's OpenMP threads spin-wait for each other, which on a
        busy 2-core machine made the embedded model 10-16x slower (7.5-10 against 95-138 tokens/s; idle,
        two threads gain ~15%: README). Set once per generation (switching costs ~1 ms) and restored when
        it ends. torch's count is per thread, with a process-wide default that threads take when they first
        use torch: code run between a stream's chunks sees the one thread too, a thread that first uses
        torch meanwhile keeps one, and a stream closed from another thread cannot restore the count of the
        thread that decoded (it stays at one; OMP_NUM_THREADS turns all this off)."""
        n, me = torch.get_num_threads(), threading.get_ident()
        if not self._one_thread_steps or n == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            if threading.get_ident() == me:
                torch.set_num_threads(n)

    def _generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        params: SamplingParams,
        ending: Ending,
        logprobs: int | None,
        prompt_logprobs: int | None,
        constraint: Constraint | None,
    ) -> Iterator[StreamChunk]:
        self.last_decoder = None  # until this request's decoder exists (no stale stats)
        decoder = self.decoder(params, len(prompt_ids) + max_tokens)
        self.last_decoder = decoder
        decoder.logprobs, decoder.prompt_logprobs = logprobs, prompt_logprobs
        decoder.constraint = constraint
        detok = IncrementalDetokenizer(
            self.tokenizer,
            stop=list(ending.stop),
            skip_special_tokens=ending.skip_special_tokens,
            prompt_ids=prompt_ids[-8:],
            include_stop=ending.include_stop_str_in_output,
            min_tokens=ending.min_tokens,
        )
        eos = ending.stop_token_ids
        n = 0
        tokens = decoder.prefill(prompt_ids)
        first = None if prompt_logprobs is None else [None, *decoder.last_prompt_logprobs]
        with self._decode_threads():
            while True:
                out, text = [], []
                # The decoder's logprobs of `tokens`, cut where they are: a chunk's logprobs match its
                # token_ids.
                lps = decoder.last_logprobs if logprobs is not None else None
                reason = eos_lp = why = end = None
                for i, tok in enumerate(tokens):
                    if tok in eos:
                        text.append(detok.finish())
                        reason, eos_lp, end = "stop", None if lps is None else lps[i], tok
                        why = None if tok in ending.eos_ids else tok  # vLLM's: None for the model's EOS
                        break
                    out.append(tok)
                    n += 1
                    text.append(detok.add(tok))
                    if detok.stopped:
                        reason, why = "stop", detok.stop_string
                        break
                    if n == max_tokens:
                        text.append(detok.finish())
                        reason = "length"
                        break
                chunk_lps = None if lps is None else lps[: len(out)]
                yield StreamChunk("".join(text), out, reason, why, chunk_lps, first, eos_lp, end)
                if reason is not None:
                    return
                first = None
                tokens = decoder.step()


@dataclass(frozen=True)
class Ending:
    """Where a request ends and what its text shows (LLM.generate's keyword arguments, checked)."""

    stop: tuple[str, ...]  # stop strings: the text ends before the first (or after it, include_stop)
    stop_token_ids: frozenset[int]  # end-of-sequence tokens (unless ignore_eos) and stop_token_ids
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings are looked for from this many tokens on (vLLM's min_tokens)
    eos_ids: frozenset[int] = frozenset()  # the model's end-of-sequence ids among them (none: ignore_eos)


def _context_limit(path: Path, overrides: dict[str, Any] | None = None) -> int | None:
    """The checkpoint's context (ModelConfig.context_length) read from config.json alone, with the
    overrides (None where it cannot be read: load_model then says what is wrong)."""
    try:
        raw = json.loads((path / "config.json").read_text())
        return ModelConfig.from_hf(apply_overrides(raw, overrides)).context_length
    except (OSError, ValueError):  # ConfigError and JSONDecodeError are ValueErrors
        return None


def _generation_defaults(path: Path) -> dict:
    f = path / "generation_config.json"
    if not f.exists():
        return {}
    d = json.loads(f.read_text())
    keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
    out = {k: d[k] for k in keys if k in d and d[k] is not None}
    if d.get("do_sample") is False:
        out["temperature"] = 0.0
    return out
