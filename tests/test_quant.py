"""NVFP4 / FP8 quantiser vs a per-element reference, and `lumo quantize` round trips through the loader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lumo.quant import (
    format_error_report,
    fp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    quantize_checkpoint,
)
from lumo.testing import make_tiny_checkpoint
from lumo.weights import NVFP4Linear, WeightError, load_model

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
TRUNK_CLASSES = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"}
TRUNK_CLASSES |= {"gate_proj", "up_proj", "down_proj"}


def reference_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Element by element, in float32 (numpy scalars), straight from MODEL.md's description."""
    f32 = np.float32
    x = w.float().numpy()
    N, K = x.shape
    amax = max(abs(f32(v)) for v in x.flat)
    s2 = f32(amax) / f32(6.0 * 448.0)
    scales = torch.zeros(N, K // 16, dtype=torch.float8_e4m3fn)
    packed = torch.zeros(N, K // 2, dtype=torch.uint8)
    for o in range(N):
        for b in range(K // 16):
            block = x[o, 16 * b : 16 * b + 16]
            s = f32(max(abs(f32(v)) for v in block)) / (f32(6.0) * s2)
            s = f32(1.0) if s == 0 else f32(min(max(s, 2.0**-9), 448.0))
            scales[o, b] = torch.tensor(float(s)).to(torch.float8_e4m3fn)
            div = f32(scales[o, b].float().item()) * s2
            for j, v in enumerate(block):
                y = f32(v) / div
                # nearest E2M1 magnitude, ties to the even code (mantissa bit 0)
                code = min(range(8), key=lambda i: (abs(abs(float(y)) - MAGNITUDES[i]), i % 2))
                code |= 8 if y < 0 else 0
                k = 16 * b + j
                packed[o, k // 2] |= code << (4 * (k % 2))  # even column in the low nibble
    return packed, scales, torch.tensor(float(s2))


@pytest.mark.parametrize("N,K", [(1, 16), (3, 48), (5, 80), (7, 144)])
def test_nvfp4_quantize_matches_reference(N, K):
    g = torch.Generator().manual_seed(N * 1000 + K)
    w = (torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3).to(torch.bfloat16)
    if K > 16:
        w[0, :16] = 0  # an all-zero block gets scale 1.0
    if N > 1 and K > 32:
        w[1, 16:32] *= 1e-6  # a block scale below e4m3's smallest subnormal is clamped to 2^-9
    got = nvfp4_quantize(w)
    ref = reference_nvfp4(w)
    for a, b, name in zip(got, ref, ("packed", "scale", "scale_2"), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        bits = lambda t: t if t.dtype == torch.float32 else t.view(torch.uint8)
        assert torch.equal(bits(a), bits(b)), name


def test_nvfp4_ties_round_to_even():
    # global amax 2688 makes scale_2 exactly 1; a block amax of 12 makes its scale exactly 2, so the block
    # divided by its scale lands on every rounding tie of E2M1
    w = torch.zeros(2, 32)
    w[0, :16] = torch.tensor([12, 1.5, 3.5, 7, 0.5, 2.5, 5, 10, -1.5, -3.5, -7, -0.5, -2.5, -5, -10, 0])
    w[1, 0] = 2688.0
    w[1, 1:] = torch.randn(31)
    packed, scale, scale_2 = nvfp4_quantize(w)
    assert float(scale_2) == 1.0 and float(scale[0, 0]) == 2.0 and float(scale[0, 1]) == 1.0
    deq = nvfp4_dequantize(packed, scale, scale_2)
    assert deq[0, :16].tolist() == [12, 2, 4, 8, 0, 2, 4, 8, -2, -4, -8, 0, -2, -4, -8, 0]
    assert torch.equal(packed, reference_nvfp4(w)[0])


def test_quantizer_errors_and_accuracy():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_quantize(torch.randn(4, 40))
    with pytest.raises(ValueError, match="2-D"):
        nvfp4_quantize(torch.randn(64))
    w = torch.randn(96, 160)
    rel = (nvfp4_dequantize(*nvfp4_quantize(w)) - w).norm() / w.norm()
    assert 0.05 < rel < 0.12  # NVFP4 on Gaussian weights: ~0.095
    q, s = fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == ()
    assert (q.float() * s - w).norm() / w.norm() < 0.04
    assert torch.equal(nvfp4_dequantize(*nvfp4_quantize(torch.zeros(2, 16))), torch.zeros(2, 16))


# ---------------------------------------------------------------------------------------------
# lumo quantize


def source_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tiny BF16 checkpoint in the Qwen3.5 wrapper layout, 2 shards with an index, a vision tensor."""
    d = make_tiny_checkpoint(tmp_path / "src", num_hidden_layers=4)
    flat = load_file(d / "model.safetensors")
    tensors = {("model.language_model." + n[6:] if n.startswith("model.") else n): t for n, t in flat.items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 32).to(torch.bfloat16)
    cfg = json.loads((d / "config.json").read_text())
    wrapper = {"model_type": "qwen3_5", "text_config": {**cfg, "model_type": "qwen3_5_text"}}
    (d / "config.json").write_text(json.dumps(wrapper))
    (d / "model.safetensors").unlink()
    (d / "chat_template.jinja").write_text("{{ messages }}")
    names, weight_map = list(tensors), {}
    for s in range(2):
        fname = f"model-0000{s + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in names[s::2]}, str(d / fname))
        weight_map.update(dict.fromkeys(names[s::2], fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d, tensors


def dst_tensors(dst: Path) -> dict[str, tuple[str, list[int], torch.Tensor]]:
    out = {}
    for f in dst.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            for n in h.keys():  # noqa: SIM118
                sl = h.get_slice(n)
                out[n] = (sl.get_dtype(), sl.get_shape(), h.get_tensor(n))
    return out


def test_quantize_round_trip(tmp_path):
    src, tensors = source_checkpoint(tmp_path)
    dst = tmp_path / "dst"
    report = quantize_checkpoint(src, dst, progress=False)

    # config files: hf_quant_config.json and its mirror in config.json
    hq = json.loads((dst / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "modelopt"
    q = hq["quantization"]
    assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16 and q["kv_cache_quant_algo"] is None
    assert {"lm_head", "*.in_proj_a", "*.in_proj_b", "mtp*"} <= set(q["exclude_modules"])
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["ignore"] == q["exclude_modules"]
    assert qc["config_groups"]["group_0"]["weights"] == {"dynamic": False, "num_bits": 4, "type": "float",
                                                         "group_size": 16}  # fmt: skip
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (dst / f).read_bytes() == (src / f).read_bytes(), f

    # tensors: ModelOpt names, dtypes and shapes; everything excluded stays bitwise BF16
    out = dst_tensors(dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(out) and set(index.values()) == {p.name for p in dst.glob("*.safetensors")}
    quantised = set()
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if out[name][0] == "U8":
            quantised.add(module)
            N, K = t.shape
            assert out[name][1] == [N, K // 2]
            assert out[f"{module}.weight_scale"][:2] == ("F8_E4M3", [N, K // 16])
            assert out[f"{module}.weight_scale_2"][:2] == ("F32", [])
            assert (
                out[f"{module}.input_scale"][:2] == ("F32", [])
                and float(out[f"{module}.input_scale"][2]) == 1
            )
        else:
            assert out[name][0] == "BF16" and torch.equal(out[name][2], t), name
    kept = [m for m in (n.removesuffix(".weight") for n in tensors) if m not in quantised]
    for pat in (
        "embed_tokens",
        "lm_head",
        "in_proj_a",
        "in_proj_b",
        "conv1d",
        "norm",
        "A_log",
        "mtp.",
        "visual",
    ):
        assert any(pat in m for m in kept) and not any(pat in m for m in quantised), pat
    assert {m.rsplit(".", 1)[-1] for m in quantised} == TRUNK_CLASSES

    # load + dequantise == dequantise(reference quantiser(original)), bitwise
    _, w = load_model(dst, progress=False)
    gdn, attn = w.layers[0].mixer, w.layers[3].mixer
    prefix = "model.language_model.layers"
    pairs = {
        f"{prefix}.0.linear_attn.in_proj_qkv": gdn.in_proj_qkv,
        f"{prefix}.0.linear_attn.out_proj": gdn.out_proj,
        f"{prefix}.3.self_attn.q_proj": attn.q_proj,
        f"{prefix}.3.mlp.down_proj": w.layers[3].mlp.down_proj,
    }
    for module, lin in pairs.items():
        assert isinstance(lin, NVFP4Linear) and lin.activations == "nvfp4"
        ref = nvfp4_dequantize(*nvfp4_quantize(tensors[f"{module}.weight"]))
        assert torch.equal(lin.dequantize(), ref), module
    assert not isinstance(gdn.in_proj_a, NVFP4Linear) and not isinstance(w.mtp.fc, NVFP4Linear)

    # the report: one entry per quantised class, equal to the error recomputed here
    assert set(report) == TRUNK_CLASSES and all(0.05 < v < 0.15 for v in report.values())
    num = den = 0.0
    for module in quantised:
        if module.endswith("q_proj"):
            t = tensors[f"{module}.weight"].double()
            num += float((nvfp4_dequantize(*nvfp4_quantize(t)).double() - t).square().sum())
            den += float(t.square().sum())
    assert math.isclose(report["q_proj"], math.sqrt(num / den), rel_tol=1e-9)
    text = format_error_report(report)
    assert "in_proj_qkv" in text and f"{report['gate_proj']:.4f}" in text


def test_quantize_w4a16_with_custom_exclude(tmp_path):
    src, tensors = source_checkpoint(tmp_path)
    dst = tmp_path / "dst"
    quantize_checkpoint(src, dst, fmt="w4a16_nvfp4", exclude=["*.mlp.*"], progress=False)
    hq = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "W4A16_NVFP4" and hq["exclude_modules"] == ["*.mlp.*"]
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    _, w = load_model(dst, progress=False)
    # the given patterns replace the defaults: lm_head, the GDN gates and the MTP head get quantised
    for lin in (w.lm_head, w.layers[0].mixer.in_proj_a, w.mtp.fc, w.layers[1].mixer.in_proj_z):
        assert isinstance(lin, NVFP4Linear) and lin.activations == "bf16"
    ref = nvfp4_dequantize(*nvfp4_quantize(tensors["lm_head.weight"]))
    assert torch.equal(w.lm_head.dequantize(), ref)
    assert not isinstance(w.layers[2].mlp.up_proj, NVFP4Linear)
    assert w.embed_tokens.dtype == torch.float32  # embeddings are never quantised


def test_quantize_errors(tmp_path):
    src, _ = source_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="unknown format"):
        quantize_checkpoint(src, tmp_path / "x", fmt="int4")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(WeightError, match="not an empty directory"):
        quantize_checkpoint(src, tmp_path / "busy", progress=False)
    quantize_checkpoint(src, tmp_path / "q", fmt="w4a16_nvfp4", progress=False)
    with pytest.raises(WeightError, match="already quantised"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "qq", progress=False)
    # a source that would not load is refused before anything is written (session 47: quantised all the
    # same, into a checkpoint that would not load either)

    norm = "model.language_model.norm.weight"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    f = src / index["weight_map"].pop(norm)
    save_file({n: t for n, t in load_file(f).items() if n != norm}, str(f))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match=r"language_model\.norm\.weight"):
        quantize_checkpoint(src, tmp_path / "broken", progress=False)
    assert not (tmp_path / "broken").exists()


def test_quantize_never_leaves_a_partial_destination(tmp_path, monkeypatch):
    """An error or an interrupt midway leaves neither the destination nor the staging directory behind."""
    import shutil

    import lumo.quant as quant

    src, tensors = source_checkpoint(tmp_path)
    leftovers = lambda: sorted(p.name for p in tmp_path.iterdir() if p.name != "src")  # noqa: E731

    # a truncated second shard: read after the first shard was written
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    shard = broken / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(WeightError, match="cannot read"):
        quantize_checkpoint(broken, tmp_path / "q1", progress=False)
    assert leftovers() == ["broken"]

    # a non-finite weight: the message names the tensor
    bad = tmp_path / "nan"
    shutil.copytree(src, bad)
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    f = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    shard = load_file(f)
    shard[name] = shard[name].clone()
    shard[name][0, 0] = float("nan")
    save_file(shard, str(f))
    with pytest.raises(WeightError, match=name.replace(".", "[.]")):
        quantize_checkpoint(bad, tmp_path / "q2", progress=False)
    assert leftovers() == ["broken", "nan"]

    # an interrupt while the last files are copied (after config.json was written)
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(quant.shutil, "copyfile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(src, tmp_path / "q3", progress=False)
    assert leftovers() == ["broken", "nan"]
    monkeypatch.undo()

    # an empty destination directory is replaced by the finished checkpoint; a dangling link is refused
    (tmp_path / "q4").mkdir()
    quantize_checkpoint(src, tmp_path / "q4", progress=False)
    assert (tmp_path / "q4" / "config.json").is_file()
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(WeightError, match="dangling symlink"):
        quantize_checkpoint(src, tmp_path / "link", progress=False)
