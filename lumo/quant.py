"""NVFP4 / FP8 (NVIDIA ModelOpt format) quantisation and dequantisation in plain torch, and `lumo quantize`.

The quantiser reproduces ModelOpt's `NVFP4QTensor.quantize` bit for bit (MODEL.md, "NVIDIA ModelOpt NVFP4
checkpoints"), so a checkpoint written here loads in any ModelOpt consumer and vice versa.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

BLOCK = 16  # NVFP4 scale block along the input dim
FP4_MAX = 6.0  # largest E2M1 magnitude
FP8_MAX = 448.0  # largest float8_e4m3fn magnitude
E2M1_LUT = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# Midpoints between consecutive E2M1 magnitudes (ModelOpt's `e2m1_bounds`).
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])

FORMATS = {"nvfp4": "NVFP4", "w4a16_nvfp4": "W4A16_NVFP4"}  # `--format` -> ModelOpt quant_algo
# Module-name fnmatch patterns kept in BF16 by default. Embeddings and the vision tower are never quantised
# whatever the patterns say, and only 2-D `.weight` tensors are candidates at all (norms, conv1d, A_log and
# dt_bias are listed anyway so that consumers reading exclude_modules see them as unquantised).
DEFAULT_EXCLUDE = (
    "lm_head",
    "*embed_tokens",
    "*.in_proj_a",  # GDN decay gate: [nv, H], tiny and sensitive
    "*.in_proj_b",  # GDN beta gate
    "*norm",
    "*conv1d",
    "*A_log",
    "*dt_bias",
    "mtp*",  # the draft head stays BF16 like in NVIDIA's exports
    "model.visual*",
)
# Files copied verbatim from the source checkpoint (tokenizer, chat template, generation config, ...).
_COPY_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".md")
_NOT_COPIED = ("config.json", "hf_quant_config.json", "model.safetensors.index.json")


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] float32 E2M1 values (even column in the low nibble)."""
    lut = E2M1_LUT.to(packed.device)
    lo = lut[(packed & 0x0F).long()]
    hi = lut[(packed >> 4).long()]
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def nvfp4_dequantize(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> torch.Tensor:
    """W[o, 16b + j] = e2m1(code) * float(weight_scale[o, b]) * weight_scale_2, in float32."""
    values = unpack_e2m1(weight)
    scales = weight_scale.float().repeat_interleave(BLOCK, dim=1)
    return values * scales * weight_scale_2.float()


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 values already divided by their scales -> 4-bit codes (uint8, sign in bit 3).

    Round to nearest, ties to even: searchsorted sends a tie to the lower magnitude, which is the even
    code at 0.25, 1.25, 2.5 and 5; at 0.75, 1.75 and 3.5 the even code is the upper one (ModelOpt's
    `equals_odd_bounds` correction). Magnitudes above 6 saturate to 6.
    """
    a = x.abs().contiguous()
    code = torch.searchsorted(E2M1_BOUNDS.to(x.device), a)
    code += (a == 0.75) | (a == 1.75) | (a == 3.5)
    return (code + 8 * (x < 0)).to(torch.uint8)


def nvfp4_quantize(
    w: torch.Tensor, scale_2: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed [N, K/2] uint8, weight_scale [N, K/16] float8_e4m3fn, weight_scale_2 [] f32).

    ModelOpt's rule: weight_scale_2 = amax(W) / (6 * 448); block scale = amax(block) / (6 * weight_scale_2)
    (all-zero blocks 1.0), clamped to e4m3's [2^-9, 448] and cast; codes = e2m1(W / (scale * scale_2)).
    An all-zero W (ModelOpt would divide by zero) gets weight_scale_2 = 1 / (6 * 448) and zero codes.
    `scale_2` (f32 []): the whole weight's, given when W is a block of its rows (everything else is
    row-local, so quantising a weight block by block gives the bits of quantising it whole).
    """
    if w.ndim != 2:
        raise ValueError(f"NVFP4 quantises 2-D weights, got shape {list(w.shape)}")
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(
            f"NVFP4 needs the input dim to be a multiple of {BLOCK}, got weight shape [{N}, {K}]"
        )
    x = w.float()
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantise a weight with inf/nan values")
    if scale_2 is None:
        scale_2 = nvfp4_global_scale(x)
    blocks = x.reshape(N, K // BLOCK, BLOCK)  # [N, K/16, 16] f32
    scale = blocks.abs().amax(dim=-1) / (FP4_MAX * scale_2)  # [N, K/16] f32, same op order as ModelOpt
    scale[scale == 0] = 1.0
    scale_fp8 = scale.clamp(min=2.0**-9, max=FP8_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (scale_fp8.float() * scale_2).unsqueeze(-1)  # [N, K/16, 16] f32
    codes = e2m1_encode(scaled).reshape(N, K)
    packed = (codes[:, 1::2] << 4) | codes[:, 0::2]  # even column in the low nibble
    return packed.contiguous(), scale_fp8, scale_2.float().reshape(())


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's weight_scale_2 of a weight: amax(W) / (6 * 448) in f32 [] (1 / (6 * 448) for all zeros)."""
    amax = w.abs().amax().float()
    if amax > 0:
        return amax / (FP4_MAX * FP8_MAX)
    return torch.tensor(1.0 / (FP4_MAX * FP8_MAX), device=w.device)


def fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (weight [N, K] float8_e4m3fn, weight_scale [] f32): per-tensor, scale = amax / 448."""
    x = w.float()
    amax = x.abs().amax()
    scale = amax / FP8_MAX if amax > 0 else torch.tensor(1.0, device=x.device)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.float().reshape(())


# ---------------------------------------------------------------------------------------------
# `lumo quantize SRC DST`: a BF16/F16/F32 checkpoint -> a ModelOpt NVFP4 checkpoint.


def tensor_class(module: str) -> str:
    """'model.layers.3.self_attn.q_proj' -> 'q_proj': the key of the error report."""
    return module.rsplit(".", 1)[-1]


def _quantizable(name: str, shape: list[int], dtype: str, exclude: list[str]) -> bool:
    if not name.endswith(".weight") or len(shape) != 2 or dtype not in ("BF16", "F16", "F32"):
        return False
    module = name[: -len(".weight")]
    if "embed_tokens" in module or module.startswith("model.visual."):
        return False  # lumo gathers embedding rows; the vision tower is not lumo's to change
    if shape[1] % BLOCK:
        return False
    return not any(fnmatch.fnmatchcase(module, p) for p in exclude)


def hf_quant_config(quant_algo: str, exclude: list[str]) -> dict:
    """hf_quant_config.json as ModelOpt writes it."""
    from . import __version__

    return {
        # "modelopt" is the format name consumers key on; the version says who actually wrote it.
        "producer": {"name": "modelopt", "version": f"lumo-{__version__}"},
        "quantization": {
            "quant_algo": quant_algo,
            "kv_cache_quant_algo": None,
            "group_size": BLOCK,
            "exclude_modules": list(exclude),
        },
    }


def quantization_config(hf_quant: dict) -> dict:
    """The `quantization_config` mirror in config.json (ModelOpt's convert_hf_quant_config_format)."""
    q = hf_quant["quantization"]
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
    acts = dict(weights) if q["quant_algo"] == "NVFP4" else None  # W4A16: weight-only
    return {
        "config_groups": {"group_0": {"input_activations": acts, "weights": weights, "targets": ["Linear"]}},
        "ignore": list(q["exclude_modules"]),
        "quant_algo": q["quant_algo"],
        "group_size": q["group_size"],
        "kv_cache_scheme": None,
        "producer": hf_quant["producer"],
        "quant_method": "modelopt",
    }


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    fmt: str = "nvfp4",
    exclude: list[str] | None = None,
    progress: bool = True,
    device: str | None = None,
) -> dict[str, float]:
    """Write a ModelOpt-format NVFP4 copy of `src` (local dir or hub id) into `dst`.

    Tensor names, shard layout and non-quantised tensors are kept; each quantised linear becomes `weight`
    U8 [N, K/2], `weight_scale` F8_E4M3 [N, K/16], `weight_scale_2` F32 [], `input_scale` F32 [].
    There is no calibration data, so `input_scale` is the amax-free placeholder 1.0: harmless for
    w4a16_nvfp4 (weight-only, consumers ignore it), but W4A4 ("nvfp4") consumers that quantise activations
    need a calibrated scale (ModelOpt calibration); lumo runs NVFP4 linears with BF16 activations unless
    told otherwise. `exclude` (fnmatch on module names) replaces DEFAULT_EXCLUDE when given.
    Returns the relative Frobenius error of the dequantised weights per tensor class (q_proj, ...).
    """
    from safetensors import SafetensorError

    from .weights import WeightError, load_model, read_json_object, resolve_model_path

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    quant_algo = FORMATS[fmt]
    patterns = list(DEFAULT_EXCLUDE if exclude is None else exclude)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    src_dir = resolve_model_path(str(src))
    dst_dir = Path(dst).expanduser()
    if dst_dir.is_symlink():
        if not dst_dir.exists():
            raise WeightError(f"destination {dst_dir} is a dangling symlink")
        dst_dir = dst_dir.resolve()
    if dst_dir.resolve() == src_dir.resolve():
        raise WeightError("the destination must differ from the source checkpoint")
    if dst_dir.exists() and (not dst_dir.is_dir() or any(dst_dir.iterdir())):
        raise WeightError(f"destination {dst_dir} exists and is not an empty directory")
    cfg_path = src_dir / "config.json"
    if not cfg_path.is_file():
        raise WeightError(f"no config.json in {src_dir}")
    config = read_json_object(cfg_path)
    if config.get("quantization_config") or (src_dir / "hf_quant_config.json").is_file():
        raise WeightError(f"{src_dir} is already quantised; `lumo quantize` needs a BF16/F16/F32 checkpoint")
    # every check loading runs (config, tensor names, dtypes, shapes), no tensor read: a source that would
    # not load is refused here, not written out as a quantised checkpoint that would not load either
    load_model(src_dir, progress=False, meta=True)

    # Everything is written to a staging directory beside the destination and renamed into place at the
    # end, so an error or an interrupt never leaves a partial checkpoint under the destination's name.
    dst_dir = dst_dir.absolute()
    dst_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = dst_dir.parent / f".{dst_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        errors = _quantize_into(src_dir, stage, config, quant_algo, patterns, dev, progress)
        if dst_dir.exists():
            dst_dir.rmdir()  # empty, checked above
        os.replace(stage, dst_dir)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, SafetensorError):
            raise WeightError(f"cannot read the safetensors files in {src_dir}: {e}") from None
        raise
    if fmt == "nvfp4":
        print(
            "lumo quantize: note: input_scale = 1.0 is an uncalibrated placeholder; W4A4 consumers need "
            "ModelOpt calibration (use --format w4a16_nvfp4 for a weight-only checkpoint)",
            file=sys.stderr,
        )
    return errors


def _quantize_into(
    src_dir: Path,
    out_dir: Path,
    config: dict,
    quant_algo: str,
    patterns: list[str],
    dev: torch.device,
    progress: bool,
) -> dict[str, float]:
    """quantize_checkpoint's work: every shard of src_dir quantised into out_dir, then the index, the
    quantisation config, config.json and the tokenizer / generation files."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .weights import WeightError, checkpoint_files

    weight_map, files = checkpoint_files(src_dir)
    err2: dict[str, float] = {}  # class -> sum of squared errors
    ref2: dict[str, float] = {}  # class -> sum of squared weights
    new_map: dict[str, str] = {}
    total_size = 0
    one = torch.ones((), dtype=torch.float32)
    bar = tqdm(total=len(weight_map), desc="quantize", unit="tensor", file=sys.stderr,
               disable=not progress or not sys.stderr.isatty())  # fmt: skip
    with bar:
        for fname in files:
            out: dict[str, torch.Tensor] = {}
            with safe_open(src_dir / fname, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    bar.update(1)
                    sl = f.get_slice(name)
                    dtype, shape = sl.get_dtype(), sl.get_shape()
                    if dtype.startswith(("F8", "U8", "I8", "F4")):
                        raise WeightError(f"tensor {name} is {dtype}: the source is already quantised")
                    t = f.get_tensor(name)
                    if not _quantizable(name, shape, dtype, patterns):
                        out[name] = t
                        continue
                    module = name[: -len(".weight")]
                    try:
                        packed, scale, scale_2 = nvfp4_quantize(t.to(dev))
                    except ValueError as e:
                        raise WeightError(f"tensor {name}: {e}") from None
                    ref = t.to(dev).double()
                    err = nvfp4_dequantize(packed, scale, scale_2).double() - ref
                    cls = tensor_class(module)
                    err2[cls] = err2.get(cls, 0.0) + float(err.square().sum())
                    ref2[cls] = ref2.get(cls, 0.0) + float(ref.square().sum())
                    out[name] = packed.cpu()
                    out[f"{module}.weight_scale"] = scale.cpu()
                    out[f"{module}.weight_scale_2"] = scale_2.cpu()
                    out[f"{module}.input_scale"] = one.clone()
            for name, t in out.items():
                new_map[name] = fname
                total_size += t.numel() * t.element_size()
            save_file(out, str(out_dir / fname), metadata={"format": "pt"})

    if (src_dir / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(new_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    hq = hf_quant_config(quant_algo, patterns)
    (out_dir / "hf_quant_config.json").write_text(json.dumps(hq, indent=4) + "\n")
    config = {**config, "quantization_config": quantization_config(hq)}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    for p in sorted(src_dir.iterdir()):
        if p.is_file() and p.suffix in _COPY_SUFFIXES and p.name not in _NOT_COPIED:
            shutil.copyfile(p, out_dir / p.name)
    return {c: math.sqrt(err2[c] / ref2[c]) if ref2[c] > 0 else 0.0 for c in sorted(err2)}


def format_error_report(d: dict[str, float]) -> str:
    """The per-class relative error table printed by `lumo quantize`."""
    if not d:
        return "no tensors were quantised"
    w = max(12, *(len(k) for k in d))
    lines = [f"{'tensor class':<{w}}  relative error"]
    lines += [f"{k:<{w}}  {v:.4f}" for k, v in sorted(d.items())]
    return "\n".join(lines)
