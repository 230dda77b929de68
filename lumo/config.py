"""Frozen configuration dataclasses: the model (from config.json), the engine and the draft tree."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
LINEAR = "linear_attention"
_TEXT_TYPES = ("qwen3_5_text", "qwen3_8_text")
_WRAPPER_TYPES = ("qwen3_5", "qwen3_8")
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)


class ConfigError(ValueError):
    """A config.json that lumo cannot serve; the message is one line meant for the user."""


DRAFT_QUANTS = ("auto", "nvfp4", "none")  # the drafter's precision (lumo.engine.gpu_weights.draft_quant)
DEFAULT_PREFIX_SNAPSHOTS = 4  # prefix-cache state snapshots kept (lumo.engine.prefix): ~0.6 GB on a 27B
# Positions a parked prefix keeps aside at most (lumo.engine.prefix): 2.1 GB of K/V on the 27B, one line's
# more while a swap copies. A coding agent's sub-agent conversation of up to this many tokens less the
# decoding window (4096) leaves the main conversation parked.
DEFAULT_PREFIX_PARK = 32768
# Prefixes parked at once (a conversation and a coding agent's sub-agent, while a side request runs)
DEFAULT_PREFIX_LINES = 2


def check_draft_quant(choice: str) -> str:
    """`choice` if it is one of DRAFT_QUANTS, else a ValueError naming them."""
    if choice not in DRAFT_QUANTS:
        raise ValueError(f"unknown draft quantisation {choice!r}: use {', '.join(DRAFT_QUANTS)}")
    return choice


_MISSING = object()


def _int(d: dict[str, Any], key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    """An integer field of config.json, checked (a bool or a float is not an integer here)."""
    v = d.get(key, default) if default is not _MISSING else d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"config.json: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def _float(v: Any, key: str, positive: bool = False) -> float:
    """A finite number (Python's JSON reads NaN and Infinity too); positive: > 0 as well."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ConfigError(f"config.json: {key} must be a finite number, got {v!r}")
    if positive and v <= 0:
        raise ConfigError(f"config.json: {key} must be > 0, got {v!r}")
    return float(v)


def _bool(v: Any, key: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"config.json: {key} must be true or false, got {v!r}")
    return v


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling of config.json's rope_parameters / rope_scaling (lumo.rope computes its table)."""

    rope_type: str  # "linear" or "yarn"
    factor: float  # how many times the original context the positions are stretched over
    # yarn only: the context the model was trained at, the ramp's turn counts, cos / sin's factor
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_scaling(rope: dict[str, Any], d: dict[str, Any], max_pos: int) -> RopeScaling | None:
    """rope_parameters' scaling as transformers reads it (rope_type, or the older `type`); None unscaled.
    Types lumo does not compute (dynamic NTK, llama3, longrope, ...) are a ConfigError, never ignored."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "yarn"):
        raise ConfigError(f"config.json: rope_type {kind!r} is not supported (default, linear, yarn)")
    factor = rope.get("factor")
    if kind == "yarn":
        # the context it was trained at, a top-level original_max_position_embeddings first (transformers');
        # without a factor the original context is stretched over max_position_embeddings
        key = "original_max_position_embeddings"
        orig = _int({key: d.get(key, rope.get(key, max_pos))}, key)
        factor = max_pos / orig if factor is None else factor
    factor = _float(factor, "rope_parameters.factor")
    if factor <= 0:
        raise ConfigError(f"config.json: rope_parameters.factor must be > 0, got {factor}")
    if kind == "linear":
        return RopeScaling("linear", factor)
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and all_dim:
            attention = _yarn_mscale(factor, _float(mscale, "mscale")) / _yarn_mscale(
                factor, _float(all_dim, "mscale_all_dim")
            )
        else:
            attention = _yarn_mscale(factor)
    return RopeScaling(
        "yarn",
        factor,
        orig,
        _float(rope.get("beta_fast") or 32, "rope_parameters.beta_fast"),
        _float(rope.get("beta_slow") or 1, "rope_parameters.beta_slow"),
        _float(attention, "rope_parameters.attention_factor"),
        _bool(rope.get("truncate", True), "rope_parameters.truncate"),
    )


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """config.json's object with `overrides` (vLLM's --hf-overrides) merged in: objects key by key (so
    {"rope_parameters": {"rope_type": "yarn", ...}} keeps the checkpoint's rope_theta), anything else
    replaced. A wrapper checkpoint's text fields live under text_config: a top-level key that only
    text_config has is a ConfigError saying so (it would change nothing)."""
    if not overrides:
        return raw
    if not isinstance(overrides, dict):
        raise ConfigError(f"--hf-overrides must be a JSON object, got {overrides!r}")
    text = raw.get("text_config")
    for key in overrides:
        if isinstance(text, dict) and key not in raw and key in text:
            raise ConfigError(
                f"--hf-overrides: {key} is a field of this checkpoint's text_config: give it as "
                f'{{"text_config": {{"{key}": ...}}}}'
            )

    def merged(base: Any, over: Any) -> Any:
        if isinstance(base, dict) and isinstance(over, dict):
            return {**base, **{k: merged(base.get(k), v) for k, v in over.items()}}
        return over

    return merged(raw, overrides)


@dataclass(frozen=True)
class ModelConfig:
    """The Qwen3.5/3.8 hybrid text model: only the fields lumo reads (names follow config.json)."""

    vocab_size: int
    hidden_size: int  # H
    intermediate_size: int  # dense SwiGLU width
    layer_types: tuple[str, ...]  # "linear_attention" (GDN) or "full_attention" per layer
    rms_norm_eps: float
    # gated attention
    num_attention_heads: int  # nh
    num_key_value_heads: int  # nkv
    head_dim: int  # d
    rope_theta: float
    partial_rotary_factor: float  # RoPE covers the first d * factor dims of each head
    # Gated DeltaNet
    linear_num_key_heads: int  # nk
    linear_num_value_heads: int  # nv (a multiple of nk; value head h reads key head h // (nv // nk))
    linear_key_head_dim: int  # dk
    linear_value_head_dim: int  # dv
    linear_conv_kernel_dim: int  # K
    mtp_num_hidden_layers: int = 0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    attn_output_gate: bool = True
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen3_5_text"
    rope_scaling: RopeScaling | None = None  # linear / yarn RoPE (lumo.rope); None: the plain table

    # ---- derived sizes (the shape vocabulary used everywhere) ----
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:  # C: channels of the causal conv = [q | k | v]
        nk, dk = self.linear_num_key_heads, self.linear_key_head_dim
        return 2 * nk * dk + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gqa_ratio(self) -> int:  # query heads per kv head
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def gdn_ratio(self) -> int:  # value heads per key head (r)
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def context_length(self) -> int:
        """The longest context the model takes: max_position_embeddings, or under yarn the original
        context times the factor where that is longer (vLLM's rule: Qwen's long-context recipe sets the
        rope parameters alone, e.g. through --hf-overrides)."""
        yarn = self.rope_scaling if self.rope_scaling and self.rope_scaling.rope_type == "yarn" else None
        stretched = int(yarn.original_max_position_embeddings * yarn.factor) if yarn else 0
        return max(self.max_position_embeddings, stretched)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict: the `qwen3_5` wrapper (text_config) or a flat `qwen3_5_text`.
        Every field lumo reads is type- and range-checked: a bad one is a ConfigError naming it."""
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        top = d
        if "text_config" in d and isinstance(d["text_config"], dict):
            d = {**d["text_config"]}
            # The wrapper model ties on its own (top-level) flag; transformers writes the text_config's
            # copy as false even for tied models.
            d["tie_word_embeddings"] = top.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
        model_type = d.get("model_type") or top.get("model_type")
        if model_type not in _TEXT_TYPES + _WRAPPER_TYPES or "linear_num_value_heads" not in d:
            arch = top.get("architectures") or ["?"]
            raise ConfigError(
                f"unsupported architecture: model_type={model_type!r} architectures={arch}; "
                "lumo serves the Qwen3.5/Qwen3.8 hybrid (Gated DeltaNet + gated attention) family"
            )
        experts = d.get("num_experts") or d.get("num_local_experts")
        if isinstance(experts, int) and not isinstance(experts, bool) and experts > 0:
            raise ConfigError(
                f"config.json has num_experts {experts}: lumo serves the dense Qwen3.5/Qwen3.8 models, not "
                "their mixture-of-experts siblings"
            )
        if missing := [k for k in _REQUIRED if k not in d]:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        n = _int(d, "num_hidden_layers")
        if d.get("layer_types") is not None:
            if not isinstance(d["layer_types"], list):
                raise ConfigError(f"config.json: layer_types must be a list, got {d['layer_types']!r}")
            layer_types = tuple(d["layer_types"])
            if len(layer_types) != n:
                raise ConfigError(f"layer_types has {len(layer_types)} entries for {n} layers")
        else:
            interval = _int(d, "full_attention_interval", 4)
            layer_types = tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))
        if bad := set(map(str, layer_types)) - {FULL, LINEAR}:
            raise ConfigError(f"unsupported layer types {sorted(bad)}")
        rope: dict[str, Any] = {}
        for key in ("rope_parameters", "rope_scaling"):  # the older rope_scaling wins, as in transformers,
            if (part := d.get(key)) is not None:  # over the theta and rotary factor it lacks
                if not isinstance(part, dict):
                    raise ConfigError(f"config.json: {key} must be an object, got {part!r}")
                rope.update(part)
        rope_theta = _float(rope.get("rope_theta", d.get("rope_theta", 10000.0)), "rope_theta", positive=True)
        # transformers' Qwen3.5 / Qwen3-Next configs default to a quarter of each head rotated
        prf = _float(
            rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)), "partial_rotary_factor"
        )
        if not 0 < prf <= 1:
            raise ConfigError(f"config.json: partial_rotary_factor must lie in (0, 1], got {prf}")
        eos = d.get("eos_token_id", top.get("eos_token_id"))
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if any(isinstance(e, bool) or not isinstance(e, int) for e in eos_list):
            raise ConfigError(f"config.json: eos_token_id must be an integer or a list of them, got {eos!r}")
        nh = _int(d, "num_attention_heads")
        hidden = _int(d, "hidden_size")
        max_pos = _int(d, "max_position_embeddings", 32768, minimum=2)
        if _bool(d.get("attention_bias", False), "attention_bias"):
            raise ConfigError("attention_bias=true is not supported (no Qwen3.5/3.8 model has biases there)")
        cfg = cls(
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size"),
            layer_types=layer_types,
            rms_norm_eps=_float(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", positive=True),
            num_attention_heads=nh,
            num_key_value_heads=_int(d, "num_key_value_heads", nh),
            # transformers' default for this family (Qwen3_5TextConfig, Qwen3NextConfig), not hidden / heads
            head_dim=_int(d, "head_dim") if d.get("head_dim") is not None else 256,
            rope_theta=rope_theta,
            partial_rotary_factor=prf,
            linear_num_key_heads=_int(d, "linear_num_key_heads"),
            linear_num_value_heads=_int(d, "linear_num_value_heads"),
            linear_key_head_dim=_int(d, "linear_key_head_dim"),
            linear_value_head_dim=_int(d, "linear_value_head_dim"),
            linear_conv_kernel_dim=_int(d, "linear_conv_kernel_dim", 4, minimum=2),
            mtp_num_hidden_layers=_int(d, "mtp_num_hidden_layers", 0, minimum=0)
            if d.get("mtp_num_hidden_layers")
            else 0,
            tie_word_embeddings=_bool(d.get("tie_word_embeddings", False), "tie_word_embeddings"),
            max_position_embeddings=max_pos,
            attn_output_gate=_bool(d.get("attn_output_gate", True), "attn_output_gate"),
            eos_token_ids=tuple(eos_list),
            model_type=str(model_type),
            rope_scaling=_rope_scaling(rope, d, max_pos),
        )
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if not cfg.attn_output_gate:
            raise ConfigError("attn_output_gate=false is not supported (every Qwen3.5/3.8 model gates)")
        return cfg


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the speculative draft tree (see DESIGN.md, 'The speculative event in detail')."""

    depth: int = 11  # D: spine length (MTP top-1 chain)
    topk: int = 3  # siblings per spine depth, the spine token included
    budget: int = 27  # draft nodes besides the root
    rows: int = 32  # rows per verify, padded
