"""Checkpoint loading: layouts (flat / wrapper / sharded), formats (BF16, F32, NVFP4, W4A16, FP8, mixed;
ModelOpt's and compressed-tensors' NVFP4), the hub cache, and the one-line errors for user mistakes."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lumo.config import ConfigError, ModelConfig
from lumo.model import forward
from lumo.quant import fp8_quantize, nvfp4_dequantize, nvfp4_quantize
from lumo.testing import make_tiny_checkpoint
from lumo.weights import (
    DenseLinear,
    FP8Linear,
    LazyLayers,
    ModelWeights,
    NVFP4Linear,
    WeightError,
    build_weights,
    dense_linear_builder,
    layer_formats,
    linear_rows,
    load_model,
    read_quant_spec,
    resolve_model_path,
)

WRAPPER = "model.language_model."


def tiny(tmp_path: Path, **over) -> Path:
    """The shared tiny model with 4 layers (3 GDN + 1 attention) and an MTP layer."""
    return make_tiny_checkpoint(tmp_path / "ckpt", num_hidden_layers=4, **over)


def wrap(name: str) -> str:
    return WRAPPER + name[len("model.") :] if name.startswith("model.") else name


def resave(
    d: Path,
    tensors: dict[str, torch.Tensor],
    *,
    wrapper: bool = False,
    shards: int = 1,
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """Re-write d's tensors: optionally under the Qwen3.5 wrapper layout (names and config), into `shards`
    files with model.safetensors.index.json, plus `extra` tensors (e.g. model.visual.*)."""
    cfg = json.loads((d / "config.json").read_text())
    if wrapper:
        tensors = {
            (WRAPPER + n[len("model.") :] if n.startswith("model.") else n): t for n, t in tensors.items()
        }
        text = {**cfg, "model_type": "qwen3_5_text"}
        cfg = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text,
            "vision_config": {"depth": 1},
            "tie_word_embeddings": False,
        }
        (d / "config.json").write_text(json.dumps(cfg))
    tensors = {**tensors, **(extra or {})}
    for f in d.glob("*.safetensors"):
        f.unlink()
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(d / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def assert_same(a, b, path: str = "w") -> None:
    """Recursive bitwise equality of two weight trees (dataclasses, lists, tensors)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, f"{path}: {a.dtype} vs {b}"
        assert a.shape == b.shape and torch.equal(a, b), f"{path} differs"
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def expected_dense(cfg: ModelConfig, tensors: dict[str, torch.Tensor], prefix: str, dtype) -> ModelWeights:
    get = lambda n: tensors[n].to(dtype) if n in tensors else None
    return build_weights(cfg, get, dense_linear_builder(get), prefix)


def named_linears(w: ModelWeights, prefix: str = "model.") -> dict[str, object]:
    """Checkpoint module name -> loaded linear (dataclass field names are the checkpoint names)."""
    out: dict[str, object] = {"lm_head": w.lm_head}

    def layer(p: str, lw) -> None:
        mixer = "self_attn" if hasattr(lw.mixer, "q_proj") else "linear_attn"
        for blk, obj in ((mixer, lw.mixer), ("mlp", lw.mlp)):
            for f in dataclasses.fields(obj):
                v = getattr(obj, f.name)
                if isinstance(v, DenseLinear | NVFP4Linear | FP8Linear):
                    out[f"{p}.{blk}.{f.name}"] = v

    for i, lw in enumerate(w.layers):
        layer(f"{prefix}layers.{i}", lw)
    if w.mtp is not None:
        out["mtp.fc"] = w.mtp.fc
        for i, lw in enumerate(w.mtp.layers):
            layer(f"mtp.layers.{i}", lw)
    return out


def quantize_tensors(tensors: dict[str, torch.Tensor], algo_of) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantise each linear whose module `algo_of(module)` names (NVFP4 / W4A16_NVFP4 / FP8 / None) the
    way ModelOpt stores it; return the new tensors and module -> algo."""
    out, algos = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        algo = algo_of(module) if name.endswith(".weight") and t.ndim == 2 and "embed" not in name else None
        if algo is None:
            out[name] = t
            continue
        algos[module] = algo
        if algo == "FP8":
            q, s = fp8_quantize(t)
            out |= {name: q, f"{module}.weight_scale": s, f"{module}.input_scale": torch.tensor(0.5)}
        else:
            p, s, s2 = nvfp4_quantize(t)
            out |= {name: p, f"{module}.weight_scale": s, f"{module}.weight_scale_2": s2}
            if algo == "NVFP4":
                out[f"{module}.input_scale"] = torch.tensor(0.25)
    return out, algos


def default_algo(algo: str):
    """Quantise the big linears of the trunk, keep GDN gates, lm_head and mtp.* dense (like NVIDIA's)."""
    keep = ("in_proj_a", "in_proj_b")
    return lambda m: None if m.startswith(("mtp.", "lm_head")) or m.endswith(keep) else algo


def write_quant_config(d: Path, q: dict, where: str = "hf") -> None:
    if where == "hf":
        (d / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt"}, "quantization": q})
        )
    else:
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "modelopt", **q}
        (d / "config.json").write_text(json.dumps(cfg))


def check_quantized(w: ModelWeights, orig: dict[str, torch.Tensor], algos: dict[str, str], prefix="model."):
    for module, lin in named_linears(w, prefix).items():
        ref = orig[f"{module}.weight"]
        algo = algos.get(module)
        if algo is None:
            assert isinstance(lin, DenseLinear) and torch.equal(lin.weight, ref.float()), module
        elif algo == "FP8":
            q, s = fp8_quantize(ref)
            assert isinstance(lin, FP8Linear) and lin.weight.dtype == torch.float8_e4m3fn, module
            assert torch.equal(lin.dequantize(), q.float() * s) and float(lin.input_scale) == 0.5
        else:
            assert isinstance(lin, NVFP4Linear), module
            assert lin.weight.dtype == torch.uint8 and lin.weight_scale.dtype == torch.float8_e4m3fn
            assert lin.weight_scale_2.shape == () and lin.weight_scale_2.dtype == torch.float32
            assert torch.equal(lin.dequantize(), nvfp4_dequantize(*nvfp4_quantize(ref))), module
            assert lin.activations == ("nvfp4" if algo == "NVFP4" else "bf16"), module
            assert (lin.input_scale is not None) == (algo == "NVFP4")


# ---------------------------------------------------------------------------------------------


def test_flat_bf16_loads_every_tensor(tmp_path):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    cfg, w = load_model(d, progress=False)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert w.mtp is not None and len(w.mtp.layers) == 1
    assert_same(w, expected_dense(cfg, raw, "model.", torch.float32))
    assert w.layers[0].mixer.conv1d.shape == (cfg.conv_dim, cfg.linear_conv_kernel_dim)


def test_wrapper_sharded_f32_ignores_visual(tmp_path):
    d = tiny(tmp_path, dtype="float32")
    raw = load_file(d / "model.safetensors")
    # an int8 vision tensor: reading it as a dense weight would raise, so loading proves it is never read
    visual = {"model.visual.blocks.0.attn.qkv.weight": torch.ones(8, 8, dtype=torch.int8)}
    resave(d, raw, wrapper=True, shards=3, extra=visual)
    cfg, w = load_model(str(d), dtype=torch.bfloat16, progress=False)
    assert cfg.model_type == "qwen3_5_text"
    wrapped = {wrap(n): t for n, t in raw.items()}
    assert_same(w, expected_dense(cfg, wrapped, WRAPPER, torch.bfloat16))


@pytest.mark.parametrize("where", ["hf", "config"])
@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4", "FP8"])
def test_quantized_checkpoint(tmp_path, algo, where):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    q, algos = quantize_tensors(raw, default_algo(algo))
    resave(d, q)
    excl = ["lm_head", "*in_proj_a", "*in_proj_b", "mtp*"]
    write_quant_config(d, {"quant_algo": algo, "group_size": 16, "exclude_modules": excl}, where)
    cfg, w = load_model(d, progress=False)
    assert {type(x).__name__ for x in named_linears(w).values()} == {
        "DenseLinear",
        "FP8Linear" if algo == "FP8" else "NVFP4Linear",
    }
    check_quantized(w, raw, algos)


def test_mixed_precision_wrapper(tmp_path):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    cycle = ["NVFP4", "W4A16_NVFP4", "FP8", None]
    pick = {}

    def algo_of(m: str):
        if m.startswith(("mtp.", "lm_head")) or m.endswith(("in_proj_a", "in_proj_b")):
            return None
        return pick.setdefault(m, cycle[len(pick) % len(cycle)])

    q, algos = quantize_tensors(raw, algo_of)
    assert set(algos.values()) == {"NVFP4", "W4A16_NVFP4", "FP8"}
    resave(d, q, wrapper=True, extra={"model.visual.merger.weight": torch.zeros(4, 4)})
    layers = {wrap(m): {"quant_algo": a, "group_size": 16} for m, a in algos.items()}
    write_quant_config(d, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers})
    _, w = load_model(d, progress=False)
    renamed = {wrap(n): t for n, t in raw.items()}
    check_quantized(w, renamed, {wrap(m): a for m, a in algos.items()}, prefix=WRAPPER)


def test_config_contradicting_the_tensors(tmp_path):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    q, algos = quantize_tensors(raw, default_algo("NVFP4"))
    resave(d, q)
    module = "model.layers.3.self_attn.o_proj"
    layers = {m: {"quant_algo": "FP8" if m == module else a} for m, a in algos.items()}
    write_quant_config(d, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers})
    with pytest.raises(WeightError, match=rf"{module}.weight is stored as nvfp4 .* says FP8"):
        load_model(d, progress=False)
    # a MIXED_PRECISION entry for a module stored dense is a contradiction too
    layers = {**{m: {"quant_algo": a} for m, a in algos.items()}, "lm_head": {"quant_algo": "NVFP4"}}
    write_quant_config(d, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers})
    with pytest.raises(WeightError, match=r"lm_head.weight is stored as dense"):
        load_model(d, progress=False)


def test_missing_tensors_are_named(tmp_path):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    resave(d, {n: t for n, t in raw.items() if n != "model.layers.1.linear_attn.A_log"})
    with pytest.raises(WeightError, match=r"^missing tensor model\.layers\.1\.linear_attn\.A_log$"):
        load_model(d, progress=False)
    q, _ = quantize_tensors(raw, default_algo("NVFP4"))
    del q["model.layers.2.mlp.up_proj.weight_scale"]
    resave(d, q)
    with pytest.raises(WeightError, match=r"missing tensor model\.layers\.2\.mlp\.up_proj\.weight_scale"):
        load_model(d, progress=False)


def test_wrong_shapes_show_expected_and_found(tmp_path):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    bad = dict(raw)
    bad["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(120, 64, dtype=torch.bfloat16)
    resave(d, bad)
    msg = r"model\.layers\.3\.self_attn\.q_proj\.weight has shape \[120, 64\], expected \[128, 64\]"
    with pytest.raises(WeightError, match=msg):
        load_model(d, progress=False)
    q, _ = quantize_tensors(raw, default_algo("NVFP4"))
    q["model.layers.0.mlp.down_proj.weight_scale"] = q["model.layers.0.mlp.down_proj.weight_scale"][
        :, :4
    ].contiguous()
    resave(d, q)
    with pytest.raises(WeightError, match=r"down_proj\.weight_scale has shape \[64, 4\], expected \[64, 8\]"):
        load_model(d, progress=False)


def test_unknown_quantization(tmp_path):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    write_quant_config(d, {"quant_algo": "INT4_AWQ"})
    with pytest.raises(WeightError, match="unknown quantisation 'INT4_AWQ' in hf_quant_config.json"):
        load_model(d, progress=False)
    (d / "hf_quant_config.json").unlink()
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(WeightError, match="quant_method 'gptq'"):
        load_model(d, progress=False)
    (d / "config.json").write_text(json.dumps(cfg))
    bad = {**raw, "model.layers.0.mlp.gate_proj.weight": torch.zeros(128, 64, dtype=torch.int8)}
    resave(d, bad)
    with pytest.raises(
        WeightError, match=r"unknown quantisation: tensor model\.layers\.0\.mlp\.gate_proj\.weight"
    ):
        load_model(d, progress=False)


def test_bad_paths_and_configs(tmp_path):
    with pytest.raises(WeightError, match="does not exist"):
        load_model(tmp_path / "nope" / "x" / "y")
    with pytest.raises(WeightError, match="no config.json"):
        load_model(tmp_path)
    d = tiny(tmp_path)
    with pytest.raises(WeightError, match="is a file"):
        load_model(d / "config.json")
    (d / "model.safetensors").rename(d / "weights.bin")
    with pytest.raises(WeightError, match="no .safetensors files"):
        load_model(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ConfigError):
        load_model(d)
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": "fp8"}))
    with pytest.raises(WeightError, match="quantization_config must be an object"):
        load_model(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(WeightError, match="not valid JSON"):
        load_model(d)


def test_checkpoint_without_mtp_tensors(tmp_path):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    resave(d, {n: t for n, t in raw.items() if not n.startswith("mtp.")})
    cfg, w = load_model(d, progress=False)
    assert cfg.mtp_num_hidden_layers == 1 and w.mtp is None


def test_offline_hub_id_not_cached(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightError, match="HF_HUB_OFFLINE"):
        load_model("lumo-tests/not-a-real-model")


def test_offline_hub_id_from_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    src = tiny(tmp_path)
    repo = tmp_path / "hub" / "models--lumo-tests--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in src.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("lumo-tests/tiny") == snap
    cfg, w = load_model("lumo-tests/tiny", progress=False)
    assert cfg.num_layers == 4 and w.mtp is not None


# ---------------------------------------------------------------------------------------------
# compressed-tensors NVFP4 (llm-compressor, vLLM): the same weights in the other checkpoint convention.

CT_NVFP4_ARGS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
    "dynamic": False,
    "actorder": None,
    "block_structure": None,
    "observer": "minmax",
    "observer_kwargs": {},
    "scale_dtype": "torch.float8_e4m3fn",
    "zp_dtype": None,
}
CT_NVFP4_ACTS = {**CT_NVFP4_ARGS, "dynamic": "local", "observer": "static_minmax"}


def ct_group(targets: list[str], w4a4: bool, **weights) -> dict:
    """A config group as compressed-tensors serialises one (its NVFP4 / NVFP4A16 presets)."""
    return {
        "targets": targets,
        "weights": {**CT_NVFP4_ARGS, **weights},
        "input_activations": dict(CT_NVFP4_ACTS) if w4a4 else None,
        "output_activations": None,
        "format": "nvfp4-pack-quantized",
    }


def write_ct_config(d: Path, groups: dict, ignore: list[str], **extra) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        **extra,
    }
    (d / "config.json").write_text(json.dumps(cfg))


def to_compressed_tensors(q: dict[str, torch.Tensor], algos: dict[str, str]) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors renamed and rescaled as compressed-tensors' ModelOpt converter does: weight ->
    weight_packed, and the global scales stored as divisors, F32 [1]: weight_global_scale =
    1 / weight_scale_2, input_global_scale = 1 / input_scale. weight_scale (e4m3 block scales) is kept."""
    divisors = {"weight_scale_2": "weight_global_scale", "input_scale": "input_global_scale"}
    out = {}
    for name, t in q.items():
        module, _, suffix = name.rpartition(".")
        if module in algos and suffix == "weight":
            out[f"{module}.weight_packed"] = t
        elif module in algos and suffix in divisors:
            out[f"{module}.{divisors[suffix]}"] = (1.0 / t.float()).reshape(1)
        else:
            out[name] = t
    return out


def check_like_modelopt(ct: ModelWeights, mo: ModelWeights) -> None:
    """Every linear of the compressed-tensors load equals the ModelOpt load of the same weights: packed codes,
    block scales and dense weights bitwise. lumo keeps fl32(1 / weight_global_scale), and two fp32 reciprocals
    round twice, so weight_scale_2 (and input_scale) may be one ulp off ModelOpt's (~14% of random values are)
    and the dequantised weights agree to rtol 2^-22 (that ulp plus the product's rounding), not bitwise."""
    mo_linears = named_linears(mo)
    for module, c in named_linears(ct).items():
        m = mo_linears[module]
        assert type(c) is type(m), module
        if isinstance(m, DenseLinear):
            assert_same(c, m, module)
            continue
        assert torch.equal(c.weight, m.weight) and torch.equal(c.weight_scale, m.weight_scale), module
        assert c.weight_scale_2.shape == () and c.weight_scale_2.dtype == torch.float32, module
        for a, b in ((c.weight_scale_2, m.weight_scale_2), (c.input_scale, m.input_scale)):
            assert (a is None) == (b is None), module
            if a is not None:
                assert torch.equal(a, 1.0 / (1.0 / b)) and (a - b).abs() <= b * 2.0**-23, module
        assert torch.equal(c.dequantize(), nvfp4_dequantize(m.weight, m.weight_scale, c.weight_scale_2))
        torch.testing.assert_close(c.dequantize(), m.dequantize(), rtol=2.0**-22, atol=0, msg=module)
        assert c.activations == m.activations, module


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4"])
def test_compressed_tensors_nvfp4_equals_modelopt(tmp_path, algo):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    q, algos = quantize_tensors(raw, default_algo(algo))
    if algo == "NVFP4":  # calibrated-looking activation scales, not powers of two
        for i, m in enumerate(algos):
            q[f"{m}.input_scale"] = torch.tensor(0.0123 * (1 + i / 7))
    mo_dir = shutil.copytree(d, tmp_path / "modelopt")
    resave(mo_dir, q)
    excl = ["lm_head", "*in_proj_a", "*in_proj_b", "mtp*"]
    write_quant_config(mo_dir, {"quant_algo": algo, "group_size": 16, "exclude_modules": excl})
    resave(d, to_compressed_tensors(q, algos))
    ignore = ["lm_head", r"re:.*\.in_proj_[ab]$"]  # mtp.* is not listed: transformers never loads it
    write_ct_config(d, {"group_0": ct_group(["Linear"], w4a4=algo == "NVFP4")}, ignore)

    _, mo = load_model(mo_dir, progress=False)
    cfg, ct = load_model(d, progress=False)
    linears = named_linears(ct)
    assert {m for m, x in linears.items() if isinstance(x, NVFP4Linear)} == set(algos) and ct.mtp is not None
    assert {linears[m].activations for m in algos} == {"nvfp4" if algo == "NVFP4" else "bf16"}
    check_like_modelopt(ct, mo)
    ids = torch.tensor([[3, 17, 101, 250, 42, 7]])
    logits_ct, logits_mo = forward(cfg, ct, ids)[0], forward(cfg, mo, ids)[0]
    # weights within two fp32 ulps of each other: the float32 logits agree to a few ulps of their size
    torch.testing.assert_close(logits_ct, logits_mo, rtol=1e-6, atol=1e-6)


def test_compressed_tensors_ignore_and_targets(tmp_path):
    """`ignore` entries and targets are exact names or "re:" regexes matched at the start of the module name
    (re.match); an ignored or untargeted module loads dense, and one stored packed anyway is an error."""
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    trunk_mlp = r"re:model\.layers\.\d+\.mlp\.(gate|up|down)_proj$"
    o_proj = "model.layers.3.self_attn.o_proj"

    def algo_of(m: str):  # the trunk's MLPs but layer 1's, and one attention o_proj
        mlp = re.match(trunk_mlp[3:], m) and not m.startswith("model.layers.1.")
        return "W4A16_NVFP4" if mlp or m == o_proj else None

    q, algos = quantize_tensors(raw, algo_of)
    resave(d, to_compressed_tensors(q, algos))
    # actorder "weight" orders the GPTQ calibration only, the stored format is the same
    groups = {"group_0": ct_group([trunk_mlp, o_proj], w4a4=False, actorder="weight")}
    write_ct_config(d, groups, ignore=["lm_head", r"re:model\.layers\.1\.mlp\."])
    spec = read_quant_spec(d, json.loads((d / "config.json").read_text()))
    assert spec.declared("model.layers.0.mlp.down_proj") == "W4A16_NVFP4"  # regex target
    assert spec.declared(o_proj) == "W4A16_NVFP4"  # exact-name target
    assert spec.declared("model.layers.1.mlp.up_proj") is None  # regex ignore
    assert spec.declared("model.layers.3.self_attn.q_proj") is None  # targeted by no group
    assert spec.declared("lm_head") is None  # exact-name ignore
    # re.match anchors at the start: a pattern for the middle of the name matches nothing
    assert dataclasses.replace(spec, ignore=(r"re:layers\.0\.",)).declared("model.layers.0.mlp.up_proj")
    # a target naming the module wins over the class "Linear", whatever the order of the groups
    w4a4_first = dataclasses.replace(spec, groups=((("Linear",), "NVFP4"), *spec.groups))
    assert w4a4_first.declared(o_proj) == "W4A16_NVFP4" and w4a4_first.declared("mtp.fc") == "NVFP4"

    _, w = load_model(d, progress=False)
    linears = named_linears(w)
    assert {m for m, x in linears.items() if isinstance(x, NVFP4Linear)} == set(algos)
    for m in ("model.layers.1.mlp.up_proj", "model.layers.3.self_attn.q_proj", "lm_head"):
        assert torch.equal(linears[m].weight, raw[f"{m}.weight"].float()), m

    # ignoring a module that is stored packed contradicts the tensors
    write_ct_config(d, groups, ignore=["lm_head", r"re:model\.layers\.[01]\.mlp\."])
    msg = r"tensor model\.layers\.0\.mlp\.gate_proj\.weight_packed is stored as nvfp4 but .* unquantised"
    with pytest.raises(WeightError, match=msg):
        load_model(d, progress=False)
    # a quantised module without its global scale names the missing tensor
    write_ct_config(d, groups, ignore=["lm_head", r"re:model\.layers\.1\.mlp\."])
    ct = load_file(d / "model.safetensors")
    resave(d, {n: t for n, t in ct.items() if n != "model.layers.0.mlp.up_proj.weight_global_scale"})
    with pytest.raises(
        WeightError, match=r"^missing tensor model\.layers\.0\.mlp\.up_proj\.weight_global_scale"
    ):
        load_model(d, progress=False)


@pytest.mark.parametrize(
    "change, words",
    [
        # int4 W4A16 (GPTQ / AWQ style): pack-quantized
        (
            {"format": "pack-quantized", "weights": {"type": "int", "strategy": "group", "group_size": 128}},
            "compressed-tensors format 'pack-quantized' in config group 'group_0'",
        ),
        # FP8 per channel / per block
        (
            {
                "format": "float-quantized",
                "weights": {"num_bits": 8, "strategy": "channel", "group_size": None},
            },
            "format 'float-quantized'",
        ),
        (
            {
                "format": "float-quantized",
                "weights": {"num_bits": 8, "strategy": "block", "group_size": None},
            },
            "format 'float-quantized'",
        ),
        (
            {"weights": {"group_size": 32}},
            r"weights group_size 32 in config group 'group_0' .*\(group_size 16\)",
        ),
        ({"weights": {"symmetric": False}}, "weights symmetric False"),
        ({"weights": {"actorder": "group"}}, "weights actorder 'group'"),
        ({"weights": {"strategy": "group"}}, "weights strategy 'group'"),
        ({"input_activations": {**CT_NVFP4_ACTS, "num_bits": 8}}, "input_activations num_bits 8"),
        ({"config": {"sparsity_config": {"format": "sparse-24-bitmask"}}}, "has a sparsity_config"),
        ({"targets": ["re:model.(layers"]}, r"invalid regular expression 're:model\.\(layers'"),
    ],
    ids="int4-pack fp8-channel fp8-block group32 asym actorder group a8 sparse regex".split(),
)
def test_compressed_tensors_unsupported(tmp_path, change, words):
    d = tiny(tmp_path)
    group = ct_group(["Linear"], w4a4=True)
    group |= {k: v for k, v in change.items() if k in ("format", "input_activations", "targets")}
    group["weights"] |= change.get("weights", {})
    write_ct_config(d, {"group_0": group}, ["lm_head"], **change.get("config", {}))
    with pytest.raises(WeightError, match=words) as e:
        load_model(d, progress=False)
    assert "\n" not in str(e.value)


# ---- block FP8 (quant_method "fp8": Qwen's / DeepSeek's FP8 checkpoints) ----------------------------------


def block_fp8(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (fp8 weight, weight_scale_inv [ceil(N/bn), ceil(K/bk)] f32) with W ~ q * scale per block,
    written independently of lumo (partial edge blocks included)."""
    N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    scale = torch.empty(nb, kb)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            s = max(blk.abs().max().item() / 448.0, 1e-12)
            scale[i, j] = s
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def write_block_fp8(d: Path, bn: int, bk: int, skip=("lm_head",), **extra_q) -> tuple[dict, dict]:
    """The tiny checkpoint with every 2-D linear weight (embedding, lm_head and in_proj_b/a excepted) in
    block FP8, and its quantization_config; returns (original tensors, {module: (q, scale)})."""
    raw = load_file(d / "model.safetensors")
    out, fp8 = {}, {}
    for name, t in raw.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.ndim == 2 and "embed" not in name and "lm_head" not in name:
            if not module.endswith(("in_proj_a", "in_proj_b")):
                q, s = block_fp8(t, bn, bk)
                out |= {name: q, f"{module}.weight_scale_inv": s}
                fp8[module] = (q, s)
                continue
        out[name] = t
    resave(d, out)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [bn, bk],
        "modules_to_not_convert": list(skip),
        **extra_q,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return raw, fp8


def test_block_fp8_checkpoint(tmp_path):
    d = tiny(tmp_path)
    raw, fp8 = write_block_fp8(d, 16, 48)  # partial blocks: the tiny dims are not multiples of 48
    cfg, w = load_model(d, progress=False)
    lins = named_linears(w)
    assert fp8 and set(fp8) <= set(lins)
    for module, lin in lins.items():
        if module in fp8:
            q, s = fp8[module]
            assert isinstance(lin, FP8Linear) and lin.block == (16, 48), module
            N, K = q.shape
            want = q.float() * s.repeat_interleave(16, 0)[:N].repeat_interleave(48, 1)[:, :K]
            assert torch.equal(lin.dequantize(), want), module
            assert (lin.dequantize() - raw[f"{module}.weight"]).norm() < 0.07 * raw[f"{module}.weight"].norm()
            # a draft vocabulary's rows keep their blocks' scales
            rows = torch.tensor([0, N - 1, N // 2, 3])
            assert torch.equal(linear_rows(lin, rows).dequantize(), want[rows])
        else:
            assert isinstance(lin, DenseLinear), module
    # the reference model runs on it, near the original (e4m3 keeps 3 mantissa bits: ~3% per weight)
    _, dense = load_model(tiny(tmp_path / "orig"), progress=False)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    a = forward(cfg, w, ids)[0]
    b = forward(cfg, dense, ids)[0]
    assert (a - b).norm() / b.norm() < 0.1
    from lumo.engine.llm import LLM

    r = LLM(d, device="cpu").generate([5, 17, 99], max_tokens=4, temperature=0)
    assert len(r.token_ids) == 4


def test_block_fp8_packs_for_the_kernels_and_the_drafter(tmp_path):
    """The kernels take FP8 as bf16 (one rounding of the dequantised weight); the drafter's NVFP4 copies
    quantise the dequantised block-FP8 weights."""
    from lumo.engine.gpu_weights import nvfp4_copy, pack_weights

    d = tiny(tmp_path)
    write_block_fp8(d, 32, 32)
    cfg, w = load_model(d, progress=False)
    gw = pack_weights(cfg, w, "cpu", mtp=True)
    lin = w.layers[0].mlp.down_proj
    part = gw.layers[0].down.parts[0]
    assert isinstance(lin, FP8Linear) and part.packed is None
    K = lin.shape[1]
    assert torch.equal(part.weight[:, :K], lin.dequantize().to(torch.bfloat16))
    copy = nvfp4_copy(lin, "cpu")
    assert isinstance(copy, NVFP4Linear)
    assert (copy.dequantize() - lin.dequantize()).norm() < 0.2 * lin.dequantize().norm()


@pytest.mark.parametrize(
    "change, words",
    [
        ({"fmt": "e5m2"}, "FP8 format 'e5m2'"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"weight_block_size": [0, 128]}, "weight_block_size"),
        ({"modules_to_not_convert": [3]}, "modules_to_not_convert"),
    ],
)
def test_block_fp8_bad_config(tmp_path, change, words):
    d = tiny(tmp_path)
    write_block_fp8(d, 32, 32, **change)
    with pytest.raises(WeightError, match=words):
        load_model(d, progress=False)


def test_block_fp8_bad_tensors(tmp_path):
    d = tiny(tmp_path)
    write_block_fp8(d, 32, 32)
    t = load_file(d / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    resave(d, {n: v for n, v in t.items() if n != name})
    with pytest.raises(WeightError, match=f"missing tensor {re.escape(name)}"):
        load_model(d, progress=False)
    resave(d, {**t, name: t[name][:, :1].contiguous()})
    with pytest.raises(WeightError, match="FP8 scales of"):
        load_model(d, progress=False)
    d2 = tiny(tmp_path / "skip")
    write_block_fp8(d2, 32, 32, skip=("lm_head", "model.layers.0.mlp.up_proj"))
    with pytest.raises(WeightError, match="stored as fp8 but .* leaves model.layers.0.mlp.up_proj"):
        load_model(d2, progress=False)


# ---------------------------------------------------------------------------------------------
# Lazy layers (load_model(lazy=True)): what the kernels' packing and `lumo check`'s reference walk.


def assert_formats(meta, real, path: str = "layer") -> None:
    """`meta` is `real` built on the meta device: the same types, dtypes, shapes and other values."""
    if isinstance(real, torch.Tensor):
        assert meta.device.type == "meta", path
        assert (meta.dtype, meta.shape) == (real.dtype, real.shape), f"{path}: {meta} vs {real.dtype}"
    elif dataclasses.is_dataclass(real):
        assert type(meta) is type(real), f"{path}: {type(meta).__name__} vs {type(real).__name__}"
        for f in dataclasses.fields(real):
            assert_formats(getattr(meta, f.name), getattr(real, f.name), f"{path}.{f.name}")
    else:
        assert meta == real, f"{path}: {meta!r} vs {real!r}"


@pytest.mark.parametrize("fmt", ["bf16", "NVFP4", "FP8", "block-fp8", "mixed-wrapper"])
def test_lazy_layers_equal_the_eager_ones(tmp_path, fmt):
    d = tiny(tmp_path)
    raw = load_file(d / "model.safetensors")
    if fmt in ("NVFP4", "FP8"):
        q, _ = quantize_tensors(raw, default_algo(fmt))
        resave(d, q, shards=2)
        write_quant_config(d, {"quant_algo": fmt, "exclude_modules": ["lm_head", "mtp*"]})
    elif fmt == "block-fp8":
        write_block_fp8(d, 16, 48)
    elif fmt == "mixed-wrapper":
        q, algos = quantize_tensors(raw, lambda m: None if m.startswith(("mtp", "lm_head")) else "NVFP4")
        resave(d, q, wrapper=True)
        layers = {wrap(m): {"quant_algo": a} for m, a in algos.items()}
        write_quant_config(d, {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers})
    _, eager = load_model(d, progress=False)
    _, lazy = load_model(d, progress=False, lazy=True)
    assert isinstance(lazy.layers, LazyLayers) and len(lazy.layers) == len(eager.layers) == 4
    assert_same(eager, dataclasses.replace(lazy, layers=list(lazy.layers)))
    assert_same(eager.layers[-1], lazy.layers[-1])
    assert_same(eager.layers, list(lazy.layers))  # a second pass reads them again
    for i, (meta, real) in enumerate(zip(lazy.layers.formats, eager.layers, strict=True)):
        assert_formats(meta, real, f"layers[{i}]")
    assert layer_formats(eager) is eager.layers
    with pytest.raises(IndexError):
        lazy.layers[4]


@pytest.mark.parametrize(
    "drop, shape",
    [
        ("model.layers.3.self_attn.k_norm.weight", None),
        ("model.layers.2.mlp.up_proj.weight_scale", None),
        (None, ("model.layers.3.mlp.down_proj.weight_scale", (64, 4))),
        (None, ("model.layers.1.linear_attn.conv1d.weight", (96, 1, 3))),
    ],
)
def test_lazy_load_checks_every_layer_before_reading_one(tmp_path, monkeypatch, drop, shape):
    """A broken last layer fails load_model(lazy=True) with the eager load's message, from the tensors'
    headers alone: the kernels would otherwise pack most of a model before finding it."""
    import lumo.weights as W

    d = tiny(tmp_path)
    q, _ = quantize_tensors(load_file(d / "model.safetensors"), default_algo("NVFP4"))
    if drop:
        del q[drop]
    else:
        name, new = shape
        q[name] = torch.zeros(new, dtype=q[name].dtype)
    resave(d, q)
    with pytest.raises(WeightError) as eager:
        load_model(d, progress=False)
    reads = []
    real = W._Checkpoint.read
    monkeypatch.setattr(W._Checkpoint, "read", lambda self, n: (reads.append(n), real(self, n))[1])
    with pytest.raises(WeightError) as lazy:
        load_model(d, progress=False, lazy=True)
    assert str(lazy.value) == str(eager.value)
    assert not [n for n in reads if n.startswith("model.layers.")]


def test_packing_a_lazy_model_holds_at_most_two_layers(tmp_path, monkeypatch):
    """pack_weights walks a lazy model's layers once: each layer's tensors are freed once it is packed, so
    the checkpoint is never whole in memory beside its packed copy (a GB10 shares that memory). The eager
    load, which holds every layer, shows that the count can see it."""
    import weakref

    import lumo.weights as W
    from lumo.engine.gpu_weights import pack_weights

    d = make_tiny_checkpoint(tmp_path / "ckpt", num_hidden_layers=8)
    q, _ = quantize_tensors(load_file(d / "model.safetensors"), default_algo("NVFP4"))
    resave(d, q)
    alive: dict[int, int] = {}  # layer -> its NVFP4 code tensors alive (kept as read: no copy on the CPU)
    peak = [0]
    real = W._Checkpoint.read

    def read(self, name: str) -> torch.Tensor:
        t = real(self, name)
        if (m := re.match(r"model\.layers\.(\d+)\..*_proj\.weight$", name)) and t.dtype == torch.uint8:
            i = int(m[1])
            alive[i] = alive.get(i, 0) + 1
            peak[0] = max(peak[0], sum(1 for n in alive.values() if n))
            weakref.finalize(t, lambda: alive.__setitem__(i, alive[i] - 1))
        return t

    monkeypatch.setattr(W._Checkpoint, "read", read)
    cfg, w = load_model(d, progress=False, lazy=True)
    assert peak[0] == 0
    packed = pack_weights(cfg, w, "cpu", mtp=True)
    assert 1 <= peak[0] <= 2 and sorted(alive) == list(range(8)) and not any(alive.values())
    _, eager = load_model(d, progress=False)
    assert peak[0] == 8
    assert_same(
        packed.layers[7].down.parts[0].packed, pack_weights(cfg, eager, "cpu").layers[7].down.parts[0].packed
    )


def test_malformed_checkpoint_json_is_a_weight_error_naming_the_file(tmp_path):
    """Each JSON file a checkpoint reads, malformed in the ways a hand edit or a broken export leaves it,
    is a WeightError naming the file and what is wrong (session 47, a helper's black-box run: tracebacks
    from `.get` on a list, fnmatch on an int, sorted() over mixed types, a bare UnicodeDecodeError)."""
    d = tiny(tmp_path)
    cfg = (d / "config.json").read_bytes()
    (d / "config.json").write_bytes(cfg.replace(b'"hidden_size"', b'"hidden\xff_size"'))
    with pytest.raises(WeightError, match=r"config\.json is not valid JSON \('utf-8' codec"):
        load_model(d, progress=False)
    (d / "config.json").write_bytes(cfg)
    good = {"quant_algo": "NVFP4", "group_size": 16}
    for q, words in (
        ([1], "must hold a JSON object, got list"),
        ({"quantization": [1]}, "quantization must be an object"),
        ({"quantization": "NVFP4"}, "quantization must be an object"),
        ({"quantization": {**good, "exclude_modules": [1, 2]}}, "excluded modules must be a list of names"),
        ({"quantization": {**good, "group_size": "16"}}, "group_size '16'"),
        ({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": ["a"]}}, "quantized_layers"),
        ({"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": {"a": "NVFP4"}}}, "objects"),
    ):
        (d / "hf_quant_config.json").write_text(json.dumps(q))
        with pytest.raises(WeightError, match=re.escape(words)):
            load_model(d, progress=False)
    (d / "hf_quant_config.json").unlink()
    raw = load_file(d / "model.safetensors")
    resave(d, raw, shards=2)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    for bad in ({**index["weight_map"], "model.norm.weight": 5}, list(index["weight_map"])):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": bad}))
        with pytest.raises(WeightError, match="not a valid safetensors index"):
            load_model(d, progress=False)


def test_the_wrappers_own_tie_rules_as_in_transformers(tmp_path):
    """A wrapper config ties its embeddings by its own key (transformers reads no other; default false). A
    text_config saying true with the wrapper's key absent ties only where no lm_head is stored: a stored
    one is read, as transformers reads it (session 47: lumo tied, its logits parting from transformers')."""
    d = tiny(tmp_path, dtype="float32")
    raw = load_file(d / "model.safetensors")
    resave(d, raw, wrapper=True)
    cfg = json.loads((d / "config.json").read_text())
    assert "text_config" in cfg
    cfg.pop("tie_word_embeddings", None)
    cfg["text_config"]["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    c, w = load_model(d, progress=False)
    assert not c.tie_word_embeddings and torch.equal(w.lm_head.weight, raw["lm_head.weight"])
    resave(d, {n: t for n, t in raw.items() if n != "lm_head.weight"}, wrapper=True)
    (d / "config.json").write_text(json.dumps(cfg))  # (resave rewrote it)
    c, w = load_model(d, progress=False)
    assert c.tie_word_embeddings and torch.equal(w.lm_head.weight, raw["model.embed_tokens.weight"])


def test_unreadable_files_are_named_as_such(tmp_path, monkeypatch):
    """A directory or a shard the user may not read is said to be so (safetensors called such a shard
    missing, and a directory not listed read as one without .safetensors files). os.access is patched:
    the tests may run as root, which reads everything."""
    import os

    d = tiny(tmp_path)
    real = os.access
    cases = ((d, "cannot read the directory"), (d / "model.safetensors", "cannot read .*: permission"))
    for denied, words in cases:
        monkeypatch.setattr(os, "access", lambda p, mode, denied=denied: Path(p) != denied and real(p, mode))
        with pytest.raises(WeightError, match=words):
            load_model(d, progress=False)
    monkeypatch.setattr(os, "access", real)
    load_model(d, progress=False)
