"""ModelWeights packed once for the GPU kernels (lumo.kernels), plus random 27B-shaped weights for benchmarks.

Linears that read the same input are fused into one launch: a GDN layer's [q | k | v | z] (in_proj_qkv +
in_proj_z) and [b | a], an attention layer's [q | k | v], an MLP's [gate | up]. NVFP4 shards go through
`pack_fused` (each keeps its weight_scale_2), dense shards are concatenated as bf16, FP8 is dequantised to
bf16 here. Shards of different kinds (a "mixed" checkpoint) become several parts of one `GPULinear`
writing column ranges of the same output. Everything here is plain torch and also runs on the CPU
(tests/test_gpu_weights.py checks the bookkeeping there); only the launches need CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..config import FULL, ModelConfig, check_draft_quant
from ..kernels.conv import conv_decode
from ..kernels.linear import (
    PackedNVFP4,
    _bf16_splits,
    bf16_linear,
    bf16_linear_partials,
    nvfp4_linear,
    pack_fused,
)
from ..kernels.norms import silu_mul
from ..quant import nvfp4_global_scale, nvfp4_quantize
from ..rope import rope_table
from ..weights import (
    AttnWeights,
    DenseLinear,
    FP8Linear,
    GDNWeights,
    LayerWeights,
    Linear,
    MLPWeights,
    ModelWeights,
    MTPWeights,
    NVFP4Linear,
    layer_formats,
    linear_rows,
)

SMALL_M = 32  # rows served by the batch-invariant GEMV kernels (lumo.kernels.linear.SMALL_M)


@dataclass
class LinearPart:
    """One launch: a packed NVFP4 weight or a dense bf16 weight, N output columns."""

    packed: PackedNVFP4 | None = None
    weight: torch.Tensor | None = None  # [N, K] bf16, dense parts only
    workspace: torch.Tensor | None = None  # [splits, 32, N] f32 split-K partials of a dense part

    @property
    def n(self) -> int:
        return self.packed.out_features if self.packed is not None else self.weight.shape[0]

    def run(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None,
        rows: torch.Tensor | None = None,
        conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        stage: bool = False,
    ) -> torch.Tensor:
        """conv, stage (NVFP4 parts only): nvfp4_linear's fused GDN decode conv, weights staged in shared
        memory before the wait."""
        if self.packed is not None:
            return nvfp4_linear(x, self.packed, out=out, rows=rows, conv=conv, stage=stage)
        return bf16_linear(x, self.weight, out=out, workspace=self.workspace)

    def nbytes(self) -> int:
        if self.packed is not None:
            p = self.packed
            return sum(t.numel() * t.element_size() for t in (p.qw, p.qs, p.gs))
        return self.weight.numel() * self.weight.element_size()


@dataclass
class GPULinear:
    """x [M, K] bf16 -> [M, N] bf16 for the concatenation of `shard_sizes` linears (in order)."""

    parts: list[LinearPart]
    shard_sizes: tuple[int, ...]  # N of each original linear
    k: int  # input features K
    # An MLP's [gate | up] packed for the fused SwiGLU (one NVFP4 part, pack_fused(glu=True)): the output is
    # silu(gate) * up [M, I] and shard_sizes is (I,). See swiglu().
    glu: bool = False

    @property
    def n(self) -> int:
        return sum(self.shard_sizes)

    @property
    def scratch_width(self) -> int:
        """Columns of swiglu()'s scratch per row: [gate | up], or a fused-SwiGLU weight's padded rows."""
        return self.parts[0].packed.n if self.glu else self.n

    def __call__(
        self,
        x: torch.Tensor,
        out: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        stage: bool = False,
    ) -> torch.Tensor:
        """rows: a fused-SwiGLU weight's interleaved-rows workspace (nvfp4_linear). conv: (w [C, K], state
        [C, K-1], y [1, C]) of the GDN decode conv over the output's first C columns, for one token: run by
        the GEMV's epilogue where an NVFP4 first part holds those columns (nvfp4_linear), else by
        conv_decode after it (the same bits). stage: NVFP4 parts copy their weights into shared memory
        before they wait for the previous kernel, where one wave holds them (nvfp4_linear; same bits)."""
        if conv is not None:
            first, c = self.parts[0], conv[0].shape[0]
            if x.shape[0] != 1:
                raise ValueError(f"conv is the one-token decode conv, got {x.shape[0]} rows")
            aligned = out is None or (out.is_contiguous() and out.data_ptr() % 16 == 0)
            if first.packed is None or first.n < c or not aligned:
                y = self(x, out, rows, stage=stage)
                conv_decode(y[:, :c], conv[0], conv[1], out=conv[2])
                return y
        if len(self.parts) == 1:
            return self.parts[0].run(x, out, rows, conv, stage)
        if out is None:
            out = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16, device=x.device)
        col = 0
        for p in self.parts:
            dst = out[:, col : col + p.n]
            # One row (decode) is a contiguous slice: written in place. Several rows (prefill) are not.
            if dst.is_contiguous() and dst.data_ptr() % 16 == 0:
                p.run(x, dst, conv=conv if col == 0 else None, stage=stage)  # one row: the first part's conv
            else:
                dst.copy_(p.run(x, None, stage=stage))
            col += p.n
        return out

    def splitk_partials(self, x: torch.Tensor) -> torch.Tensor | None:
        """For one dense part that runs split-K: its GEMV writing only the f32 partials [S, M, N]
        (bf16_linear_partials; their reduce is left to the consumer); else None and nothing runs."""
        p = self.parts[0]
        if len(self.parts) != 1 or p.weight is None or p.workspace is None:
            return None
        return bf16_linear_partials(x, p.weight, p.workspace)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of an output [M, N] per original linear."""
        return tuple(y.split(self.shard_sizes, dim=-1))

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


@dataclass
class GPUGDN:
    qkvz: GPULinear  # [C + nv*dv, H]: [q | k | v] pre-conv, then z
    ba: GPULinear  # [2*nv, H]: [b | a] (raw; beta and g are computed in the GDN kernel)
    conv1d: torch.Tensor  # [C, K] bf16
    A_log: torch.Tensor  # [nv] f32 (exact copy of the checkpoint's values)
    dt_bias: torch.Tensor  # [nv] f32
    norm: torch.Tensor  # [dv] bf16, plain-weight gated rmsnorm
    out_proj: GPULinear  # [H, nv*dv]


@dataclass
class GPUAttn:
    qkv: GPULinear  # [nh*2d + 2*nkv*d, H]: [q+gate per head | k | v]
    o_proj: GPULinear  # [H, nh*d]
    q_norm: torch.Tensor  # [d] bf16, 1+w
    k_norm: torch.Tensor  # [d] bf16, 1+w


@dataclass
class GPULayer:
    input_layernorm: torch.Tensor  # [H] bf16, 1+w
    post_attention_layernorm: torch.Tensor  # [H] bf16, 1+w
    mixer: GPUGDN | GPUAttn
    gate_up: GPULinear  # [2I, H]: [gate | up] (or fused SwiGLU, GPULinear.glu): use swiglu()
    down: GPULinear  # [H, I]


@dataclass
class GPUMTP:
    """The MTP draft head (lumo.model.mtp_forward): fc over [norm(embed(x)) | norm(h)], then full-attention
    decoder layers (packed like the target's) with their own KV cache, then a final norm; lm_head shared."""

    fc: GPULinear  # [H, 2H]: input = cat(embedding half FIRST, hidden half)
    pre_fc_norm_embedding: torch.Tensor  # [H] bf16, 1+w
    pre_fc_norm_hidden: torch.Tensor  # [H] bf16, 1+w
    layers: list[GPULayer]  # GPUAttn mixers
    norm: torch.Tensor  # [H] bf16, 1+w
    # A draft vocabulary (lumo.engine.draft_vocab): the lm_head's rows of those tokens, and their ids
    # [N] int32 ascending. None: the drafter uses the whole lm_head.
    draft_head: GPULinear | None = None
    draft_ids: torch.Tensor | None = None

    def nbytes(self) -> int:
        lins = [self.fc] + ([self.draft_head] if self.draft_head is not None else [])
        for lw in self.layers:
            lins += [lw.gate_up, lw.down, lw.mixer.qkv, lw.mixer.o_proj]
        return sum(lin.nbytes() for lin in lins)


@dataclass
class GPUWeights:
    embed: torch.Tensor  # [V, H] bf16
    layers: list[GPULayer]
    norm: torch.Tensor  # [H] bf16, 1+w
    lm_head: GPULinear  # [V, H]
    inv_freq: torch.Tensor  # [rotary/2] f32, lumo.model's RoPE table (lumo.rope.rope_table)
    mtp: GPUMTP | None = None  # packed only when asked for (speculative decoding)
    rope_scale: float = 1.0  # cos / sin's factor (a yarn RoPE's attention factor): qk_norm_rope_kv's

    def nbytes(self) -> int:
        """Bytes of every linear weight (what one decode step reads), lm_head included, embedding not."""
        lins = [self.lm_head]
        for lw in self.layers:
            m = lw.mixer
            lins += [lw.gate_up, lw.down]
            lins += [m.qkvz, m.ba, m.out_proj] if isinstance(m, GPUGDN) else [m.qkv, m.o_proj]
        return sum(lin.nbytes() for lin in lins)


# ---------------------------------------------------------------------------------------------
# Packing.


def _kind(lin: Linear) -> str:
    return "nvfp4" if isinstance(lin, NVFP4Linear) else "dense"


def _dense_bf16(lin: Linear, device: torch.device) -> torch.Tensor:
    if isinstance(lin, FP8Linear):  # FP8 -> bf16 once at load (W = float(weight) * scale, rounded once)
        return lin.dequantize(torch.float32).to(device=device, dtype=torch.bfloat16)
    if isinstance(lin, DenseLinear):
        return lin.weight.to(device=device, dtype=torch.bfloat16)
    raise TypeError(f"not a dense linear: {type(lin).__name__}")


def _dense_part(weight: torch.Tensor) -> LinearPart:
    n, k = weight.shape
    if k % 16:
        raise ValueError(f"dense linear with K={k}: the bf16 kernel needs K % 16 == 0")
    weight = _aligned(weight)
    splits = _bf16_splits(n, k)
    ws = torch.empty(splits, SMALL_M, n, device=weight.device) if splits > 1 else None
    return LinearPart(weight=weight, workspace=ws)


def _nvfp4_shards(lins: list[Linear], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """pack_fused's (weight, weight_scale, weight_scale_2) of each NVFP4 linear, on `device`."""
    return [
        (lin.weight.to(device), lin.weight_scale.to(device), lin.weight_scale_2.to(device)) for lin in lins
    ]


def pack_linear(lins: list[Linear], device: torch.device | str, glu: bool = False) -> GPULinear:
    """Fuse linears sharing their input into one GPULinear; consecutive shards of one kind share a part.

    glu: `lins` are an MLP's [gate, up]; where both are NVFP4 of one shape they are packed for the fused
    SwiGLU (the GEMV's output is silu(gate) * up, GPULinear.glu), else as a plain fused linear."""
    device = torch.device(device)
    k = lins[0].shape[1]
    if any(lin.shape[1] != k for lin in lins):
        raise ValueError(f"fused linears must share K, got {[lin.shape for lin in lins]}")
    if (
        glu
        and len(lins) == 2
        and all(_kind(lin) == "nvfp4" for lin in lins)
        and lins[0].shape == lins[1].shape
    ):
        part = LinearPart(packed=pack_fused(_nvfp4_shards(lins, device), glu=True))
        return GPULinear([part], (lins[0].shape[0],), k, glu=True)
    groups: list[list[Linear]] = []
    for lin in lins:
        if groups and _kind(groups[-1][0]) == _kind(lin):
            groups[-1].append(lin)
        else:
            groups.append([lin])
    parts = []
    for g in groups:
        if _kind(g[0]) == "nvfp4":
            parts.append(LinearPart(packed=pack_fused(_nvfp4_shards(g, device))))
        else:
            parts.append(_dense_part(torch.cat([_dense_bf16(lin, device) for lin in g])))
    return GPULinear(parts, tuple(lin.shape[0] for lin in lins), k)


def swiglu(
    gate_up: GPULinear, x: torch.Tensor, act: torch.Tensor | None = None, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """An MLP's activation silu(gate) * up [M, I] (lumo.model.mlp): one launch where gate_up is packed for
    the fused SwiGLU (GPULinear.glu), else the [gate | up] GEMV and silu_mul (the same bits). `scratch`
    (swiglu_scratch) holds the GEMV's rows where they are not fused; None: made per call."""
    m, width = x.shape[0], gate_up.scratch_width
    rows = None if scratch is None else scratch[: m * width].view(m, width)
    if gate_up.glu:
        return gate_up(x, out=act, rows=rows)
    return silu_mul(gate_up(x, out=rows), out=act)


def swiglu_scratch(layers: Sequence[GPULayer], rows: int, device: torch.device) -> torch.Tensor:
    """swiglu()'s flat bf16 scratch for `rows` rows through any of `layers`' MLPs."""
    width = max((lw.gate_up.scratch_width for lw in layers), default=0)
    return torch.zeros(rows * width, dtype=torch.bfloat16, device=device)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels' vector loads); a tensor read straight from a
    safetensors file on the CPU may sit at any offset."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _vec(t: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return _aligned(t.to(device=device, dtype=dtype))


def pack_layer(cfg: ModelConfig, lw: LayerWeights, device: torch.device | str) -> GPULayer:
    device = torch.device(device)
    m = lw.mixer
    if isinstance(m, GDNWeights):
        mixer: GPUGDN | GPUAttn = GPUGDN(
            qkvz=pack_linear([m.in_proj_qkv, m.in_proj_z], device),
            ba=pack_linear([m.in_proj_b, m.in_proj_a], device),
            conv1d=_vec(m.conv1d, device),
            A_log=_vec(m.A_log, device, torch.float32),
            dt_bias=_vec(m.dt_bias, device, torch.float32),
            norm=_vec(m.norm, device),
            out_proj=pack_linear([m.out_proj], device),
        )
    elif isinstance(m, AttnWeights):
        mixer = GPUAttn(
            qkv=pack_linear([m.q_proj, m.k_proj, m.v_proj], device),
            o_proj=pack_linear([m.o_proj], device),
            q_norm=_vec(m.q_norm, device),
            k_norm=_vec(m.k_norm, device),
        )
    else:
        raise TypeError(f"unknown mixer {type(m).__name__}")
    return GPULayer(
        input_layernorm=_vec(lw.input_layernorm, device),
        post_attention_layernorm=_vec(lw.post_attention_layernorm, device),
        mixer=mixer,
        gate_up=pack_linear([lw.mlp.gate_proj, lw.mlp.up_proj], device, glu=True),
        down=pack_linear([lw.mlp.down_proj], device),
    )


QUANT_ROWS = 8192  # rows quantised at a time by nvfp4_copy (a bounded f32 workspace)


def nvfp4_copy(lin: Linear, device: torch.device | str) -> NVFP4Linear:
    """An NVFP4 copy of a linear on `device` (an NVFP4 one is returned as it is), quantised by ModelOpt's rule
    (lumo.quant.nvfp4_quantize) on `device`, QUANT_ROWS rows at a time with the whole weight's global scale
    (a first pass over the blocks finds it): the bits of quantising it whole, with one block of the source
    on the device at a time. For the drafter only: its weights decide which tokens are proposed, never
    which are emitted."""
    if isinstance(lin, NVFP4Linear):
        return lin  # pack_linear moves it
    device = torch.device(device)

    def block(r: int) -> torch.Tensor:  # rows [r, r + QUANT_ROWS) of W on the device (FP8: dequantised)
        if isinstance(lin, DenseLinear):
            return lin.weight[r : r + QUANT_ROWS].to(device)
        part = linear_rows(lin, torch.arange(r, min(r + QUANT_ROWS, lin.shape[0])))  # its block scales too
        part = replace(part, weight=part.weight.to(device), weight_scale=part.weight_scale.to(device))
        return part.dequantize()

    starts = range(0, lin.shape[0], QUANT_ROWS)
    scale_2 = nvfp4_global_scale(torch.stack([block(r).abs().amax().float() for r in starts]))
    parts = [nvfp4_quantize(block(r), scale_2) for r in starts]
    return NVFP4Linear(
        weight=torch.cat([p[0] for p in parts]),
        weight_scale=torch.cat([p[1] for p in parts]),
        weight_scale_2=scale_2,
    )


def _nvfp4_mtp(m: MTPWeights, device: torch.device) -> MTPWeights:
    """The MTP head with every linear an NVFP4 copy (nvfp4_copy); norms and the rest as they are."""

    def layer(lw: LayerWeights) -> LayerWeights:
        a, mlp = lw.mixer, lw.mlp
        q = {f: nvfp4_copy(getattr(a, f), device) for f in ("q_proj", "k_proj", "v_proj", "o_proj")}
        mlp = MLPWeights(*(nvfp4_copy(x, device) for x in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)))
        return replace(lw, mixer=replace(a, **q), mlp=mlp)

    return replace(m, fc=nvfp4_copy(m.fc, device), layers=[layer(lw) for lw in m.layers])


def pack_draft_head(
    lm_head: Linear,
    draft_ids: Sequence[int] | torch.Tensor | None,
    device: torch.device | str,
    nvfp4: bool = False,
) -> tuple[GPULinear, torch.Tensor | None]:
    """The draft head: the lm_head's rows of the ascending token ids draft_ids (a draft vocabulary,
    lumo.engine.draft_vocab; None: every row), packed (an NVFP4 copy with `nvfp4`), and the ids [N] int32
    on the device, or None for every row (GPUMTP.draft_head / draft_ids)."""
    if draft_ids is None:
        head = nvfp4_copy(lm_head, device) if nvfp4 else lm_head
        return pack_linear([head], device), None
    rows = torch.as_tensor(draft_ids, dtype=torch.long).cpu()
    if rows.dim() != 1 or rows.numel() == 0 or not bool((rows[1:] > rows[:-1]).all()):
        raise ValueError("draft_ids must be ascending unique token ids")
    if int(rows[0]) < 0 or int(rows[-1]) >= lm_head.shape[0]:
        raise ValueError(f"draft_ids must lie in [0, {lm_head.shape[0]})")
    head = linear_rows(lm_head, rows.to(lm_head.weight.device))
    head = pack_linear([nvfp4_copy(head, device) if nvfp4 else head], device)
    return head, rows.to(device=device, dtype=torch.int32)


def pack_mtp(
    cfg: ModelConfig,
    m: MTPWeights,
    device: torch.device | str,
    lm_head: Linear | None = None,
    draft_ids: Sequence[int] | None = None,
    nvfp4: bool = False,
) -> GPUMTP:
    """Pack the MTP head (its layers must be full-attention layers, as in every published checkpoint).
    With draft_ids (sorted token ids, lumo.engine.draft_vocab) also the draft head: those rows of
    lm_head. `nvfp4`: the drafter in NVFP4 (draft_quant, below): NVFP4 copies of the MTP head's linears
    and, unless the lm_head already is NVFP4, a draft head that is an NVFP4 copy of it."""
    device = torch.device(device)
    if not all(isinstance(lw.mixer, AttnWeights) for lw in m.layers):
        raise ValueError("MTP layers must be full-attention layers")
    if nvfp4:
        m = _nvfp4_mtp(m, device)
    layers = [pack_layer(cfg, lw, device) for lw in m.layers]
    head = ids = None
    copy_head = nvfp4 and not isinstance(lm_head, NVFP4Linear)
    if draft_ids is not None or copy_head:
        if lm_head is None:
            raise ValueError("a draft vocabulary or an NVFP4 drafter needs the lm_head")
        head, ids = pack_draft_head(lm_head, draft_ids, device, nvfp4)
    return GPUMTP(
        fc=pack_linear([m.fc], device),
        pre_fc_norm_embedding=_vec(m.pre_fc_norm_embedding, device),
        pre_fc_norm_hidden=_vec(m.pre_fc_norm_hidden, device),
        layers=layers,
        norm=_vec(m.norm, device),
        draft_head=head,
        draft_ids=ids,
    )


def draft_quant(w: ModelWeights, choice: str = "auto") -> bool:
    """Whether the drafter runs in NVFP4: "nvfp4" yes, "none" no, "auto" when any of the target's MLP linears
    is NVFP4 (a 4-bit checkpoint: the MTP head and lm_head that ModelOpt leaves in BF16 would read 3.4 GB
    per draft step on the 27B, 43% of an event; session 17, docs/spec-engine.md). Any choice emits the
    target's tokens; the drafter's precision moves only how many drafts are accepted."""
    if check_draft_quant(choice) != "auto":
        return choice == "nvfp4"
    mlps = [lw.mlp for lw in layer_formats(w)]  # a lazy model's formats: no tensor read
    lins = [lin for m in mlps for lin in (m.gate_proj, m.up_proj, m.down_proj)]
    return any(isinstance(lin, NVFP4Linear) for lin in lins)


def pack_weights(
    cfg: ModelConfig,
    w: ModelWeights,
    device: torch.device | str = "cuda",
    mtp: bool = False,
    draft_ids: Sequence[int] | None = None,
    draft_nvfp4: bool = False,
) -> GPUWeights:
    """Pack for the kernels. The MTP head is packed only with `mtp=True` (speculative decoding; plain
    decoding does not need it), with a draft head if draft_ids are given or the drafter runs in NVFP4
    (`draft_nvfp4`, pack_mtp). Weights may live on any device; each linear is moved to `device` as it is
    packed, so GPU memory holds only the packed copy when the source weights are on the CPU, and the layers
    are walked once, so a lazy model's (load_model(lazy=True)) are read one at a time."""
    device = torch.device(device)
    kinds = [FULL if isinstance(lw.mixer, AttnWeights) else "linear_attention" for lw in layer_formats(w)]
    if tuple(kinds) != cfg.layer_types:
        raise ValueError("the weights' layer kinds do not match cfg.layer_types")
    head = None
    if mtp and w.mtp is not None:
        head = pack_mtp(cfg, w.mtp, device, w.lm_head, draft_ids, draft_nvfp4)
    inv_freq, rope_scale = rope_table(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, device)
    return GPUWeights(
        embed=_vec(w.embed_tokens, device),
        layers=[pack_layer(cfg, lw, device) for lw in w.layers],
        norm=_vec(w.norm, device),
        lm_head=pack_linear([w.lm_head], device),
        inv_freq=inv_freq,
        mtp=head,
        rope_scale=rope_scale,
    )


# ---------------------------------------------------------------------------------------------
# Random weights (benchmarks and shape smoke tests: no files). Magnitudes keep a deep stack finite in
# bf16: every linear maps a unit-RMS input to an output of RMS ~`gain`.


def config_27b(num_layers: int = 64, vocab_size: int = 248320) -> ModelConfig:
    """The Qwen3.8-27B text config (MODEL.md), optionally with fewer layers (pattern kept: GDN x3, full)."""
    return ModelConfig.from_hf(
        {
            "model_type": "qwen3_5_text",
            "vocab_size": vocab_size,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": num_layers,
            "full_attention_interval": 4,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "max_position_embeddings": 262144,
            "mtp_num_hidden_layers": 0,
        }
    )


E2M1_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # uniform codes


def _random_nvfp4(n: int, k: int, gen: torch.Generator, device: torch.device, gain: float) -> NVFP4Linear:
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=gen)
    scale = (0.75 + 0.5 * torch.rand(n, k // 16, device=device, generator=gen)).to(torch.float8_e4m3fn)
    s2 = torch.tensor(gain / (E2M1_RMS * math.sqrt(k)), device=device)
    return NVFP4Linear(codes, scale, s2)


def random_model_weights(
    cfg: ModelConfig,
    device: torch.device | str = "cuda",
    nvfp4: bool = True,
    seed: int = 0,
    mtp: bool = False,
    dense_head: bool = False,
) -> ModelWeights:
    """ModelWeights with random values at cfg's shapes: NVFP4 linears (in_proj_b/a dense bf16, as
    ModelOpt checkpoints leave them) or all dense bf16. Generated on `device`. `mtp=True` adds a random
    one-layer MTP head (drawn after everything else, so the target's values do not change).
    `dense_head=True` keeps the lm_head and the MTP head's linears bf16, as ModelOpt's NVFP4 checkpoints
    usually ship them (the lm_head in exclude_modules, mtp.* unquantised)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * std).to(bf)

    def lin(n: int, k: int, gain: float = 0.5, dense: bool = False) -> Linear:
        if nvfp4 and not dense:
            return _random_nvfp4(n, k, gen, device, gain)
        return DenseLinear(randn(n, k, std=gain / math.sqrt(k)))

    def norm(n: int) -> torch.Tensor:  # 1+w weights near 1
        return randn(n, std=0.1)

    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    nv, dv, C, K = (
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
        cfg.conv_dim,
        cfg.linear_conv_kernel_dim,
    )

    def attn(dense: bool = False) -> AttnWeights:
        return AttnWeights(
            q_proj=lin(nh * 2 * d, H, dense=dense),
            k_proj=lin(nkv * d, H, dense=dense),
            v_proj=lin(nkv * d, H, dense=dense),
            o_proj=lin(H, nh * d, dense=dense),
            q_norm=norm(d),
            k_norm=norm(d),
        )

    layers = []
    for kind in cfg.layer_types:
        if kind == FULL:
            mixer: GDNWeights | AttnWeights = attn()
        else:
            A = 1.0 + 15.0 * torch.rand(nv, device=device, generator=gen)  # HF init: A ~ U(1, 16)
            mixer = GDNWeights(
                in_proj_qkv=lin(C, H),
                in_proj_z=lin(nv * dv, H),
                in_proj_b=lin(nv, H, gain=1.0, dense=True),
                in_proj_a=lin(nv, H, gain=1.0, dense=True),
                conv1d=randn(C, K, std=0.5),
                dt_bias=torch.ones(nv, device=device, dtype=bf),
                A_log=torch.log(A).to(bf),
                norm=(1.0 + randn(dv, std=0.1).float()).to(bf),
                out_proj=lin(H, nv * dv),
            )
        mlp = MLPWeights(lin(I, H, gain=1.0), lin(I, H, gain=1.0), lin(H, I))
        layers.append(LayerWeights(norm(H), norm(H), mixer, mlp))
    embed, final_norm, lm_head = randn(V, H), norm(H), lin(V, H, gain=2.0, dense=dense_head)
    head = None
    if mtp:
        dh = dense_head
        a = attn(dense=dh)
        mlp_w = MLPWeights(lin(I, H, gain=1.0, dense=dh), lin(I, H, gain=1.0, dense=dh), lin(H, I, dense=dh))
        head = MTPWeights(
            fc=lin(H, 2 * H, dense=dh),
            pre_fc_norm_embedding=norm(H),
            pre_fc_norm_hidden=norm(H),
            layers=[LayerWeights(norm(H), norm(H), a, mlp_w)],
            norm=norm(H),
        )
    return ModelWeights(embed_tokens=embed, layers=layers, norm=final_norm, lm_head=lm_head, mtp=head)
