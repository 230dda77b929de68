from __future__ import annotations

import math

import pytest

from lumo.config import FULL, LINEAR, ConfigError, ModelConfig

TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
    "mtp_num_hidden_layers": 1,
    "eos_token_id": 248044,
}


def test_flat_27b_shapes():
    cfg = ModelConfig.from_hf(TEXT)
    assert cfg.full_attention_layers == tuple(range(3, 64, 4))
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7
    assert cfg.conv_dim == 2 * 16 * 128 + 48 * 128
    assert cfg.gdn_ratio == 3 and cfg.gqa_ratio == 6
    assert cfg.mtp_num_hidden_layers == 1 and cfg.eos_token_ids == (248044,)


def test_wrapper_and_explicit_layer_types():
    types = [LINEAR, FULL] * 32
    inner = {**TEXT, "layer_types": types}
    inner.pop("rope_parameters")
    inner["partial_rotary_factor"] = 0.5
    inner["rope_theta"] = 5e6
    d = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": inner,
        "tie_word_embeddings": False,
    }
    cfg = ModelConfig.from_hf(d)
    assert cfg.layer_types == tuple(types)
    assert cfg.rotary_dim == 128 and cfg.rope_theta == 5e6


def test_frozen():
    cfg = ModelConfig.from_hf(TEXT)
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1  # type: ignore[misc]


NAN, INF = float("nan"), float("inf")  # what Python's JSON reads for NaN and Infinity


@pytest.mark.parametrize(
    "d, words",
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "llama"),
        ({**TEXT, "layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({**TEXT, "layer_types": ["sliding_attention"] * 64}, "sliding_attention"),
        ({**TEXT, "linear_num_value_heads": 40}, "multiple"),
        # wrong types and ranges are named, not tracebacks (or silently wrong, like bool("false"))
        ({**TEXT, "tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
        ({**TEXT, "hidden_size": None}, "hidden_size must be an integer"),
        ({**TEXT, "hidden_size": [64]}, "hidden_size must be an integer"),
        ({**TEXT, "num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1"),
        ({**TEXT, "num_key_value_heads": 0}, "num_key_value_heads"),
        ({**TEXT, "linear_num_key_heads": 0}, "linear_num_key_heads"),
        ({k: v for k, v in TEXT.items() if k != "layer_types"} | {"full_attention_interval": 0}, "interval"),
        ({**TEXT, "rope_parameters": [1, 2]}, "rope_parameters must be an object"),
        ({**TEXT, "rope_parameters": {"partial_rotary_factor": 2.0}}, "partial_rotary_factor"),
        ({**TEXT, "eos_token_id": ["a"]}, "eos_token_id"),
        ({**TEXT, "max_position_embeddings": 1}, "max_position_embeddings"),
        ([1], "JSON object"),
        # RoPE scalings lumo does not compute are refused, never served unscaled
        ({**TEXT, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        (
            {k: v for k, v in TEXT.items() if k != "rope_parameters"} | {"rope_scaling": {"type": "llama3"}},
            "rope_type 'llama3'",
        ),
        ({**TEXT, "rope_parameters": {"rope_type": "longrope"}}, "not supported (default, linear, yarn)"),
        ({**TEXT, "rope_parameters": {"rope_type": "linear"}}, "factor must be a finite number"),
        # numbers out of their range (session 47: accepted, and the output NaN)
        ({**TEXT, "rope_parameters": {"rope_type": "linear", "factor": NAN}}, "finite number, got nan"),
        ({**TEXT, "rope_parameters": {"rope_type": "yarn", "factor": INF}}, "finite number, got inf"),
        ({**TEXT, "rms_norm_eps": -1}, "rms_norm_eps must be > 0"),
        ({**TEXT, "rope_parameters": {"rope_theta": 0}}, "rope_theta must be > 0"),
        ({**TEXT, "rope_parameters": {"rope_type": "yarn", "factor": -1.0}}, "factor must be > 0"),
        ({**TEXT, "rope_parameters": {"rope_type": "yarn", "factor": 2, "truncate": "no"}}, "truncate"),
        ({**TEXT, "attention_bias": True}, "attention_bias=true is not supported"),
        ({**TEXT, "num_experts": 256}, "mixture-of-experts"),
        ({**TEXT, "layer_types": []}, "layer_types has 0 entries for 64 layers"),
    ],
)
def test_errors_are_one_line(d, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(d)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_rope_scaling_and_transformers_defaults():
    """Qwen's YaRN recipe read as transformers reads it (the older `rope_scaling` / `type` spelling too);
    a config that leaves partial_rotary_factor or head_dim out gets transformers' defaults for this family
    (a quarter of each head rotated, 256-wide heads), not hidden / heads or a full rotation."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144, "rope_theta": 1e7}
    cfg = ModelConfig.from_hf({**TEXT, "rope_parameters": yarn, "max_position_embeddings": 1010000})
    s = cfg.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 262144)
    assert (s.beta_fast, s.beta_slow, s.truncate) == (32.0, 1.0, True)
    assert abs(s.attention_factor - (0.1 * math.log(4.0) + 1)) < 1e-12
    old = {k: v for k, v in TEXT.items() if k != "rope_parameters"} | {
        "rope_scaling": {"type": "linear", "factor": 2}
    }
    assert ModelConfig.from_hf(old).rope_scaling.rope_type == "linear"
    # both spellings: the older rope_scaling wins (transformers'), over rope_parameters' theta and factor
    both = ModelConfig.from_hf({**TEXT, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert both.rope_scaling.rope_type == "yarn" and both.rope_theta == 1e7 and both.rotary_dim == 64
    assert ModelConfig.from_hf(TEXT).rope_scaling is None
    bare = {k: v for k, v in TEXT.items() if k not in ("rope_parameters", "head_dim")}
    cfg = ModelConfig.from_hf(bare)
    assert cfg.partial_rotary_factor == 0.25 and cfg.head_dim == 256 and cfg.rotary_dim == 64


def test_wrapper_ties_on_the_top_level_flag():
    # transformers writes a tied wrapper as top-level true, text_config false; the wrapper model ties.
    d = {
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": {**TEXT, "tie_word_embeddings": False},
    }
    assert ModelConfig.from_hf(d).tie_word_embeddings


def test_missing_keys_are_named():
    d = {k: v for k, v in TEXT.items() if k not in ("vocab_size", "linear_value_head_dim")}
    with pytest.raises(ConfigError, match="vocab_size, linear_value_head_dim"):
        ModelConfig.from_hf(d)
