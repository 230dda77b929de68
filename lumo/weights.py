"""Model weights as plain dataclasses, building them from checkpoint tensors, and loading checkpoints.

Every linear is one of three leaves (DenseLinear, NVFP4Linear, FP8Linear) with `.dequantize()`;
the reference model multiplies by the dequantised matrix, the GPU kernels read the packed form.
`load_model` reads a local directory or hub id (safetensors, single or sharded) and decides each linear's
format from its stored dtypes and scales, cross-checked with hf_quant_config.json / quantization_config.
NVFP4 comes in two checkpoint conventions, NVIDIA ModelOpt's and compressed-tensors' (llm-compressor, vLLM);
both load into the same NVFP4Linear, in ModelOpt's convention.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .config import FULL, ModelConfig, apply_overrides


class WeightError(ValueError):
    """A checkpoint lumo cannot load; the message names the tensor and is meant for the user."""


@dataclass
class DenseLinear:
    weight: torch.Tensor  # [N, K] bf16 / f16 / f32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)


@dataclass
class NVFP4Linear:
    """NVFP4 in ModelOpt's convention: two E2M1 codes per byte (even column in the low nibble), one e4m3
    scale per 16, W = e2m1 * weight_scale * weight_scale_2 (compressed-tensors' checkpoints are converted)."""

    weight: torch.Tensor  # [N, K/2] uint8
    weight_scale: torch.Tensor  # [N, K/16] float8_e4m3fn
    weight_scale_2: torch.Tensor  # [] f32, global scale
    input_scale: torch.Tensor | None = None  # [] f32, activation global scale (W4A4 only)
    activations: str = "bf16"  # "bf16" (W4A16_NVFP4) or "nvfp4" (W4A4; GPUs without FP4 MMA use bf16)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight.shape[0], self.weight.shape[1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from .quant import nvfp4_dequantize

        return nvfp4_dequantize(self.weight, self.weight_scale, self.weight_scale_2).to(dtype)


@dataclass
class FP8Linear:
    """FP8 (e4m3) weights with a per-tensor scale (ModelOpt: W = float(weight) * weight_scale) or one scale
    per block of bn x bk weights (`block`; the "fp8" quant_method of Qwen's and DeepSeek's FP8 checkpoints,
    which store the scales as `weight_scale_inv`: W[i, j] = float(weight[i, j]) * scale[i // bn, j // bk])."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor  # [] f32, or [ceil(N / bn), ceil(K / bk)] f32 with `block`
    input_scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None  # (bn, bk)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.weight_scale.float()
        if self.block is not None:
            (n, k), (bn, bk) = self.weight.shape, self.block
            scale = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return (self.weight.float() * scale).to(dtype)


Linear = DenseLinear | NVFP4Linear | FP8Linear


def linear_rows(lin: Linear, rows: torch.Tensor) -> Linear:
    """The linear restricted to output rows `rows` (int64 indices), same format and scales: row i of the
    result is row rows[i] of lin (NVFP4 keeps each row's block scales and the global scale; FP8 its
    per-tensor scale). A draft vocabulary's lm_head (lumo.engine.draft_vocab)."""
    if isinstance(lin, NVFP4Linear):
        return replace(lin, weight=lin.weight[rows], weight_scale=lin.weight_scale[rows])
    if isinstance(lin, FP8Linear) and lin.block is not None:  # each row keeps its block's scales
        bn, bk = lin.block
        rows = rows.to(lin.weight_scale.device)
        return replace(lin, weight=lin.weight[rows], weight_scale=lin.weight_scale[rows // bn], block=(1, bk))
    return replace(lin, weight=lin.weight[rows])


@dataclass
class MLPWeights:
    gate_proj: Linear  # [I, H]
    up_proj: Linear  # [I, H]
    down_proj: Linear  # [H, I]


@dataclass
class GDNWeights:
    in_proj_qkv: Linear  # [C, H], C = 2*nk*dk + nv*dv, blocks [q | k | v]
    in_proj_z: Linear  # [nv*dv, H]
    in_proj_b: Linear  # [nv, H]
    in_proj_a: Linear  # [nv, H]
    conv1d: torch.Tensor  # [C, K] (checkpoint stores [C, 1, K])
    dt_bias: torch.Tensor  # [nv]
    A_log: torch.Tensor  # [nv]
    norm: torch.Tensor  # [dv], plain-weight (not 1+w) gated rmsnorm
    out_proj: Linear  # [H, nv*dv]


@dataclass
class AttnWeights:
    q_proj: Linear  # [nh*2d, H]: per head [query d | gate d]
    k_proj: Linear  # [nkv*d, H]
    v_proj: Linear  # [nkv*d, H]
    o_proj: Linear  # [H, nh*d]
    q_norm: torch.Tensor  # [d], 1+w
    k_norm: torch.Tensor  # [d], 1+w


@dataclass
class LayerWeights:
    input_layernorm: torch.Tensor  # [H], 1+w
    post_attention_layernorm: torch.Tensor  # [H], 1+w
    mixer: GDNWeights | AttnWeights
    mlp: MLPWeights


@dataclass
class MTPWeights:
    fc: Linear  # [H, 2H], input = cat(norm(embed(x_{p+1})), norm(h_p))
    pre_fc_norm_embedding: torch.Tensor  # [H], 1+w
    pre_fc_norm_hidden: torch.Tensor  # [H], 1+w
    layers: list[LayerWeights]  # full-attention decoder layers with their own KV cache
    norm: torch.Tensor  # [H], 1+w


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor  # [V, H]
    layers: Sequence[LayerWeights]  # a list, or LazyLayers (load_model(lazy=True))
    norm: torch.Tensor  # [H], 1+w
    lm_head: Linear  # [V, H]
    mtp: MTPWeights | None = None


# ---------------------------------------------------------------------------------------------
# Building weights from named tensors. `get(name)` returns the tensor or None when absent.

TensorGetter = Callable[[str], "torch.Tensor | None"]
LinearBuilder = Callable[[str, tuple[int, int]], Linear]


def dense_linear_builder(get: TensorGetter) -> LinearBuilder:
    """Linear builder for unquantised checkpoints (every `<prefix>.weight` dense)."""

    def build(prefix: str, shape: tuple[int, int]) -> Linear:
        return DenseLinear(require(get, f"{prefix}.weight", shape))

    return build


def require(get: TensorGetter, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = get(name)
    if t is None:
        raise WeightError(f"missing tensor {name}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise WeightError(f"tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def build_layer(
    cfg: ModelConfig, get: TensorGetter, linear: LinearBuilder, p: str, kind: str
) -> LayerWeights:
    """The decoder layer named `p` ("model.layers.3", "mtp.layers.0") of type `kind` (cfg.layer_types)."""
    H = cfg.hidden_size

    def vec(name: str, n: int) -> torch.Tensor:
        return require(get, name, (n,))

    def mlp(p: str) -> MLPWeights:
        I = cfg.intermediate_size  # noqa: E741
        return MLPWeights(
            linear(f"{p}.gate_proj", (I, H)), linear(f"{p}.up_proj", (I, H)), linear(f"{p}.down_proj", (H, I))
        )

    def attn(p: str) -> AttnWeights:
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        return AttnWeights(
            q_proj=linear(f"{p}.q_proj", (nh * 2 * d, H)),
            k_proj=linear(f"{p}.k_proj", (nkv * d, H)),
            v_proj=linear(f"{p}.v_proj", (nkv * d, H)),
            o_proj=linear(f"{p}.o_proj", (H, nh * d)),
            q_norm=vec(f"{p}.q_norm.weight", d),
            k_norm=vec(f"{p}.k_norm.weight", d),
        )

    def gdn(p: str) -> GDNWeights:
        nv, dv, C, K = (
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.conv_dim,
            cfg.linear_conv_kernel_dim,
        )
        return GDNWeights(
            in_proj_qkv=linear(f"{p}.in_proj_qkv", (C, H)),
            in_proj_z=linear(f"{p}.in_proj_z", (nv * dv, H)),
            in_proj_b=linear(f"{p}.in_proj_b", (nv, H)),
            in_proj_a=linear(f"{p}.in_proj_a", (nv, H)),
            conv1d=require(get, f"{p}.conv1d.weight", (C, 1, K)).reshape(C, K),
            dt_bias=vec(f"{p}.dt_bias", nv),
            A_log=vec(f"{p}.A_log", nv),
            norm=vec(f"{p}.norm.weight", dv),
            out_proj=linear(f"{p}.out_proj", (H, nv * dv)),
        )

    mixer = attn(f"{p}.self_attn") if kind == FULL else gdn(f"{p}.linear_attn")
    return LayerWeights(
        input_layernorm=vec(f"{p}.input_layernorm.weight", H),
        post_attention_layernorm=vec(f"{p}.post_attention_layernorm.weight", H),
        mixer=mixer,
        mlp=mlp(f"{p}.mlp"),
    )


def build_weights(
    cfg: ModelConfig,
    get: TensorGetter,
    linear: LinearBuilder,
    prefix: str = "model.",
    layers: Sequence[LayerWeights] | None = None,
) -> ModelWeights:
    """Assemble ModelWeights; `prefix` is "model." (flat) or "model.language_model." (wrapper). `layers`:
    the decoder layers when the caller provides them (a LazyLayers), else they are built here."""
    H, V = cfg.hidden_size, cfg.vocab_size
    if layers is None:
        layers = [
            build_layer(cfg, get, linear, f"{prefix}layers.{i}", k) for i, k in enumerate(cfg.layer_types)
        ]
    embed = require(get, f"{prefix}embed_tokens.weight", (V, H))
    lm_head = DenseLinear(embed) if cfg.tie_word_embeddings else linear("lm_head", (V, H))
    mtp = None
    # MTP present iff the config asks for it and the checkpoint has it (HF re-saves drop `mtp.*`). Probe a
    # small always-dense tensor: probing `mtp.fc.weight` would read a large, possibly packed tensor.
    if cfg.mtp_num_hidden_layers > 0 and get("mtp.norm.weight") is not None:
        mtp = MTPWeights(
            fc=linear("mtp.fc", (H, 2 * H)),
            pre_fc_norm_embedding=require(get, "mtp.pre_fc_norm_embedding.weight", (H,)),
            pre_fc_norm_hidden=require(get, "mtp.pre_fc_norm_hidden.weight", (H,)),
            layers=[
                build_layer(cfg, get, linear, f"mtp.layers.{i}", FULL)
                for i in range(max(cfg.mtp_num_hidden_layers, 1))
            ],
            norm=require(get, "mtp.norm.weight", (H,)),
        )
    return ModelWeights(
        embed_tokens=embed,
        layers=layers,
        norm=require(get, f"{prefix}norm.weight", (H,)),
        lm_head=lm_head,
        mtp=mtp,
    )


class LazyLayers(Sequence[LayerWeights]):
    """A checkpoint's decoder layers, read when asked for (`load_model(lazy=True)`). Each access reads the
    layer's tensors again and nothing here keeps them, so one pass over the layers (packing them for the
    kernels, one reference forward) holds one layer at a time: on a GB10, whose GPU shares the CPU's 128 GB,
    loading then needs the packed model plus one layer, not the whole checkpoint twice. `formats`: the same
    layers built on the meta device (every linear's type and shape, no data), for decisions made before the
    pass (lumo.engine.gpu_weights.draft_quant)."""

    def __init__(
        self,
        read: Callable[[int], LayerWeights],
        formats: list[LayerWeights],
        progress: bool,
        shards: ExitStack,
    ):
        self._read, self.formats, self._progress = read, formats, progress
        # the shards `read` reads from: their safe_open handles (memory maps) are released when this
        # object and `read` are collected (the stack itself is never closed)
        self._shards = shards

    def __len__(self) -> int:
        return len(self.formats)

    def __getitem__(self, i: int) -> LayerWeights:  # type: ignore[override]
        if not isinstance(i, int):
            raise TypeError("LazyLayers takes one layer index")
        if not -len(self) <= i < len(self):
            raise IndexError(f"layer {i} of {len(self)}")
        return self._read(i % len(self))

    def __iter__(self) -> Iterator[LayerWeights]:
        from tqdm import tqdm

        tty = self._progress and sys.stderr.isatty()
        with tqdm(
            total=len(self), desc="loading layers", unit="layer", file=sys.stderr, disable=not tty
        ) as bar:
            for i in range(len(self)):
                yield self._read(i)
                bar.update(1)


def layer_formats(w: ModelWeights) -> Sequence[LayerWeights]:
    """w's decoder layers without reading a lazy model's tensors (LazyLayers.formats: meta tensors)."""
    return w.layers.formats if isinstance(w.layers, LazyLayers) else w.layers


# ---------------------------------------------------------------------------------------------
# Loading a checkpoint: a local directory or a Hugging Face hub id -> (ModelConfig, ModelWeights).

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "merges.txt", "vocab.txt"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_DENSE = {"BF16", "F16", "F32", "F64"}  # safetensors dtype names of unquantised tensors
QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4", "FP8")  # per-module algorithms lumo loads


def _hub_offline() -> bool:
    from huggingface_hub import constants

    # constants are read at import; honour a variable set later (tests, notebooks) as well
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or env


def resolve_model_path(model: str | Path) -> Path:
    """A local checkpoint directory, or a hub id fetched (json, safetensors, tokenizer, templates) or taken
    from the local cache; with HF_HUB_OFFLINE set only the cache is used."""
    if not str(model).strip():  # Path("") is the current directory
        raise WeightError("the model path is empty")
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise WeightError(f"{model} is a file; give the checkpoint directory")
    if not _HUB_ID.fullmatch(str(model)):
        raise WeightError(f"model directory {model} does not exist")
    from huggingface_hub import snapshot_download

    offline = _hub_offline()
    try:
        return Path(snapshot_download(str(model), allow_patterns=HUB_PATTERNS, local_files_only=offline))
    except (OSError, ValueError) as e:  # hub errors are OSErrors; invalid ids are ValueErrors
        if offline:
            raise WeightError(
                f"{model} is neither a local directory nor in the Hugging Face cache, and HF_HUB_OFFLINE is "
                "set: download it first (unset HF_HUB_OFFLINE) or give a local path"
            ) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WeightError(f"{model} is not a local directory and the hub download failed: {first}") from None


def read_json_object(path: Path, what: str = "") -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object: any other content is a WeightError naming the
    file (not valid UTF-8, not JSON, or JSON of another kind). what: the expected content, for messages."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise WeightError(f"{path} must hold a JSON object{what}, got {type(d).__name__}")
    return d


def checkpoint_files(root: Path) -> tuple[dict[str, str], list[str]]:
    """(tensor name -> shard file name, shard files) from model.safetensors.index.json or *.safetensors."""
    from safetensors import SafetensorError, safe_open

    if not os.access(root, os.R_OK | os.X_OK):
        raise WeightError(f"cannot read the directory {root}: permission denied")
    index = root / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index.is_file():
        weight_map = read_json_object(index, " (a safetensors index)").get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f and isinstance(n, str) for n, f in weight_map.items()
        ):
            raise WeightError(f"{index} is not a valid safetensors index (weight_map: tensor -> file name)")
        files = sorted(set(weight_map.values()))
        if missing := [f for f in files if not (root / f).is_file()]:
            raise WeightError(f"{index.name} names {missing[0]}, which is not in {root}")
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise WeightError(f"no .safetensors files in {root}")
    # (safetensors reports a file it may not open as missing: "No such file or directory")
    if unreadable := [f for f in files if not os.access(root / f, os.R_OK)]:
        raise WeightError(f"cannot read {root / unreadable[0]}: permission denied")
    if weight_map is None:
        weight_map = {}
        for f in files:
            try:
                with safe_open(root / f, framework="pt", device="cpu") as h:
                    weight_map.update(dict.fromkeys(h.keys(), f))
            except (OSError, SafetensorError) as e:  # truncated, empty or not a safetensors file
                raise WeightError(f"cannot read {root / f}: {e}") from None
    return weight_map, files


class _Checkpoint:
    """Header lookups and on-demand tensor reads over the shards (only the tensors asked for are read)."""

    def __init__(self, root: Path, stack: ExitStack, on_read: Callable[[], None]):
        from safetensors import SafetensorError, safe_open

        self.weight_map, files = checkpoint_files(root)
        try:
            self._open = {
                f: stack.enter_context(safe_open(root / f, framework="pt", device="cpu")) for f in files
            }
        except (OSError, SafetensorError) as e:
            raise WeightError(f"cannot read the safetensors files in {root}: {e}") from None
        self.on_read = on_read

    def info(self, name: str) -> tuple[str, list[int]] | None:
        """(safetensors dtype name, shape) or None when the tensor is absent."""
        f = self.weight_map.get(name)
        if f is None:
            return None
        try:
            sl = self._open[f].get_slice(name)
        except Exception as e:  # safetensors raises its own error type for an absent name
            raise WeightError(f"the index maps {name} to {f}, which does not contain it") from e
        return sl.get_dtype(), list(sl.get_shape())

    def read(self, name: str) -> torch.Tensor:
        self.on_read()
        f = self.weight_map[name]
        try:
            return self._open[f].get_tensor(name)
        except Exception as e:
            raise WeightError(f"cannot read {name} from {f}: {e}") from e


# safetensors dtype names of the tensors lumo reads (the builders refuse any other before reading it)
_TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
}


class _MetaReads:
    """A _Checkpoint whose reads are empty meta tensors of the stored dtype and shape: building the model
    through it runs every check on every tensor (names, dtypes, shapes, formats) and reads none."""

    def __init__(self, ckpt: _Checkpoint):
        self.weight_map, self.info = ckpt.weight_map, ckpt.info

    def read(self, name: str) -> torch.Tensor:
        dtype, shape = self.info(name)
        return torch.empty(shape, dtype=_TORCH_DTYPES[dtype], device="meta")


@dataclass(frozen=True)
class QuantSpec:
    """What a ModelOpt quantisation config declares (hf_quant_config.json or quantization_config)."""

    algo: str | None = None  # None (unquantised), one of QUANT_ALGOS, or "MIXED_PRECISION"
    exclude: tuple[str, ...] = ()  # fnmatch patterns of modules left unquantised
    layers: dict[str, str] = field(default_factory=dict)  # MIXED_PRECISION: module -> algo
    source: str = "config.json"

    def declared(self, module: str) -> str | None:
        """The algorithm the config declares for `module`, or None when it does not say (data decides)."""
        if self.algo == "MIXED_PRECISION":
            return self.layers.get(module)
        if self.algo is None or any(fnmatch.fnmatchcase(module, p) for p in self.exclude):
            return None
        return self.algo


@dataclass(frozen=True)
class BlockFP8Spec:
    """quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bn, bk]} (Qwen's and
    DeepSeek's FP8 checkpoints, transformers' FineGrainedFP8): FP8 weights with one f32 scale per block,
    stored as `weight_scale_inv`, dynamic activations (lumo keeps them bf16: W8A16)."""

    block: tuple[int, int] = (128, 128)
    skip: tuple[str, ...] = ()  # modules_to_not_convert: module names or name prefixes left dense
    source: str = "config.json quantization_config"

    def declared(self, module: str) -> str | None:
        skipped = any(module == m or module.startswith(m + ".") or m in module.split(".") for m in self.skip)
        return None if skipped else "FP8"


@dataclass(frozen=True)
class CompressedTensorsSpec:
    """A compressed-tensors quantization_config (llm-compressor, vLLM) whose config groups are all NVFP4."""

    groups: tuple[tuple[tuple[str, ...], str], ...] = ()  # (targets, "NVFP4" | "W4A16_NVFP4") per group
    ignore: tuple[str, ...] = ()  # module names, or "re:" + a regex matched at the start of the name
    source: str = "config.json quantization_config"

    def declared(self, module: str) -> str | None:
        """The algorithm of the group that quantises `module`, or None (unquantised): ignored, or no
        group's targets match. A target naming the module wins over the class "Linear" (every linear)."""
        if any(_ct_match(module, p) for p in self.ignore):
            return None
        by_name = [algo for targets, algo in self.groups if any(_ct_match(module, t) for t in targets)]
        by_class = [algo for targets, algo in self.groups if "Linear" in targets]
        return (by_name + by_class + [None])[0]


def read_quant_spec(root: Path, config: dict) -> QuantSpec | CompressedTensorsSpec | BlockFP8Spec:
    hf = root / "hf_quant_config.json"
    if hf.is_file():
        q = read_json_object(hf).get("quantization") or {}
        if not isinstance(q, dict):
            raise WeightError(f"{hf.name}: quantization must be an object, got {q!r}")
        source, exclude = hf.name, q.get("exclude_modules")
    elif q := config.get("quantization_config"):
        if not isinstance(q, dict):
            raise WeightError(f"config.json: quantization_config must be an object, got {q!r}")
        method = q.get("quant_method")
        if method == "compressed-tensors":
            return _compressed_tensors_spec(q, "config.json quantization_config")
        if method == "fp8":
            return _block_fp8_spec(q, "config.json quantization_config")
        if method != "modelopt":
            raise WeightError(
                f"unknown quantisation: quantization_config has quant_method {method!r}; lumo loads ModelOpt "
                f"({', '.join(QUANT_ALGOS)}, MIXED_PRECISION), compressed-tensors NVFP4, block FP8 "
                "(quant_method fp8) and unquantised checkpoints"
            )
        source, exclude = "config.json quantization_config", q.get("ignore", q.get("exclude_modules"))
    else:
        return QuantSpec()
    algo = q.get("quant_algo")
    algo = str(algo).upper() if algo else None
    if algo not in (None, *QUANT_ALGOS, "MIXED_PRECISION"):
        raise WeightError(
            f"unknown quantisation {algo!r} in {source}; "
            f"lumo loads {', '.join(QUANT_ALGOS)} and MIXED_PRECISION"
        )
    group = q.get("group_size")
    if (group is not None and (isinstance(group, bool) or group != 16)) and algo in ("NVFP4", "W4A16_NVFP4"):
        raise WeightError(
            f"unknown quantisation: {algo} with group_size {group!r} in {source} (NVFP4 uses 16)"
        )
    exclude = [exclude] if isinstance(exclude, str) else exclude or []
    if not isinstance(exclude, list) or not all(isinstance(m, str) for m in exclude):
        raise WeightError(f"{source}: the excluded modules must be a list of names or patterns: {exclude!r}")
    quantized = q.get("quantized_layers") or {}
    if not isinstance(quantized, dict) or not all(isinstance(v, dict | None) for v in quantized.values()):
        raise WeightError(
            f'{source}: quantized_layers must map module names to objects like {{"quant_algo": "NVFP4"}}'
        )
    layers = {m: str((v or {}).get("quant_algo", "")).upper() for m, v in quantized.items()}
    return QuantSpec(algo, tuple(exclude), layers, source)


def _block_fp8_spec(q: dict, source: str) -> BlockFP8Spec:
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise WeightError(f"unknown quantisation: FP8 format {fmt!r} in {source}; lumo loads e4m3")
    block = q.get("weight_block_size") or [128, 128]
    ok = isinstance(block, list | tuple) and len(block) == 2
    if not (ok and all(isinstance(b, int) and b > 0 for b in block)):
        raise WeightError(f"{source} has weight_block_size {block!r}; expected two positive integers")
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    if not all(isinstance(m, str) for m in skip):
        raise WeightError(f"{source} has modules_to_not_convert {skip!r}; expected module names")
    return BlockFP8Spec((int(block[0]), int(block[1])), tuple(skip), source)


# ---------------------------------------------------------------------------------------------
# compressed-tensors (llm-compressor, vLLM): quant_method "compressed-tensors". lumo loads the config groups
# whose format is "nvfp4-pack-quantized" with NVFP4 weights (W4A16), optionally NVFP4 activations (W4A4).

CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
# NVFP4 QuantizationArgs (compressed-tensors' NVFP4 / NVFP4A16 presets): key -> (required, default if absent)
_CT_NVFP4_ARGS = {
    "num_bits": (4, 8),
    "type": ("float", "int"),
    "strategy": ("tensor_group", None),
    "group_size": (16, None),
    "symmetric": (True, True),
}
# "weight" / "static" activation ordering changes only the calibration; "group" / "dynamic" / true stores a
# column permutation (weight_g_idx) that NVFP4 kernels do not apply
_CT_ACTORDER_OK = (None, False, "weight", "static")


def _ct_match(module: str, pattern: str) -> bool:
    """compressed-tensors' name match: "re:" + a regex matched at the start (re.match), else equality."""
    return re.match(pattern[3:], module) is not None if pattern.startswith("re:") else pattern == module


def _lower(v: object) -> object:
    return v.lower() if isinstance(v, str) else v


def _ct_check_nvfp4(args: dict, what: str, where: str) -> None:
    for key, (want, default) in _CT_NVFP4_ARGS.items():
        if _lower(found := args.get(key, default)) != want:
            raise WeightError(
                f"unknown quantisation: {what} {key} {found!r} in {where}; lumo loads NVFP4 ({key} {want!r})"
            )
    if _lower(args.get("actorder")) not in _CT_ACTORDER_OK:
        raise WeightError(
            f"unknown quantisation: {what} actorder {args['actorder']!r} in {where}; lumo loads NVFP4 "
            "without a column permutation (actorder null or 'weight')"
        )
    if what == "weights" and args.get("dynamic") not in (None, False):
        raise WeightError(f"unknown quantisation: weights dynamic {args['dynamic']!r} in {where}")


def _compressed_tensors_spec(q: dict, source: str) -> CompressedTensorsSpec:
    """Every config group must be NVFP4 in the nvfp4-pack-quantized format; anything else raises."""
    for key in ("sparsity_config", "transform_config"):
        if q.get(key):
            raise WeightError(f"unknown quantisation: {source} has a {key}; lumo loads plain NVFP4")
    groups = []
    for name, g in (q.get("config_groups") or {}).items():
        where = f"config group {name!r} of {source}"
        if not isinstance(g, dict):
            raise WeightError(f"unknown quantisation: {where} is {g!r}, not a quantisation scheme")
        fmt = g.get("format") or q.get("format")  # a group's own format overrides the global one
        if fmt != CT_NVFP4_FORMAT:
            raise WeightError(
                f"unknown quantisation: compressed-tensors format {fmt!r} in {where}; "
                f"lumo loads {CT_NVFP4_FORMAT!r}"
            )
        _ct_check_nvfp4(g.get("weights") or {}, "weights", where)
        if acts := g.get("input_activations"):
            _ct_check_nvfp4(acts, "input_activations", where)
        if g.get("output_activations"):
            raise WeightError(f"unknown quantisation: output_activations in {where}")
        groups.append((tuple(g.get("targets") or ()), "NVFP4" if acts else "W4A16_NVFP4"))
    spec = CompressedTensorsSpec(tuple(groups), tuple(q.get("ignore") or ()), source)
    for p in spec.ignore + tuple(t for targets, _ in spec.groups for t in targets):
        if not isinstance(p, str):
            raise WeightError(f"{source} has a target or ignore entry {p!r} that is not a string")
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise WeightError(f"{source} has an invalid regular expression {p!r} ({e})") from None
    return spec


# ---------------------------------------------------------------------------------------------
# Building each linear from the checkpoint.


@dataclass(frozen=True)
class _NVFP4Names:
    """Where a checkpoint convention keeps an NVFP4 linear's tensors (both name the block scales
    `weight_scale`, F8_E4M3 [N, K/16])."""

    codes: str  # U8 [N, K/2]
    global_scale: str  # F32 [] or [1]
    input_scale: str  # F32 [] or [1], W4A4 only
    # compressed-tensors stores both global scales as divisors, W = e2m1 * (weight_scale / global_scale) with
    # global_scale = 448 * 6 / amax: their fp32 reciprocals are ModelOpt's weight_scale_2 and input_scale
    divisors: bool = False


_MODELOPT_NVFP4 = _NVFP4Names("weight", "weight_scale_2", "input_scale")
_CT_NVFP4 = _NVFP4Names("weight_packed", "weight_global_scale", "input_global_scale", divisors=True)


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(())


def _quantized_linear_builder(
    ckpt: _Checkpoint,
    spec: QuantSpec | CompressedTensorsSpec | BlockFP8Spec,
    device: torch.device,
    dtype: torch.dtype,
) -> LinearBuilder:
    """Decide each linear's format from its stored dtypes and scales, cross-checked with the config."""

    def tensor(name: str, dtypes: tuple[str, ...], shape: list[int] | None, what: str) -> torch.Tensor:
        info = ckpt.info(name)
        if info is None:
            raise WeightError(f"missing tensor {name} ({what})")
        found_dtype, found = info
        if found_dtype not in dtypes:
            raise WeightError(
                f"unknown quantisation: tensor {name} is {found_dtype}, expected {'/'.join(dtypes)}"
            )
        scalar = shape == []
        if (scalar and found not in ([], [1])) or (not scalar and shape is not None and found != shape):
            raise WeightError(f"tensor {name} has shape {found}, expected {shape} ({what})")
        return ckpt.read(name)

    def dense(name: str, N: int, K: int) -> Linear:
        return DenseLinear(tensor(name, tuple(_DENSE), [N, K], "dense").to(device=device, dtype=dtype))

    def nvfp4(prefix: str, N: int, K: int, names: _NVFP4Names, declared: str | None) -> Linear:
        if K % 16:
            raise WeightError(
                f"tensor {prefix}.{names.codes} is NVFP4 but the input dim {K} is not a multiple of 16"
            )
        what = f"NVFP4 packing of [{N}, {K}]"
        w = tensor(f"{prefix}.{names.codes}", ("U8",), [N, K // 2], what)
        ws = tensor(f"{prefix}.weight_scale", ("F8_E4M3",), [N, K // 16], what)
        ws2 = _scalar(
            tensor(f"{prefix}.{names.global_scale}", ("F32", "BF16", "F16"), [], "NVFP4 global scale")
        )
        inp = f"{prefix}.{names.input_scale}"
        xs = _scalar(tensor(inp, ("F32", "BF16", "F16"), [], "NVFP4")) if ckpt.info(inp) else None
        if names.divisors:
            ws2, xs = 1.0 / ws2, None if xs is None else 1.0 / xs
        # W4A4 needs the calibrated activation scale; without it (or declared W4A16) use BF16 activations.
        acts = "nvfp4" if xs is not None and declared != "W4A16_NVFP4" else "bf16"
        return NVFP4Linear(
            weight=w.to(device),
            weight_scale=ws.to(device),
            weight_scale_2=ws2.to(device),
            input_scale=None if xs is None else xs.to(device),
            activations=acts,
        )

    def modelopt(prefix: str, N: int, K: int) -> Linear:
        name = f"{prefix}.weight"
        info = ckpt.info(name)
        if info is None:
            raise WeightError(f"missing tensor {name}")
        stored = info[0]
        kind = "DENSE" if stored in _DENSE else {"U8": "NVFP4", "F8_E4M3": "FP8"}.get(stored)
        if kind is None:
            raise WeightError(
                f"unknown quantisation: tensor {name} is {stored} (lumo loads BF16/F16/F32, NVFP4, FP8)"
            )
        declared = spec.declared(prefix)
        if declared is not None and declared not in QUANT_ALGOS:
            raise WeightError(f"unknown quantisation {declared!r} for {prefix} in {spec.source}")
        declared_kind = {"W4A16_NVFP4": "NVFP4"}.get(declared, declared)
        # A dense tensor under a global algo is accepted (exclude lists name modules inconsistently); an
        # explicit MIXED_PRECISION entry or a different packed format is a contradiction.
        explicit = spec.algo == "MIXED_PRECISION"
        if declared_kind is not None and declared_kind != kind and (kind != "DENSE" or explicit):
            raise WeightError(
                f"tensor {name} is stored as {kind.lower()} ({stored}) but {spec.source} says {declared}"
            )

        if kind == "DENSE":
            return dense(name, N, K)
        if kind == "FP8":
            w = tensor(name, ("F8_E4M3",), [N, K], "FP8")
            ws = tensor(f"{prefix}.weight_scale", ("F32", "BF16", "F16"), [], "FP8 per-tensor scale")
            inp = ckpt.info(f"{prefix}.input_scale")
            xs = tensor(f"{prefix}.input_scale", ("F32", "BF16", "F16"), [], "FP8") if inp else None
            return FP8Linear(
                w.to(device), _scalar(ws).to(device), None if xs is None else _scalar(xs).to(device)
            )
        return nvfp4(prefix, N, K, _MODELOPT_NVFP4, declared)

    def compressed_tensors(prefix: str, N: int, K: int) -> Linear:
        declared = spec.declared(prefix)
        packed = f"{prefix}.{_CT_NVFP4.codes}"
        if ckpt.info(packed) is not None:
            if declared is None:
                raise WeightError(
                    f"tensor {packed} is stored as nvfp4 but {spec.source} leaves {prefix} unquantised "
                    "(it is in `ignore` or matches no config group's targets)"
                )
            return nvfp4(prefix, N, K, _CT_NVFP4, declared)
        name = f"{prefix}.weight"
        info = ckpt.info(name)
        if info is None:
            raise WeightError(f"missing tensor {packed if declared else name}")
        if info[0] not in _DENSE:
            raise WeightError(
                f"unknown quantisation: tensor {name} is {info[0]}; compressed-tensors NVFP4 stores {packed}"
            )
        # A dense weight under a group's targets is accepted: transformers never loads `mtp.*`, so
        # llm-compressor leaves the MTP head unquantised without listing it in `ignore`.
        return dense(name, N, K)

    def block_fp8(prefix: str, N: int, K: int) -> Linear:
        name = f"{prefix}.weight"
        info = ckpt.info(name)
        if info is None:
            raise WeightError(f"missing tensor {name}")
        if info[0] in _DENSE:  # modules_to_not_convert, or a checkpoint that left it dense
            return dense(name, N, K)
        if info[0] != "F8_E4M3":
            raise WeightError(f"unknown quantisation: tensor {name} is {info[0]} in a block FP8 checkpoint")
        if spec.declared(prefix) is None:
            raise WeightError(f"tensor {name} is stored as fp8 but {spec.source} leaves {prefix} unconverted")
        bn, bk = spec.block
        w = tensor(name, ("F8_E4M3",), [N, K], "FP8")
        scale_name = f"{prefix}.weight_scale_inv"
        what = f"FP8 scales of [{N}, {K}] in {bn} x {bk} blocks"
        ws = tensor(scale_name, ("F32", "BF16", "F16"), [-(-N // bn), -(-K // bk)], what)
        return FP8Linear(w.to(device), ws.float().to(device), block=(bn, bk))

    def build(prefix: str, shape: tuple[int, int]) -> Linear:
        N, K = shape
        if isinstance(spec, BlockFP8Spec):
            return block_fp8(prefix, N, K)
        return (compressed_tensors if isinstance(spec, CompressedTensorsSpec) else modelopt)(prefix, N, K)

    return build


def load_model(
    path_or_id: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    lazy: bool = False,
    meta: bool = False,
    overrides: dict[str, Any] | None = None,
) -> tuple[ModelConfig, ModelWeights]:
    """Load config.json and the text model's tensors (`mtp.*` too; `model.visual.*` is never read).

    Dense tensors are converted to `dtype`; quantised linears keep their packed tensors. All go to `device`.
    lazy: the decoder layers are a LazyLayers, read from the still open shards each time they are walked
    (for one pass: packing for the kernels, the reference check); every tensor is checked here all the same
    (on the meta device), so a broken checkpoint fails before anything is packed.
    meta: only that check: the weights built of meta tensors (stored dtypes and shapes), none read.
    overrides: merged into config.json's object (lumo.config.apply_overrides, vLLM's --hf-overrides).
    """
    from tqdm import tqdm

    root = resolve_model_path(path_or_id)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise WeightError(f"no config.json in {root}")
    raw = apply_overrides(read_json_object(cfg_path), overrides)
    cfg = ModelConfig.from_hf(raw)
    spec = read_quant_spec(root, raw)
    device = torch.device(device)

    def builders(ckpt: _Checkpoint | _MetaReads, device: torch.device) -> tuple[TensorGetter, LinearBuilder]:
        def get(name: str) -> torch.Tensor | None:
            info = ckpt.info(name)
            if info is None:
                return None
            if info[0] not in _DENSE:
                raise WeightError(f"tensor {name} is {info[0]}; lumo expects it unquantised (BF16/F16/F32)")
            return ckpt.read(name).to(device=device, dtype=dtype)

        return get, _quantized_linear_builder(ckpt, spec, device, dtype)

    shards = ExitStack()  # the open files: closed on return, or with a lazy model's layers
    try:
        bar = tqdm(
            desc="loading", unit="tensor", file=sys.stderr, disable=not progress or not sys.stderr.isatty()
        )
        with bar:
            ckpt = _Checkpoint(root, shards, on_read=lambda: bar.update(1))
            names = ckpt.weight_map
            if cfg.tie_word_embeddings and "lm_head.weight" in names and "tie_word_embeddings" not in raw:
                # the wrapper's tie was read from its text_config (its own key absent): transformers ties on
                # the wrapper's key only (default false) and so reads the lm_head stored, as lumo does now
                cfg = replace(cfg, tie_word_embeddings=False)
            prefix = (
                "model.language_model."
                if any(n.startswith("model.language_model.") for n in names)
                else "model."
            )
            get, linear = builders(ckpt, device)
            layers = None
            if lazy or meta:
                formats = build_weights(cfg, *builders(_MetaReads(ckpt), torch.device("meta")), prefix)
                if meta:
                    shards.close()
                    return cfg, formats
                kinds = cfg.layer_types

                def read(i: int) -> LayerWeights:
                    return build_layer(cfg, get, linear, f"{prefix}layers.{i}", kinds[i])

                layers = LazyLayers(read, list(formats.layers), progress, shards)
                names = [n for n in names if not n.startswith(f"{prefix}layers.")]
            bar.total = sum(
                1
                for n in names
                if n.startswith((prefix, "lm_head."))
                or (n.startswith("mtp.") and cfg.mtp_num_hidden_layers > 0)
            )
            weights = build_weights(cfg, get, linear, prefix, layers)
            bar.total = bar.n  # tensors lumo does not use (k/v scales, ...) were counted but not read
        ckpt.on_read = lambda: None  # the bar is closed; LazyLayers shows its own
    except BaseException:
        shards.close()
        raise
    if layers is None:
        shards.close()
    return cfg, weights
