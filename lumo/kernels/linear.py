"""NVFP4 (W4A16) and BF16 linears: packing, launchers, fp32 references. Kernels in linear.cu.

M <= 32 rows: one batch-invariant GEMV/GEMM kernel (mma.sync, fixed K order). Larger M (prefill): the
packed weight is dequantised N-tile by N-tile into a bounded bf16 workspace and multiplied by cuBLAS.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..quant import nvfp4_dequantize
from .compile import Kernel, compile_kernel, sm_count
from .conv import conv_decode, conv_decode_operands
from .trace import on_trace_change, trace_defines

MT = 4  # m16 tiles per warp: the packed row group is 64 rows (must match linear.cu)
ROWS = 16 * MT
CHUNK = 64  # K columns per pipeline stage
KW = 4  # bf16 weights: a split-K slice's chunks go round-robin to KW accumulators (part of the K order)
SMALL_M = 32  # largest M served by the GEMV kernel
TARGET_WARPS = 1024  # nvfp4: ~8 row-group warps per H200 SM before split-K is worth its partial traffic
MIN_SPLITS = 4  # nvfp4: ... but at least this many slices below 2 * TARGET_WARPS row-group warps
MIN_SLICE_CHUNKS = 8
MAX_SPLITS = 16
TARGET_CTAS = 264  # bf16 K order: slices while row groups x slices < this (set for session 1's ring kernel)
MIN_WARP_CHUNKS = 1  # bf16_gemv: small-N shapes (the GDN b/a projection, 5120 -> 96) need every slice
PREFILL_WORKSPACE = 64 << 20  # bytes of bf16 dequantised weight per prefill tile


def _bit_positions() -> tuple[tuple[int, int, int, int], ...]:
    """Word bit of (m, e0, e1, sign) of fragment value q = (A.lo, A.hi, B.lo, ..., D.hi); linear.cu dequant8.

    Register r takes its value bits from rotl(w, rot): A 0, B 4, C 10; D takes m through rotl 6 and the rest
    through rotl 30. Targets: m, e0, e1 at bf16 bits 6, 7, 8 and the sign at 15 (+16 for the high half).
    """
    pos = []
    for q in range(8):
        reg, half = divmod(q, 2)
        bits = []
        for b, target in enumerate((6, 7, 8, 15)):
            rot = (0, 4, 10)[reg] if reg < 3 else (6 if b == 0 else 30)
            bits.append((target + 16 * half - rot) % 32)
        pos.append(tuple(bits))
    assert len({b for p in pos for b in p}) == 32
    return tuple(pos)


_BITS = _bit_positions()


@dataclass
class PackedNVFP4:
    """NVFP4 weight in the GEMV layout (see linear.cu). Fused shards are concatenated along N."""

    qw: torch.Tensor  # [RG, C, MT, 32, 16] uint8
    qs: torch.Tensor  # [RG, C, MT, 32] int16 (two e5m3 scale bytes)
    gs: torch.Tensor  # [RG * 64] f32, weight_scale_2 of each row's shard (0 on padding)
    n: int  # output features N
    k: int  # input features K
    splits: int  # split-K slices (fixed per weight: the K order never depends on M)
    shard_sizes: tuple[int, ...]  # N of each fused shard, in order
    partial: torch.Tensor | None  # [splits, 32, N] f32, made by the first launch that needs it (nvfp4_linear)
    # An MLP's [gate | up] packed for the fused SwiGLU (pack_fused(..., glu=True)): the intermediate size
    # I, the width of nvfp4_linear's output silu(gate) * up. 0: a plain linear.
    glu_n: int = 0

    @property
    def out_features(self) -> int:
        return self.glu_n or self.n

    @property
    def chunks(self) -> int:
        return self.qw.shape[1]

    @property
    def row_groups(self) -> int:
        return self.qw.shape[0]


def choose_splits(n: int, k: int) -> int:
    """Split-K slices of an NVFP4 weight: part of the K order, so a function of (N, K) only.

    Doubling while the row-group warps are fewer than TARGET_WARPS, and up to MIN_SPLITS below twice that
    (session 6, H200, bench_linear.py --splits: the 27B's fused gate+up, 544 row groups, ran 32.5 -> 30.8 us
    at M = 1 and 57.5 -> 54.6 at M = 32 with 4 slices instead of 2), while slices keep MIN_SLICE_CHUNKS."""
    rg, chunks = -(-n // ROWS), -(-k // CHUNK)
    s = 1
    while (
        (rg * s < TARGET_WARPS or s < MIN_SPLITS and rg * s < 2 * TARGET_WARPS)
        and chunks // (2 * s) >= MIN_SLICE_CHUNKS
        and s < MAX_SPLITS
    ):
        s *= 2
    return s


def _bf16_splits(n: int, k: int) -> int:
    rg, chunks = -(-n // ROWS), -(-k // CHUNK)
    s = 1
    while rg * s < TARGET_CTAS and chunks // (2 * s * KW) >= MIN_WARP_CHUNKS and s < MAX_SPLITS:
        s *= 2
    return s


def _encode_scales(weight_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K/16] -> e5m3 bytes with bf16 bits == (byte << 4) + (117 << 7) (exact)."""
    bits = weight_scale.float().abs().to(torch.bfloat16).view(torch.int16).int()
    byte = (bits - (117 << 7)) >> 4
    return torch.where(weight_scale.float() == 0, torch.zeros_like(byte), byte).clamp(0, 255)


def pack_nvfp4(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    splits: int | None = None,
) -> PackedNVFP4:
    """ModelOpt NVFP4 (weight u8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 f32) -> PackedNVFP4."""
    return pack_fused([(weight, weight_scale, weight_scale_2)], splits=splits)


def pack_fused(
    shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    splits: int | None = None,
    glu: bool = False,
) -> PackedNVFP4:
    """Concatenate NVFP4 shards along N (gate+up, q/k/v/z): one launch, each shard keeps its global scale.

    glu: the two shards are an MLP's gate and up projections (N = I each), packed for the fused SwiGLU:
    each m16 tile holds 8 gate rows then the same 8 rows of up (each shard zero padded to a multiple of 8
    rows), so the GEMV's epilogue can store silu(gate) * up [M, I] directly (linear.cu, GLU)."""
    if glu and (len(shards) != 2 or shards[0][0].shape != shards[1][0].shape):
        raise ValueError(
            f"glu packs two shards of one shape (gate, up), got {[tuple(w.shape) for w, _, _ in shards]}"
        )
    k = shards[0][0].shape[1] * 2
    for w, s, s2 in shards:
        if (
            w.dtype != torch.uint8
            or w.shape[1] * 2 != k
            or s.shape != (w.shape[0], k // 16)
            or s2.numel() != 1
        ):
            raise ValueError(f"bad NVFP4 shard: weight {tuple(w.shape)} scale {tuple(s.shape)}, K={k}")
    if k % 16:
        raise ValueError(f"NVFP4 K={k} must be a multiple of 16")
    device = shards[0][0].device
    codes = torch.cat([w for w, _, _ in shards]).to(device)  # [N, K/2] u8
    scales = torch.cat([s.float() for _, s, _ in shards]).to(device)  # [N, K/16] f32 (exact e4m3)
    gs = torch.cat([torch.full((w.shape[0],), float(s2), device=device) for w, _, s2 in shards])
    n = codes.shape[0]
    rg, chunks = -(-n // ROWS), -(-k // CHUNK)
    n_pad, k_pad = rg * ROWS, chunks * CHUNK

    # Unpack codes to [N, K] u8 nibbles; a negative scale moves into the code signs, a zero scale zeroes
    # the codes (the kernel's scale encoding has no zero).
    nib = torch.stack([codes & 0xF, codes >> 4], dim=-1).reshape(n, k)
    nib = nib ^ ((scales < 0).repeat_interleave(16, dim=1).to(torch.uint8) << 3)
    nib = nib * (scales != 0).repeat_interleave(16, dim=1).to(torch.uint8)
    sbyte = _encode_scales(scales)
    glu_n = 0
    if glu:  # rows (gate 8T .. 8T + 7, up 8T .. 8T + 7) for T = 0, 1, ...: each shard padded to 8i rows
        glu_n, i8 = n // 2, -(-n // 16) * 8
        nib, sbyte, gs = (_interleave8(t, glu_n, i8) for t in (nib, sbyte, gs))
        n = 2 * i8
        rg = -(-n // ROWS)
        n_pad = rg * ROWS
    nib = torch.nn.functional.pad(nib, (0, k_pad - k, 0, n_pad - n))  # [Np, Kp] u8
    sbyte = torch.nn.functional.pad(sbyte, (0, k_pad // 16 - k // 16, 0, n_pad - n))

    # nib[rg, p, h(0: row g, 1: row g+8), g, c, t, s, e(4 columns)] -> lane (g, t) word s.
    v = nib.view(rg, MT, 2, 8, chunks, 4, 4, 4)
    # fragment value q: (A.lo, A.hi, B.lo, B.hi, C.lo, C.hi, D.lo, D.hi) = (h, e) pairs below
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    word = torch.zeros(rg, chunks, MT, 8, 4, 4, dtype=torch.int64, device=device)  # [rg, c, p, g, t, s]
    for q, (h, e) in enumerate(order):
        val = v[:, :, h, :, :, :, :, e].permute(0, 3, 1, 2, 4, 5).long()  # [rg, c, p, g, t, s]
        for b in range(4):  # code bits m, e0, e1, sign
            word |= ((val >> b) & 1) << _BITS[q][b]
    qw = (word - ((word >> 31) << 32)).to(torch.int32)  # u32 -> i32 bit pattern
    qw = qw.contiguous().view(torch.uint8).view(rg, chunks, MT, 32, 16)

    sb = sbyte.view(rg, MT, 2, 8, chunks, 4)  # [rg, p, h, g, c, t]
    s16 = sb[:, :, 0] | (sb[:, :, 1] << 8)  # [rg, p, g, c, t]
    s16 = s16.permute(0, 3, 1, 2, 4).reshape(rg, chunks, MT, 32)
    qs = (s16 - ((s16 >> 15) << 16)).to(torch.int16).contiguous()

    splits = choose_splits(n, k) if splits is None else splits
    gs_pad = torch.nn.functional.pad(gs, (0, n_pad - n)).contiguous()
    sizes = (glu_n,) if glu else tuple(w.shape[0] for w, _, _ in shards)
    return PackedNVFP4(qw, qs, gs_pad, n, k, splits, sizes, None, glu_n)


def _interleave8(t: torch.Tensor, i: int, i8: int) -> torch.Tensor:
    """Rows [gate (i) | up (i)] -> [gate 0..7 | up 0..7 | gate 8..15 | ...], each half zero padded to i8."""
    gate, up = (torch.nn.functional.pad(h, (0, 0) * (t.dim() - 1) + (0, i8 - i)) for h in t.split(i))
    return torch.stack([gate.view(i8 // 8, 8, *t.shape[1:]), up.view(i8 // 8, 8, *t.shape[1:])], 1).reshape(
        2 * i8, *t.shape[1:]
    )


def split_fused(out: torch.Tensor, packed: PackedNVFP4) -> tuple[torch.Tensor, ...]:
    """Views of a fused output [M, N] per shard."""
    return tuple(out.split(packed.shard_sizes, dim=-1))


STAGES = 4  # nvfp4_gemv: the ring kernels' default stage count for _kernel
FP4_STAGES = {1: 6, 2: 4, 3: 4, 4: 3}  # nvfp4_gemv ring depth per NT (H200 sweep, docs/kernels.md)


def _compile(name: str, defines: dict[str, int], probe: int) -> Kernel:
    """A linear.cu kernel, compiled alone (LUMO_ONLY: NVRTC builds just that kernel of the file; sm_90 on
    2 CPU cores: 0.06-0.45 s against 2.7 s for the whole file); `probe` != 0 builds a LUMO_PROBE
    measurement variant (bench/probe_linear.py)."""
    defines = defines | {"LUMO_ONLY": 1, f"LUMO_ONLY_{name}": 1}
    if name == "nvfp4_gemv_rd":
        defines |= trace_defines()  # bench/trace_step.py only; empty otherwise
    return compile_kernel("linear", name, defines | ({"LUMO_PROBE": probe} if probe else {}))


@functools.cache
def _kernel(
    name: str, nt: int, stages: int = STAGES, kw: int = KW, rgw: int = 4, probe: int = 0, tpw: int = MT
) -> Kernel:
    return _compile(name, {"NT": nt, "MT": MT, "STAGES": stages, "KW": kw, "RGW": rgw, "TPW": tpw}, probe)


def _fp4_stage_bytes(nt: int, rgw: int) -> int:
    return nt * 1024 + rgw * MT * 576


def choose_rgw(row_groups: int, splits: int, nt: int) -> int:
    """Row groups (warps) per CTA: as many as keep >= 2 CTAs per SM (x is read once per CTA). Launch-only."""
    if nt == 1:
        return 4  # x is a few hundred bytes per chunk: nothing to share
    for rgw in (8, 4):
        if -(-row_groups // rgw) * splits >= 264:
            return rgw
    return 2


@functools.cache
def smem_limit(device: torch.device) -> int:
    """Dynamic shared memory one CTA may opt into: 227 KB on the H100 / H200 and B200, 99 KB on sm_86 / 89
    and the sm_120 family (GB10 included)."""
    if device.type != "cuda":
        return 227 * 1024
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def fit_stages(stages: int, stage_bytes: int, device: torch.device) -> int:
    """The pipeline depth, lowered until the ring fits the device's shared memory (a launch choice only:
    the stage count never changes a result bit)."""
    fit = min(stages, smem_limit(device) // stage_bytes)
    if fit < 2:
        raise RuntimeError(f"a {stage_bytes}-byte pipeline stage does not fit twice in shared memory")
    return fit


def _check_x(x: torch.Tensor, k: int) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
        raise ValueError(f"x must be contiguous bf16 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")


def _out(x: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
    if out.dtype != torch.bfloat16 or out.shape != (x.shape[0], n) or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous bf16 [{x.shape[0]}, {n}], got {out.dtype} {tuple(out.shape)}"
        )
    return out


def _reduce(partial: torch.Tensor, gs: object, out: torch.Tensor, m: int, n: int, splits: int) -> None:
    _kernel("splitk_reduce", 1).launch(-(-(m * n) // 256), 256, [partial, gs, out, m, n, splits], pdl=True)


def _launch_bf16(
    w: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor,
    partial: torch.Tensor | None,
    splits: int,
    rd: bool | None = None,
    reg: tuple[int, int, int] | None = None,
    reduce: bool = True,
) -> None:
    m, (n, k) = x.shape[0], w.shape
    rg, chunks = -(-n // ROWS), -(-k // CHUNK)
    nt, cps = -(-m // 8), -(-chunks // splits)
    if rd is None:
        rd = reg is None and rg * splits < sm_count(x.device)
    if rd and reg is not None:
        raise ValueError("rd=True names the one-warp kernel: not with reg")
    if reg is not None and (len(reg) != 3 or min(reg) < 1 or reg[1] % reg[2]):
        raise ValueError(f"reg must be (MT, RPF, XPF) >= 1 with XPF dividing RPF, got {reg}")
    part = partial if splits > 1 else out
    if rd:
        # One warp per (m16 tile, slice), no shared memory: small CTAs beside a concurrent GEMV's.
        kern = _bf16_rd_kernel(nt)
        kern.launch((-(-n // 16), splits), 32, [w, x, out, part, m, n, k, chunks, cps], pdl=True)
    else:
        mt, rpf, xpf = reg or BF16_REG[nt]
        kern = _bf16_kernel(nt, mt, rpf, xpf)
        shmem = (KW - 1) * mt * nt * 512  # the warps' sum
        grid = (-(-n // (16 * mt)), splits)
        kern.launch(grid, 32 * KW, [w, x, out, part, m, n, k, chunks, cps], shmem, pdl=True)
    if splits > 1 and reduce:
        _reduce(partial, ctypes.c_void_p(0), out, m, n, splits)  # bf16 weights: no global scale


# bf16_gemv_rd's chunks in flight per warp (a divisor of KW), at M <= 8 and above.
BF16_RD_PF = (4, 2)

# bf16_gemv's (MT, RPF, XPF) per NT: m16 tiles per warp, weight and activation chunks in flight.
BF16_REG = {1: (1, 2, 2), 2: (1, 2, 2), 3: (2, 2, 1), 4: (2, 2, 1)}


@functools.cache
def _bf16_rd_kernel(nt: int) -> Kernel:
    return _compile("bf16_gemv_rd", {"NT": nt, "KW": KW, "BPF": BF16_RD_PF[nt > 1]}, 0)


@functools.cache
def _bf16_kernel(nt: int, mt: int, rpf: int, xpf: int) -> Kernel:
    return _compile("bf16_gemv", {"NT": nt, "MT": mt, "KW": KW, "RPF": rpf, "XPF": xpf}, 0)


@functools.cache
def _clusters(device: torch.device) -> bool:
    """Thread-block clusters (sm_90+) reduce the split-K slices of a tile in distributed shared memory."""
    return torch.cuda.get_device_capability(device)[0] >= 9


# (MTW, PF) of the register-direct in-CTA split-K kernel by split-K slice count, for M up to the first
# number; a missing entry runs nvfp4_gemv (one slice) or the cluster-reduced nvfp4_gemv_cl. From the H200
# sweeps of bench/bench_linear.py (docs/kernels.md): at M <= 8 it won at every slice count (the lm_head's
# one slice included: 172.6 us at M = 1 against 209 for nvfp4_gemv); at M = 16 too (16 slices since
# session 18), at M = 32 up to 8 slices (below). The lm_head at M = 1 takes PF 3:
# 169.7 us against 177 with PF 4 (sessions 8 and 9, bench_linear_session9_l2pf.log). At M = 1 one tile
# and PF 2 for 4 and 8 slices (session 12: gate+up 29.5 -> 27.7 us, attention q/k/v 14.9 -> 13.9, GDN
# q/k/v/z 16.5 -> 15.7, bench_linear_session12_spw_xs.log; the 27B decode step at 1k 5.66 -> 5.54 ms).
# At 16 < M <= 32 with 8 slices two tiles and PF 2 replaced nvfp4_gemv_sx (session 15,
# bench_linear_session15_m32.log, us): at M = 32 in clusters of two CTAs (RD_CLUSTERS) 6144 -> 5120 15.5 ->
# 12.9, attention q/k/v 27.4 -> 26.5, 5120 -> 6144 14.2 -> 11.1, 5120 -> 10240 19.5 -> 19.0; at M = 24 in
# one CTA 14.1 -> 11.9, 24.2 -> 18.6, 12.6 -> 10.7, 20.3 -> 15.8 (there the clusters ran 12.6, 20.6, 12.1,
# 17.5). At 8 < M <= 16 the 16-slice weights take two tiles and PF 2 too (session 18,
# bench_linear_session18_nt2.log, us at M = 12 / 16: the down projection 29.5 / 29.7 in the cluster-reduced
# ring kernel, 23.8 / 24.2 so; the MTP head's fc 19.0 / 19.1 against 16.0 / 16.2); at M = 32 that build
# loses there (65.4 against 29.2, bench_linear_session18_pfx.log). The 4-slice weights take four tiles per
# warp at M = 32 only: at M = 24 two (session 18, bench_linear_session18_pf1.log, us: gate+up 50.2 -> 43.4,
# GDN q/k/v/z 21.3 -> 19.2; at M = 32 four tiles stay ahead for q/k/v/z, 22.2 against 27.7, and gate+up is
# narrowed to two anyway).
RD_CHOICE = (
    (1, {1: (2, 3), 2: (1, 2), 4: (1, 2), 8: (1, 2), 16: (1, 2)}),
    (8, {1: (2, 2), 2: (1, 2), 4: (2, 4), 8: (1, 3), 16: (1, 2)}),
    (16, {1: (2, 2), 2: (2, 2), 4: (2, 2), 8: (2, 2), 16: (2, 2)}),
    (24, {1: (2, 2), 2: (2, 2), 4: (2, 2), 8: (2, 2)}),
    (SMALL_M, {1: (2, 2), 2: (2, 2), 4: (4, 2), 8: (2, 2)}),
)


def choose_rd(splits: int, m: int) -> tuple[int, int] | None:
    """(MTW, PF) of nvfp4_gemv_rd for a weight of `splits` slices and M <= 32 rows, or None for
    nvfp4_gemv(_cl). A launch choice only: every kernel gives the bits of nvfp4_gemv + splitk_reduce."""
    return next(table for top, table in RD_CHOICE if m <= top).get(splits)


WAVE_MARGIN = 0.1  # a narrower tile must fill the last wave by this much more to replace the table's


def wave_fill(ctas: int, per_sm: int, sms: int) -> float:
    """Share of the CTA slots of the waves a grid of `ctas` occupies that hold a CTA (1.0: whole waves;
    0.0 where no CTA fits an SM)."""
    slots = per_sm * sms
    return ctas / (-(-ctas // slots) * slots) if slots > 0 else 0.0


@functools.cache  # on every launch's path: one answer per shape
def _rd_fit_waves(
    rd: tuple[int, int],
    tiles: int,
    nt: int,
    splits: int,
    device: torch.device,
    glu: bool = False,
    conv: int = 0,
) -> tuple[int, int]:
    """The table's (MTW, PF), or half its tile width (same PF) where that fills the device's CTA slots
    better by WAVE_MARGIN: twice the CTAs of fewer registers can fill whole waves where the wide tile leaves
    a last wave mostly empty (session 6, H200, M = 32, 4 slices: gate+up's 544 four-tile CTAs at 2 per SM
    ran 68.6 us, its 1088 two-tile CTAs at 3 per SM 54.6; GDN q/k/v/z, 256 four-tile CTAs, stays: 27.4 us
    against 32.8). At NT >= 3 never below two tiles: a one-tile warp reads as many bytes of activations as
    a two-tile one for half the weights, and every one-tile build measured there lost whatever its wave fill
    (session 15, bench_linear_session15_m32.log: 5120 -> 10240 at M = 24, 8 slices, 20.7 us against 15.7 for
    two tiles; at M = 32 gate+up 72.9 against 47.2, 6144 -> 5120 19.8 against 15.5), nor at NT = 2 with 16
    slices (session 18, bench_linear_session18_nt2.log: the down projection at M = 16 25.5 us against 24.2,
    the MTP head's fc 17.8 against 16.2; at 4 and 8 slices the narrower tile won as often as it lost). A
    launch choice only (same bits). `conv`: the fused decode conv's taps (the build judged is the one
    launched)."""
    mtw, pf = rd
    if mtw == 1 or (mtw == 2 and (nt >= 3 or splits == MAX_SPLITS)):
        return rd
    sms = sm_count(device)

    def fill(w: int) -> float:  # the build the default launch would run at width w
        cl = _rd_default_cluster(nt, w, pf, splits, tiles // MT, 0, glu, device, conv)
        grid, block, shmem = _rd_shape(tiles // MT, nt, w, splits, cl)
        per_sm = _rd_kernel(nt, w, pf, splits, glu=glu, rdcl=cl, conv=conv).blocks_per_sm(block, shmem)
        return wave_fill(grid[0] * cl, per_sm, sms)

    return (mtw // 2, pf) if fill(mtw // 2) > fill(mtw) + WAVE_MARGIN else rd


# Minimum resident CTAs per SM (`__launch_bounds__`) of nvfp4_gemv_rd configs whose natural register
# count lands a few registers above an occupancy step: (NT, MTW, PF, slices) -> CTAs. The bound keeps the
# step without a spill in the loop (sm_90 and sm_121a: (1, 1, 3, 8) 69 -> 64 registers, 4 CTAs of 8
# warps instead of 3; one 8-byte spill outside the loop). A launch choice only (same bits).
RD_MIN_BLOCKS = {(1, 1, 3, 8): 4, (2, 2, 2, 4): 5, (2, 2, 2, 2): 10, (2, 2, 2, 1): 20}


# Weight bytes a register-direct or shared-activation GEMV asks L2 for before its pdl_wait (linear.cu,
# prefetch_chunks): the first chunks of every warp's slice, as many as fit this budget. In the decode step
# the GEMVs follow small row kernels, during which the DRAM would idle. H200, 27B decode step at 1k
# (session 9, three A/B pairs, bench_decode_session9_ab.log): 0 MiB 6.18 / 6.04 / 6.03 ms, 16 MiB 6.07 /
# 5.95 / 5.94; 8 MiB no change, 32 MiB none either (it evicts what it fetched). Back-to-back launches of
# one GEMV (bench_linear.py, "dflt@16") gain nothing: there the previous kernel keeps the DRAM busy.
L2_PREFETCH_BYTES = 16 << 20


def prefetch_chunks(row_groups: int, splits: int, cps: int, budget: int) -> int:
    """How many leading chunks of each warp's split-K slice fit `budget` bytes of L2 prefetch (every
    warp of the grid prefetches the same count; a chunk of one m16 tile is 576 bytes with its scales)."""
    if budget < 0:
        raise ValueError(f"l2pf must be >= 0 bytes, got {budget}")
    return min(cps, budget // (row_groups * MT * splits * 576))


# nvfp4_gemv_rd configs launched as clusters of CTAs of fewer warps (sm_90+): (NT, MTW, PF, slices) -> (CTAs
# per cluster, minimum resident CTAs per SM). The 27B's down projection at M = 1 (16 slices, 320 one-tile
# CTAs of 16 warps at 54 registers, two per SM) runs 1.21 waves; as 640 CTAs of 8 warps, at most 48
# registers (five per SM), it fits one wave. At 24 < M <= 32 the 8-slice weights run two-tile CTAs of four
# warps in pairs (RD_CHOICE above): at NT = 4 a CTA of all eight slices needs ~40K registers (one per SM),
# a pair's CTA 20K (three). At NT = 3 (128 registers, two CTAs of eight warps per SM) one CTA was faster.
# A launch choice only (same bits).
RD_CLUSTERS = {(1, 1, 2, 16): (2, 5), (4, 2, 2, 8): (2, 1)}


def _rd_cluster_fits(
    nt: int,
    mtw: int,
    pf: int,
    splits: int,
    rdcl: int,
    rg: int,
    probe: int,
    glu: bool,
    device: torch.device,
    conv: int = 0,
) -> bool:
    """Whether the device schedules nvfp4_gemv_rd's slices in clusters of `rdcl` CTAs (1: always)."""
    if rdcl == 1:
        return True
    if not _clusters(device):
        return False
    kern = _rd_kernel(nt, mtw, pf, splits, probe, glu, rdcl, conv)
    return kern.max_cluster_size(*_rd_shape(rg, nt, mtw, splits, rdcl)) >= rdcl


def _rd_default_cluster(
    nt: int,
    mtw: int,
    pf: int,
    splits: int,
    rg: int,
    probe: int,
    glu: bool,
    device: torch.device,
    conv: int = 0,
) -> int:
    """CTAs per cluster of nvfp4_gemv_rd's default launch: RD_CLUSTERS' entry, or 1 where the device cannot
    schedule that cluster (one CTA holds every slice)."""
    rdcl = RD_CLUSTERS.get((nt, mtw, pf, splits), (1, 1))[0]
    return rdcl if _rd_cluster_fits(nt, mtw, pf, splits, rdcl, rg, probe, glu, device, conv) else 1


def _rd_shape(
    rg: int, nt: int, mtw: int, splits: int, rdcl: int, stage_cps: int = 0
) -> tuple[tuple[int, int, int], int, int]:
    """nvfp4_gemv_rd's grid, block and dynamic shared memory (a CTA of splits / rdcl warps, a slice each;
    `stage_cps`: the chunks per slice a staged build (STG) holds, 576 bytes per chunk and tile)."""
    ksw = splits // rdcl
    return (rg * MT // mtw, rdcl, 1), 32 * ksw, ksw * mtw * (nt * 512 + stage_cps * 576)


@functools.cache
def _rd_kernel(
    nt: int,
    mtw: int,
    pf: int,
    splits: int,
    probe: int = 0,
    glu: bool = False,
    rdcl: int = 1,
    conv: int = 0,
    stage: bool = False,
) -> Kernel:
    defines = {"NT": nt, "MT": MT, "MTW": mtw, "PF": pf, "KSW": splits // rdcl} | ({"GLU": 1} if glu else {})
    defines |= {"CONV": conv} if conv else {}  # the decode conv's taps, fused into the epilogue
    defines |= {"STG": 1} if stage else {}  # the slice's weights staged in shared memory before pdl_wait
    if rdcl > 1:
        cl, minb = RD_CLUSTERS.get((nt, mtw, pf, splits), (rdcl, 1))
        minb = minb if cl == rdcl else 1
        defines["RDCL"] = rdcl
    else:
        minb = RD_MIN_BLOCKS.get((nt, mtw, pf, splits), 1)
    return _compile("nvfp4_gemv_rd", defines | ({"RD_MINB": minb} if minb > 1 else {}), probe)


on_trace_change(_rd_kernel.cache_clear)  # bench/trace_step.py's buffer is compiled into the builds


def _stage_fits(
    grid: tuple[int, int, int], block: int, shmem: int, rdcl: int, device: torch.device, build: Callable
) -> bool:
    """Whether a staged nvfp4_gemv_rd launch (STG; `build()` compiles it) holds its whole grid at once: the
    CTA's shared memory within the device's limit, one wave of CTAs covering the grid, and the device
    scheduling its clusters of `rdcl` CTAs with that shared memory. Later CTAs would load their weights
    only when placed, after the wait, with nothing in flight: slower than the register ring."""
    if shmem > smem_limit(device):
        return False
    kern = build()
    if rdcl > 1 and kern.max_cluster_size(grid, block, shmem) < rdcl:
        return False
    return grid[0] * grid[1] <= kern.blocks_per_sm(block, shmem) * sm_count(device)


def nvfp4_linear(
    x: torch.Tensor,
    packed: PackedNVFP4,
    out: torch.Tensor | None = None,
    stages: int | None = None,
    rgw: int | None = None,
    cluster: bool | None = None,
    rd: tuple[int, int] | bool | None = None,
    probe: int = 0,
    splits: int | None = None,
    tpw: int | None = None,
    sx: tuple[int, int, int] | bool | None = None,
    l2pf: int | None = None,
    rows: torch.Tensor | None = None,
    rdcl: int | None = None,
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    stage: bool = False,
) -> torch.Tensor:
    """y = x @ W^T for bf16 x [M, K] and a packed NVFP4 W [N, K]; bf16 [M, N]. For a fused-SwiGLU weight
    (pack_fused(glu=True)) silu(gate) * up [M, I]; `rows`, a contiguous bf16 [>= M, packed.n] buffer, then
    holds the interleaved rows where the kernel does not fuse the activation (made per call if None).

    `conv` = (w [C, K], state [C, K-1], yc [1, C]): the GDN decode conv of one token (M = 1) over the first
    C <= N output columns, conv_decode(y[:, :C], w, state, out=yc) after the GEMV (y is returned whole). The
    register-direct kernel (the default at M = 1) runs it in its epilogue, one launch fewer; the other
    kernels are followed by conv_decode. The same bits either way (linear.cu, CONV).

    `stage`: where the register-direct kernel runs and one wave of its CTAs can hold the whole weight in
    shared memory, every CTA copies its weights there before it waits for the previous kernel (linear.cu,
    STG), so a GEMV that follows latency-bound row kernels streams its weight while they run; elsewhere
    (other kernels, too little shared memory, a `probe`) the usual launch. The same bits either way; for
    callers that know what runs before (the decode step's GDN out-projection).

    Benchmark knobs, none of which changes the result bits: `rd`: (MTW, PF) forces the register-direct
    in-CTA split-K kernel (the others are then ignored), False forbids it; setting `stages`, `rgw`, `tpw` or
    `cluster` also turns off the automatic choice of `rd` and picks among the ring kernels: `stages` /
    `rgw` (ring depth, row groups per CTA) and `tpw` (m16 tiles per warp: 1, 2 or 4) of the cross-CTA
    kernel, `cluster` True / False forces / forbids the cluster-reduced split-K (sm_90+). `sx`: (warps,
    MTW, PF) forces nvfp4_gemv_sx (the slice's activations in shared memory; cluster-reduced unless
    `cluster` is False; not together with `rd`), False keeps the default launch from choosing it.
    `l2pf`: bytes of the weight the register-direct and shared-activation kernels ask L2 for before they
    wait for the previous kernel (default L2_PREFETCH_BYTES; 0: none). `rdcl`: the register-direct kernel's
    slices spread over clusters of that many CTAs (a divisor of the slice count; > 1 needs sm_90+; default
    RD_CLUSTERS, falling back to one CTA where the device cannot schedule that cluster).
    `probe` (bench/probe_linear.py) runs a measurement variant of the kernel instead (linear.cu
    LUMO_PROBE: 1 without the arithmetic, 2 with L2-resident weights: meaningless output; 3 with the
    dequant's shifts as integer products: the same bits).
    `splits` (bench/bench_linear.py --splits) launches with that many split-K slices instead of the weight's
    own `choose_splits`: another K order, so other result bits; never set by the library.
    """
    _check_x(x, packed.k)
    out = _out(x, packed.out_features, out)
    m = x.shape[0]
    if m == 0:
        return out
    # A fused-SwiGLU weight: nvfp4_gemv_rd applies silu(gate) * up in its epilogue; every other path
    # computes the interleaved rows into `rows`, then _glu_act gives the same bits.
    rows = _glu_rows(rows, m, packed, x.device) if packed.glu_n else None
    conv_c, conv_k = _conv_operands(conv, m, packed) if conv is not None else (0, 0)
    if m > SMALL_M:
        y = _prefill(x, packed, rows() if rows else out)
        return _glu_act(y, out) if rows else y
    rg, chunks = packed.row_groups, packed.chunks
    if splits is None:
        splits = packed.splits
    elif not 1 <= splits <= min(MAX_SPLITS, chunks):
        raise ValueError(f"splits must be in 1..{min(MAX_SPLITS, chunks)}, got {splits}")
    nt = -(-m // 8)
    cps = -(-chunks // splits)
    npf = 0 if probe else prefetch_chunks(rg, splits, cps, L2_PREFETCH_BYTES if l2pf is None else l2pf)
    if rd and sx:
        raise ValueError("rd and sx name two different kernels: give one")
    if not sx and rd is None and stages is None and rgw is None and cluster is None and tpw is None:
        rd = choose_rd(splits, m)
        if rd:
            rd = _rd_fit_waves(rd, rg * MT, nt, splits, x.device, bool(packed.glu_n), conv_k)
        elif sx is None and _sx_fits(rg, splits, cps, nt, x.device):
            sx = SX_DEFAULT
    if rd:
        if not isinstance(rd, tuple) or len(rd) != 2 or rd[0] not in (1, 2, 4) or rd[1] < 1:
            raise ValueError(f"rd must be (MTW in 1, 2, 4; PF >= 1), got {rd!r}")
        mtw, pf = rd
        glu = bool(packed.glu_n)
        if rdcl is None:
            rdcl = _rd_default_cluster(nt, mtw, pf, splits, rg, probe, glu, x.device, conv_k)
        elif rdcl < 1 or splits % rdcl:
            raise ValueError(f"rdcl must divide the {splits} slices, got {rdcl}")
        elif not _rd_cluster_fits(nt, mtw, pf, splits, rdcl, rg, probe, glu, x.device, conv_k):
            raise ValueError(f"the device cannot schedule nvfp4_gemv_rd in clusters of {rdcl} CTAs")
        stage = stage and not probe  # a probe build measures the usual kernel
        if stage:
            grid, block, shmem = _rd_shape(rg, nt, mtw, splits, rdcl, stage_cps=cps)
            build = functools.partial(_rd_kernel, nt, mtw, pf, splits, 0, glu, rdcl, conv_k, stage=True)
            stage = _stage_fits(grid, block, shmem, rdcl, x.device, build)
            kern = build() if stage else None
        if not stage:
            kern = _rd_kernel(nt, mtw, pf, splits, probe, glu, rdcl, conv_k)
            grid, block, shmem = _rd_shape(rg, nt, mtw, splits, rdcl)
        args = [packed.qw, packed.qs, packed.gs, x, out, m, packed.out_features, packed.k, chunks, cps, npf]
        args += [*conv, conv_c] if conv is not None else []
        if shmem > smem_limit(x.device):
            raise ValueError(f"rd={rd!r} with {splits} slices needs {shmem} bytes of shared memory per CTA")
        kern.launch(grid, block, args, shmem, pdl=True, cluster=(1, rdcl, 1) if rdcl > 1 else None)
        return out
    if rdcl is not None:
        raise ValueError("rdcl applies to the register-direct kernel only (rd)")
    if sx:
        ok = isinstance(sx, tuple) and len(sx) == 3 and 1 <= sx[0] <= 32 and sx[1] in (1, 2, 4) and sx[2] >= 1
        if not ok or (sx[0] * sx[1]) % MT:
            raise ValueError(
                f"sx must be (warps in 1..32, MTW in 1, 2, 4, PF >= 1) with warps * MTW a multiple of {MT}, "
                f"got {sx!r}"
            )
    y = rows() if rows else out  # the kernels below write a fused-SwiGLU weight's interleaved rows
    if sx:
        _launch_sx(x, packed, y, sx, splits, cps, cluster, probe, npf)
    else:
        _launch_ring(x, packed, y, splits, cps, stages, rgw, tpw, cluster, probe)
    if conv is not None:
        conv_decode(y[:, :conv_c], conv[0], conv[1], out=conv[2])
    return _glu_act(y, out) if rows else y


def _conv_operands(
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], m: int, packed: PackedNVFP4
) -> tuple[int, int]:
    """(C, K) of nvfp4_linear's `conv` operands, checked."""
    if not isinstance(conv, tuple) or len(conv) != 3:
        raise ValueError("conv must be (w [C, K], state [C, K-1], out [1, C])")
    if m != 1 or packed.glu_n:
        what = "a fused-SwiGLU weight" if packed.glu_n else f"M = {m}"
        raise ValueError(f"conv is the one-token (M = 1) decode conv of a plain weight, got {what}")
    C, K = conv_decode_operands(*conv)
    if C > packed.out_features:
        raise ValueError(f"conv over {C} channels of a weight with {packed.out_features} outputs")
    return C, K


def _launch_ring(
    x: torch.Tensor,
    packed: PackedNVFP4,
    out: torch.Tensor,
    splits: int,
    cps: int,
    stages: int | None,
    rgw: int | None,
    tpw: int | None,
    cluster: bool | None,
    probe: int,
) -> None:
    """nvfp4_gemv_cl (the split-K slices summed in a cluster, sm_90+) or nvfp4_gemv + splitk_reduce: the
    cp.async-ring kernels, with nvfp4_linear's knobs (None: the library's choice)."""
    m, rg, chunks = x.shape[0], packed.row_groups, packed.chunks
    nt = -(-m // 8)
    if cluster is None:  # H200: M = 32 4-18 % faster per shape, verify 15.36 -> 14.66 ms; M <= 8 +-4 %
        cluster = nt > 1 and 1 < splits <= MAX_SPLITS and _clusters(x.device)
    auto_tiles = tpw is None and rgw is None
    rgw = rgw or choose_rgw(rg, splits, nt)
    if auto_tiles and cluster and rgw == 2 and splits <= 8 and nt > 2:
        # Few row groups: two m16 tiles per warp, twice the warps (session 6, H200, M = 32, 8 slices:
        # 6144 -> 5120 18.9 -> 16.9 us, 5120 -> 6144 17.7 -> 16.1; with 4 row groups per CTA it was a wash,
        # attention q/k/v 29.3 -> 27.8 but 5120 -> 10240 19.6 -> 21.9, and at 16 slices slower).
        tpw = 2
    tpw = tpw or MT
    if tpw not in (1, 2, 4):
        raise ValueError(f"tpw must be 1, 2 or 4, got {tpw!r}")
    block = 32 * rgw * (MT // tpw)
    stages = stages or fit_stages(FP4_STAGES[nt], _fp4_stage_bytes(nt, rgw), x.device)
    if cluster and splits > 1:
        shmem = max(stages * _fp4_stage_bytes(nt, rgw), rgw * MT * nt * 512)
        kern = _kernel("nvfp4_gemv_cl", nt, stages, KW, rgw, probe, tpw)
        grid = (-(-rg // rgw), splits, 1)
        if kern.max_cluster_size(grid, block, shmem) >= splits:  # else the cross-CTA kernel below
            args = [packed.qw, packed.qs, packed.gs, x, out, m, packed.n, packed.k, rg, chunks, cps]
            kern.launch(grid, block, args, shmem, pdl=True, cluster=(1, splits, 1))
            return
    part = _partials(packed, splits, out)
    args = [packed.qw, packed.qs, packed.gs, x, out, part, m, packed.n, packed.k, rg, chunks, cps]
    kern = _kernel("nvfp4_gemv", nt, stages, KW, rgw, probe, tpw)
    kern.launch((-(-rg // rgw), splits), block, args, stages * _fp4_stage_bytes(nt, rgw), pdl=True)
    if splits > 1:
        _reduce(part, packed.gs, out, m, packed.n, splits)


def _glu_rows(buf: torch.Tensor | None, m: int, packed: PackedNVFP4, device: torch.device):
    """A maker of the interleaved-rows buffer [m, packed.n] of a fused-SwiGLU weight: a view of `buf`."""
    if buf is None:
        return lambda: torch.empty(m, packed.n, dtype=torch.bfloat16, device=device)
    if buf.dtype != torch.bfloat16 or buf.dim() != 2 or buf.shape[0] < m or buf.shape[1] != packed.n:
        raise ValueError(f"rows must be bf16 [>= {m}, {packed.n}], got {buf.dtype} {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise ValueError("rows must be contiguous")
    return lambda: buf[:m]


def _glu_act(rows: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """act [M, I] = silu(gate) * up from a fused-SwiGLU weight's interleaved GEMV rows [M, 2 * I8] (blocks
    of 8 gate then 8 up columns): silu_mul over rows of 16, the bits of nvfp4_gemv_rd's GLU epilogue."""
    from .norms import silu_mul

    m, i = act.shape
    if rows.shape[1] == 2 * i:
        silu_mul(rows.view(-1, 16), out=act.view(-1, 8))
    else:
        act.copy_(silu_mul(rows.view(-1, 16)).view(m, -1)[:, :i])
    return act


# nvfp4_gemv_sx's (warps, MTW, PF) where it replaces the cluster-reduced ring kernel. Session 8, H200,
# M = 32 (bench/results/bench_linear_session8_sx.log): 5120 -> 6144 16.4 -> 13.9 us, 6144 -> 5120 16.9 ->
# 15.3, 5120 -> 14336 29.7 -> 28.1; slower where its grid runs 1.21 waves (5120 -> 10240 19.4 -> 22.4,
# 17408 -> 5120 29.5 -> 30.1) and at M <= 16 on most shapes.
SX_DEFAULT = (8, 2, 3)
SX_MIN_FILL = 0.8  # a grid of more than one wave must fill its waves' CTA slots this well


@functools.cache  # on every launch's path: one answer per shape
def _sx_fits(row_groups: int, splits: int, cps: int, nt: int, device: torch.device) -> bool:
    """Whether the default launch takes nvfp4_gemv_sx: M > 16, a weight without a register-direct config
    (the cluster path), clusters available, the slice's activations in shared memory, and a grid of one
    wave or of well-filled waves. A launch choice only (same bits)."""
    if nt <= 2 or splits < 2 or not _clusters(device):
        return False
    grid, shmem = _sx_shape(SX_DEFAULT, row_groups, splits, cps, nt)
    if shmem > smem_limit(device):
        return False
    sxw, mtw, pf = SX_DEFAULT
    kern = _sx_kernel("nvfp4_gemv_sx_cl", nt, sxw, mtw, pf)
    if kern.max_cluster_size(grid, 32 * sxw, shmem) < splits:
        return False
    per_sm, sms = kern.blocks_per_sm(32 * sxw, shmem), sm_count(device)
    ctas = grid[0] * splits
    return 0 < ctas <= per_sm * sms or wave_fill(ctas, per_sm, sms) >= SX_MIN_FILL


def _sx_shape(
    sx: tuple[int, int, int], row_groups: int, splits: int, cps: int, nt: int
) -> tuple[tuple[int, int, int], int]:
    """nvfp4_gemv_sx's grid and dynamic shared memory: the slice's activations, or the cluster epilogue's
    partials where those are larger."""
    sxw, mtw, _ = sx
    return (-(-row_groups * MT // (sxw * mtw)), splits, 1), max(cps * nt * 1024, sxw * mtw * nt * 512)


@functools.cache
def _sx_kernel(name: str, nt: int, sxw: int, mtw: int, pf: int, probe: int = 0) -> Kernel:
    return _compile(name, {"NT": nt, "MT": MT, "MTW": mtw, "PF": pf, "SXW": sxw}, probe)


def _partials(packed: PackedNVFP4, splits: int, out: torch.Tensor) -> torch.Tensor:
    """Where a split-K kernel without clusters writes its fp32 partials: `out` itself for one slice."""
    if splits == 1:
        return out
    if splits != packed.splits:  # the benchmark knob: a partial buffer of its own
        return torch.empty(splits, SMALL_M, packed.n, device=out.device)
    if packed.partial is None:
        # Only here does a weight need its split-K partials: a slice count the other kernels do not serve
        # by default (clusters unavailable or forced off, or a knob). Allocated once, for 32 rows (a capture
        # allocates it from its pool). runner.memory_plan counts it where it can happen.
        packed.partial = torch.empty(splits, SMALL_M, packed.n, device=out.device)
    return packed.partial


def _launch_sx(
    x: torch.Tensor,
    packed: PackedNVFP4,
    out: torch.Tensor,
    sx: tuple[int, int, int],
    splits: int,
    cps: int,
    cluster: bool | None,
    probe: int,
    npf: int,
) -> torch.Tensor:
    """nvfp4_gemv_sx(_cl): the slice's activations in shared memory, weights register-direct."""
    m, (sxw, mtw, pf) = x.shape[0], sx
    nt, rg, chunks = -(-m // 8), packed.row_groups, packed.chunks
    grid, shmem = _sx_shape(sx, rg, splits, cps, nt)
    if shmem > smem_limit(x.device):
        raise ValueError(f"sx={sx!r}: a slice's activations need {shmem} bytes of shared memory per CTA")
    if splits > 1 and (_clusters(x.device) if cluster is None else cluster):
        kern = _sx_kernel("nvfp4_gemv_sx_cl", nt, sxw, mtw, pf, probe)
        if kern.max_cluster_size(grid, 32 * sxw, shmem) >= splits:
            args = [packed.qw, packed.qs, packed.gs, x, out, m, packed.n, packed.k, rg, chunks, cps, npf]
            kern.launch(grid, 32 * sxw, args, shmem, pdl=True, cluster=(1, splits, 1))
            return out
    part = _partials(packed, splits, out)
    args = [packed.qw, packed.qs, packed.gs, x, out, part, m, packed.n, packed.k, rg, chunks, cps, npf]
    _sx_kernel("nvfp4_gemv_sx", nt, sxw, mtw, pf, probe).launch(grid, 32 * sxw, args, shmem, pdl=True)
    if splits > 1:
        _reduce(part, packed.gs, out, m, packed.n, splits)
    return out


def _prefill(x: torch.Tensor, packed: PackedNVFP4, out: torch.Tensor) -> torch.Tensor:
    # Dequantise a bounded N-tile of the weight at a time (never a full bf16 copy of a big layer).
    k = packed.k
    tile_rg = max(1, PREFILL_WORKSPACE // (ROWS * k * 2))
    tile_rg = min(tile_rg, packed.row_groups)
    ws = torch.empty(tile_rg * ROWS, k, dtype=torch.bfloat16, device=x.device)
    kern = _kernel("nvfp4_dequant", 1)
    for rg0 in range(0, packed.row_groups, tile_rg):
        nrg = min(tile_rg, packed.row_groups - rg0)
        n0, n1 = rg0 * ROWS, min(packed.n, (rg0 + nrg) * ROWS)
        threads = nrg * packed.chunks * MT * 32
        kern.launch(
            -(-threads // 256),
            256,
            [packed.qw, packed.qs, packed.gs, ws, rg0, nrg, packed.n, k, packed.chunks],
        )
        # Straight into the column slice (row stride N): cuBLAS takes it as its C matrix, no copy.
        torch.mm(x, ws[: n1 - n0].t(), out=out[:, n0:n1])
    return out


def _check_bf16_weight(w: torch.Tensor) -> tuple[int, int]:
    if (
        w.dtype != torch.bfloat16
        or w.dim() != 2
        or not w.is_contiguous()
        or w.shape[1] % 16
        or w.data_ptr() % 16
    ):
        raise ValueError(
            f"w must be contiguous 16-byte aligned bf16 [N, K % 16 == 0], got {w.dtype} {list(w.shape)}"
        )
    return w.shape[0], w.shape[1]


def _check_workspace(workspace: torch.Tensor, splits: int, m: int, n: int) -> None:
    """A bf16 GEMV's split-K partial buffer: contiguous f32 with room for [splits, m, n]."""
    if (
        workspace.dtype != torch.float32
        or not workspace.is_contiguous()
        or workspace.numel() < splits * m * n
    ):
        raise ValueError(f"workspace must be contiguous f32 with >= {splits} x {m} x {n} elements")


def bf16_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    rd: bool | None = None,
    reg: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """y = x @ w^T with the same batch-invariant small-M kernels (bf16 w [N, K], K % 16 == 0).

    `workspace`: [>= splits, 32, N] f32 split-K partials (made here if needed and not given). Test /
    benchmark knobs (the bits never change): `rd` forces or forbids the one-warp-CTA kernel bf16_gemv_rd
    (default: where the weight's 64-row groups x slices are fewer than the device's SMs, e.g. the GDN b/a
    projection, whose CTAs then fit beside q/k/v/z's on a side stream); `reg` = (MT, RPF, XPF) sets
    bf16_gemv's m16 tiles per warp and weight / activation chunks in flight (default BF16_REG[NT]; XPF
    must divide RPF).
    """
    n, k = _check_bf16_weight(w)
    _check_x(x, k)
    out = _out(x, n, out)
    m = x.shape[0]
    if m > SMALL_M:
        return torch.matmul(x, w.t(), out=out)
    if m == 0:
        return out
    splits = _bf16_splits(n, k)
    if splits > 1 and workspace is None:
        workspace = torch.empty(splits, SMALL_M, n, device=x.device)
    if splits > 1:
        _check_workspace(workspace, splits, m, n)
    _launch_bf16(w, x, out, workspace, splits, rd, reg)
    return out


def bf16_linear_partials(x: torch.Tensor, w: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor | None:
    """bf16_linear(x, w)'s split-K partials without their reduce launch: an f32 [splits, M, N] view of
    `workspace` ([>= splits, 32, N] f32) whose sums over the slices in slice order, rounded to bf16, are
    bf16_linear's output bits (splitk_reduce's arithmetic; the GDN decode kernel sums the b/a projection's
    this way, lumo.kernels.gdn.gdn_decode(ba_splitk=...)). None where the weight runs as one slice, or M >
    SMALL_M: then bf16_linear writes its output directly."""
    n, k = _check_bf16_weight(w)
    _check_x(x, k)
    m, splits = x.shape[0], _bf16_splits(n, k)
    if splits == 1 or m > SMALL_M or m == 0:
        return None
    _check_workspace(workspace, splits, m, n)
    _launch_bf16(w, x, ctypes.c_void_p(0), workspace, splits, reduce=False)
    return workspace.view(-1)[: splits * m * n].view(splits, m, n)


def nvfp4_linear_ref(x: torch.Tensor, weight, weight_scale, weight_scale_2) -> torch.Tensor:
    """fp32 reference: dequantise (lumo.quant) then matmul; returns f32 [M, N]."""
    w = nvfp4_dequantize(weight, weight_scale, weight_scale_2)
    return x.float() @ w.t()


def bf16_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().t()


def unpack_nvfp4(packed: PackedNVFP4) -> torch.Tensor:
    """Decode the packed layout back to f32 [N, K] (gs applied), following linear.cu's layout comment; a
    fused-SwiGLU weight back to its [gate | up] rows."""
    from ..quant import E2M1_LUT

    rg, chunks = packed.row_groups, packed.chunks
    words = packed.qw.view(torch.int32).view(rg, chunks, MT, 8, 4, 4).long() & 0xFFFFFFFF  # [rg,c,p,g,t,s]
    vals = torch.zeros(rg, MT, 2, 8, chunks, 4, 4, 4)  # [rg, p, h, g, c, t, s, e]
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    lut = E2M1_LUT.to(words.device)
    for q, (h, e) in enumerate(order):
        code = sum(((words >> _BITS[q][b]) & 1) << b for b in range(4))
        vals[:, :, h, :, :, :, :, e] = lut[code].permute(0, 2, 3, 1, 4, 5).cpu()
    s16 = packed.qs.long().cpu() & 0xFFFF  # [rg, c, p, lane]
    sb = torch.stack([s16 & 0xFF, s16 >> 8], dim=-1).view(rg, chunks, MT, 8, 4, 2)  # [rg, c, p, g, t, h]
    bits = (sb << 4) + (117 << 7)
    scale = bits.to(torch.int16).view(torch.bfloat16).float().permute(0, 2, 5, 3, 1, 4)  # [rg, p, h, g, c, t]
    w = vals * scale[..., None, None]
    w = w.reshape(rg * ROWS, chunks * CHUNK)[: packed.n, : packed.k] * packed.gs[: packed.n, None].cpu()
    if packed.glu_n:  # back to [gate | up]
        i = packed.glu_n
        w = (
            w.view(-1, 2, 8, packed.k)
            .transpose(0, 1)
            .reshape(2, -1, packed.k)[:, :i]
            .reshape(2 * i, packed.k)
        )
    return w
