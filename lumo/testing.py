"""Tiny checkpoints for tests: a byte-level BPE tokenizer with a ChatML template, and a random hybrid model.

`make_tiny_checkpoint(dir)` writes a complete flat `qwen3_5_text` checkpoint (config.json, model.safetensors,
tokenizer files) that transformers' Qwen3_5ForCausalLM loads, in well under a second.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

# ChatML markers are special (skipped by decode(skip_special_tokens=True)); the thinking and tool-call tags
# are ordinary added tokens, as in Qwen's tokenizer, so they survive detokenization for the parsers.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

DEFAULT_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Hello, world! How are you today? I am fine, thank you, and you?",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
    "Ünïcödé: café, naïve, façade, Straße, Øresund, ½ ¾ € £ ¥",
    "日本語のテキスト。中文文本测试。한국어 텍스트.",
    "Emoji: 😀 🎉 🚀 👍🏽 👨‍👩‍👧 ❤️",
    "In the beginning the model thinks, then it answers the question that the user asked.",
)

# Qwen-style ChatML written for lumo's tests (string literals keep the whitespace explicit).
CHAT_TEMPLATE = r"""{%- macro render_text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools or has_system -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}{{- render_text(messages[0].content) -}}{%- endif -%}
    {%- if tools -%}
        {%- if has_system -%}{{- '\n\n' -}}{%- endif -%}
        {{- '# Tools\n\nYou can use these functions; ' -}}
        {{- 'each signature is one JSON line in <tools></tools>:\n<tools>' -}}
        {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
        {{- '\n</tools>\n\nTo use one, reply with its name and a JSON object of arguments inside tags:\n' -}}
        {{- '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- raise_exception('a system message may only come first') -}}{%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' ~ render_text(message.content) ~ '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.reasoning_content -%}
            {{- '<think>\n' ~ message.reasoning_content | trim ~ '\n</think>\n\n' -}}
        {%- endif -%}
        {{- render_text(message.content) -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if not loop.first or message.content -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' ~ render_text(message.content) ~ '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('unknown message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tokenizer_files(dst: Path, corpus: list[str] | None = None, vocab_size: int = 300) -> None:
    """Train a byte-level BPE on `corpus` and write tokenizer.json, tokenizer_config.json and
    generation_config.json into `dst`. `vocab_size` counts the 7 added tokens too."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    n_added = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    if vocab_size < 256 + n_added:
        raise ValueError(f"vocab_size must be at least {256 + n_added} (256 bytes + {n_added} added tokens)")
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, whatever the corpus
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus or DEFAULT_CORPUS), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.save(str(dst / "tokenizer.json"))

    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    _write_json(
        dst / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "add_bos_token": False,
            "model_max_length": 4096,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        dst / "generation_config.json", {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    )


def tiny_config(tokenizer_vocab_size: int, eos_token_ids: list[int], **overrides: Any) -> dict[str, Any]:
    """The flat qwen3_5_text config.json of the tiny model; `overrides` replace top-level keys
    (rope_theta / partial_rotary_factor go into rope_parameters; layer_types follows num_hidden_layers)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    for k in ("rope_theta", "partial_rotary_factor"):
        if k in overrides:
            rope[k] = overrides.pop(k)
    n_layers = int(overrides.get("num_hidden_layers", 8))
    interval = int(overrides.get("full_attention_interval", 4))
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": tokenizer_vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": n_layers,
        "full_attention_interval": interval,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attn_output_gate": True,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": rope,
        "max_position_embeddings": 4096,
        "mtp_num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "eos_token_id": list(eos_token_ids),
        "dtype": "bfloat16",
    }
    cfg.update(overrides)
    if cfg["vocab_size"] < tokenizer_vocab_size:
        raise ValueError(
            f"vocab_size {cfg['vocab_size']} is smaller than the tokenizer's {tokenizer_vocab_size}"
        )
    return cfg


def _tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name -> (shape, init kind), in a fixed order (the order random numbers are drawn)."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    C = 2 * nk * dk + nv * dv
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def layer(p: str, kind: str) -> None:
        out[f"{p}.input_layernorm.weight"] = ((H,), "norm1p")
        out[f"{p}.post_attention_layernorm.weight"] = ((H,), "norm1p")
        if kind == "full_attention":
            a = f"{p}.self_attn"
            out[f"{a}.q_proj.weight"] = ((nh * 2 * d, H), "linear")  # per head [query d | gate d]
            out[f"{a}.k_proj.weight"] = ((nkv * d, H), "linear")
            out[f"{a}.v_proj.weight"] = ((nkv * d, H), "linear")
            out[f"{a}.o_proj.weight"] = ((H, nh * d), "linear")
            out[f"{a}.q_norm.weight"] = ((d,), "norm1p")
            out[f"{a}.k_norm.weight"] = ((d,), "norm1p")
        else:
            g = f"{p}.linear_attn"
            out[f"{g}.in_proj_qkv.weight"] = ((C, H), "linear")
            out[f"{g}.in_proj_z.weight"] = ((nv * dv, H), "linear")
            out[f"{g}.in_proj_b.weight"] = ((nv, H), "linear")
            out[f"{g}.in_proj_a.weight"] = ((nv, H), "linear")
            out[f"{g}.conv1d.weight"] = ((C, 1, K), "conv")
            out[f"{g}.dt_bias"] = ((nv,), "dt_bias")
            out[f"{g}.A_log"] = ((nv,), "A_log")
            out[f"{g}.norm.weight"] = ((dv,), "norm")
            out[f"{g}.out_proj.weight"] = ((H, nv * dv), "linear")
        out[f"{p}.mlp.gate_proj.weight"] = ((I, H), "linear")
        out[f"{p}.mlp.up_proj.weight"] = ((I, H), "linear")
        out[f"{p}.mlp.down_proj.weight"] = ((H, I), "linear")

    out["model.embed_tokens.weight"] = ((V, H), "linear")
    for i, kind in enumerate(cfg["layer_types"]):
        layer(f"model.layers.{i}", kind)
    out["model.norm.weight"] = ((H,), "norm1p")
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = ((V, H), "linear")
    if cfg["mtp_num_hidden_layers"] > 0:
        out["mtp.fc.weight"] = ((H, 2 * H), "linear")
        out["mtp.pre_fc_norm_embedding.weight"] = ((H,), "norm1p")
        out["mtp.pre_fc_norm_hidden.weight"] = ((H,), "norm1p")
        for i in range(cfg["mtp_num_hidden_layers"]):
            layer(f"mtp.layers.{i}", "full_attention")
        out["mtp.norm.weight"] = ((H,), "norm1p")
    return out


def _init(shape: tuple[int, ...], kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "linear":
        return torch.randn(shape, generator=gen) * 0.02
    if (
        kind == "norm1p"
    ):  # used as (1 + w): small values around 0 keep the norm near identity, but not exactly
        return torch.randn(shape, generator=gen) * 0.1
    if kind == "norm":  # the GDN output norm multiplies by w itself: around 1
        return 1.0 + torch.randn(shape, generator=gen) * 0.1
    if kind == "conv":
        return torch.randn(shape, generator=gen) * (1.0 / math.sqrt(shape[-1]))
    if kind == "dt_bias":
        return torch.randn(shape, generator=gen) * 0.5
    if kind == "A_log":  # decay rates A in [1, 16]
        return torch.log(torch.rand(shape, generator=gen) * 15.0 + 1.0)
    raise ValueError(kind)


def make_tiny_checkpoint(dst: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random tiny Qwen3.5-style checkpoint (deterministic for a seed) into `dst`; return `dst`.

    Overrides replace config.json keys, e.g. num_hidden_layers=4, tie_word_embeddings=True,
    mtp_num_hidden_layers=0, dtype="float32" (the dtype of the saved tensors)."""
    dst = Path(dst)
    make_tokenizer_files(dst)
    tok = _HFTokenizer.from_file(str(dst / "tokenizer.json"))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    cfg = tiny_config(tok.get_vocab_size(with_added_tokens=True), eos, **config_overrides)
    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: _init(shape, kind, gen).to(dtype).contiguous()
        for name, (shape, kind) in _tensor_shapes(cfg).items()
    }
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _write_json(dst / "config.json", cfg)
    return dst


def embedded_or_skip(variant: str = "lumo-tiny") -> Path:
    """The embedded model `variant`'s directory in lumo/assets; skips the calling test where this install
    does not ship it (a checkout before bench/train_tiny.py ran)."""
    import pytest

    path = Path(__file__).parent / "assets" / variant
    if not (path / "config.json").exists():
        pytest.skip(f"{variant} is not in lumo/assets")
    return path


class ScriptedAdaptive:
    """An adaptive-speculation policy (lumo.engine.adaptive.AdaptiveSpec's interface) that follows a fixed
    pattern of choices, True = event, whatever the times: for testing the engine's switches."""

    def __init__(self, pattern: list[bool]):
        self.pattern, self.i = pattern, 0

    def new_request(self) -> None:
        pass

    def speculate(self) -> bool:
        return self.pattern[self.i % len(self.pattern)]

    def record_event(self, tokens: int, seconds: float) -> None:
        self.i += 1

    def record_plain(self, seconds: float) -> None:
        self.i += 1
