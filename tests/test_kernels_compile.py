"""CPU (no GPU): every kernel source compiles for sm_90 and sm_121a; the NVFP4 packing round-trips."""

from __future__ import annotations

import re

import pytest
import torch

from lumo.kernels import (
    KernelCompileError,
    compile_test_defines,
    compile_to_cubin,
    kernel_sources,
    pack_fused,
    pack_nvfp4,
    unpack_nvfp4,
)
from lumo.kernels.compile import cached_cubin, define_options
from lumo.quant import nvfp4_dequantize

CASES = [
    pytest.param(
        path, defines, arch, id=f"{path.stem}-{'-'.join(f'{k}{v}' for k, v in defines.items())}-{arch}"
    )
    for path in kernel_sources()
    for defines in compile_test_defines(path)
    for arch in ("sm_90", "sm_121a")
]


def test_sources_found():
    assert any(p.name == "linear.cu" for p in kernel_sources())


@pytest.mark.parametrize("path,defines,arch", CASES)
def test_compiles(path, defines, arch):
    cubin = compile_to_cubin(path.read_text(), arch, define_options(defines), path.name)
    assert cubin[:4] == b"\x7fELF"


LINEAR = next(p for p in kernel_sources() if p.name == "linear.cu")
LINEAR_KERNELS = re.findall(
    r'^extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)\(', LINEAR.read_text(), re.M
)


@pytest.mark.parametrize("arch", ["sm_90", "sm_121a"])
def test_linear_compiles_one_kernel_at_a_time(arch):
    """linear.py builds one kernel per NVRTC call (LUMO_ONLY): each compiles alone and holds only itself."""
    assert len(LINEAR_KERNELS) >= 9
    for name in LINEAR_KERNELS:
        defines = {"NT": 4, "MTW": 2, "PF": 3, "KSW": 4, "SXW": 8, "LUMO_ONLY": 1, f"LUMO_ONLY_{name}": 1}
        cubin = compile_to_cubin(LINEAR.read_text(), arch, define_options(defines), LINEAR.name)
        held = [k for k in LINEAR_KERNELS if b"\x00" + k.encode() + b"\x00" in cubin]
        assert held == [name], (name, held)


def test_compiling_leaves_python_bytes_alone():
    """NVRTC writes into the log and cubin buffers it is given: they must be bytearrays. An immutable
    b" " * 1 is CPython's shared one-byte object, and an empty log's NUL written into it once turned every
    b" " of the process into b"\\x00" (found by tests/test_logprobs.py's token bytes after a compile)."""
    cubin = compile_to_cubin('extern "C" __global__ void k() {}', "sm_90")
    assert cubin[:4] == b"\x7fELF" and isinstance(cubin, bytes)
    assert bytes([32])[0] == 32 and bytes([0])[0] == 0


def test_error_carries_log():
    with pytest.raises(KernelCompileError, match="undeclared_thing"):
        compile_to_cubin('extern "C" __global__ void k() { undeclared_thing = 1; }', "sm_90")


def test_cache_hits_and_cleans(tmp_path, monkeypatch):
    monkeypatch.setenv("LUMO_CACHE_DIR", str(tmp_path))
    src = 'extern "C" __global__ void k(float* p) { p[threadIdx.x] = 1.0f; }'
    a = cached_cubin(src, "sm_90", (), "tiny.cu")
    files = list(tmp_path.glob("*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == a
    assert cached_cubin(src, "sm_90", (), "tiny.cu") == a
    cached_cubin(src, "sm_90", ("-DX=1",), "tiny.cu")
    assert len(list(tmp_path.glob("*.cubin"))) == 2
    from lumo.kernels import clean_cache

    assert clean_cache() == 2 and not list(tmp_path.glob("*.cubin"))


def _rand_nvfp4(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    s = (torch.rand(n, k // 16, generator=gen) * 300 + 0.002).to(torch.float8_e4m3fn)
    s[n // 2, 0] = 0  # an all-zero block
    return w, s, torch.rand((), generator=gen) * 0.02 + 1e-3


@pytest.mark.parametrize("n,k", [(48, 16 * 7), (100, 16 * 33), (130, 64)], ids=lambda v: str(v))
def test_pack_roundtrip(n, k):
    gen = torch.Generator().manual_seed(n * k)
    w, s, s2 = _rand_nvfp4(n, k, gen)
    packed = pack_nvfp4(w, s, s2)
    assert packed.qw.shape[1:] == (-(-k // 64), 4, 32, 16)
    torch.testing.assert_close(unpack_nvfp4(packed), nvfp4_dequantize(w, s, s2), rtol=0, atol=0)


def test_pack_fused_keeps_shard_scales():
    gen = torch.Generator().manual_seed(7)
    shards = [_rand_nvfp4(40, 112, gen), _rand_nvfp4(24, 112, gen)]
    packed = pack_fused(shards)
    ref = torch.cat([nvfp4_dequantize(*sh) for sh in shards])
    assert packed.shard_sizes == (40, 24)
    torch.testing.assert_close(unpack_nvfp4(packed), ref, rtol=0, atol=0)


def test_pipeline_depth_fits_small_shared_memory(monkeypatch):
    """sm_86/89 and the sm_120 family (GB10) let a CTA opt into 99 KB of shared memory, not 227: the GEMV
    rings shrink to fit (a launch choice, never a result bit), and a ring that cannot hold two stages
    is refused with a clear error."""
    from lumo.kernels import linear

    monkeypatch.setattr(linear, "smem_limit", lambda device: 99 * 1024)
    cpu = torch.device("cpu")
    assert linear.fit_stages(6, linear._fp4_stage_bytes(4, 8), cpu) == 4  # 22 KB stages: 4 of 6 fit
    assert linear.fit_stages(6, linear._fp4_stage_bytes(1, 4), cpu) == 6  # 61 KB ring fits as is
    with pytest.raises(RuntimeError, match="does not fit"):
        linear.fit_stages(4, 60 * 1024, cpu)


def test_register_direct_launch_choice():
    """choose_rd: every 27B shape runs the register-direct kernel at M <= 32 but the 16-slice down
    projection, which takes the cluster-reduced kernel from M = 17 on; 8 slices above M = 16 run two-tile
    CTAs, above M = 24 in clusters of two (RD_CLUSTERS); 4 slices two tiles per warp up to M = 24, four
    above."""
    from lumo.kernels.linear import RD_CLUSTERS, choose_rd, choose_splits

    shapes = [(10240, 5120), (6144, 5120), (16384, 5120), (14336, 5120), (5120, 6144), (48, 5120)]
    shapes += [(34816, 5120), (5120, 17408), (248320, 5120)]
    for n, k in shapes:
        splits = choose_splits(n, k)
        for m in range(1, 33):
            rd = choose_rd(splits, m)
            if m > 16 and splits == 16:
                assert rd is None, (n, k, m)
                continue
            mtw, pf = rd
            assert mtw in (1, 2, 4) and pf >= 2, (n, k, m)
            if m > 16 and splits == 8:
                cl = RD_CLUSTERS.get((-(-m // 8), 2, 2, 8), (1, 1))[0]
                assert (mtw, pf, cl) == (2, 2, 2 if m > 24 else 1), (n, k, m)
            if m > 16 and splits == 4:  # two tiles per warp at NT 3, four at NT 4 (session 18)
                assert (mtw, pf) == ((4, 2) if m > 24 else (2, 2)), (n, k, m)
            if 8 < m <= 16 and splits == 16:
                assert (mtw, pf) == (2, 2), (n, k, m)


def test_wave_fit_sizes_the_clustered_build(monkeypatch):
    """linear._rd_fit_waves: four-tile warps narrow to two where that fills the waves better, two-tile
    ones never narrow at NT >= 3, and a width is judged by the build it would launch: the clustered one
    that RD_CLUSTERS names (CTAs of splits / rdcl warps, rdcl per tile group), or one CTA where the device
    refuses that cluster. Occupancy from an sm_90 register-file model with the builds' register counts
    (cuobjdump -res-usage of the NVRTC cubins; the four-tile clustered count is made up), 132 SMs."""
    import math

    from lumo.kernels import linear

    regs = {(4, 2, 2): 155, (4, 2, 1): 155, (4, 4, 1): 212, (4, 4, 2): 200, (3, 2, 1): 127}  # (NT, MTW, rdcl)
    asked = []

    class Fake:
        def __init__(self, nt, mtw, rdcl):
            self.key = (nt, mtw, rdcl)

        def blocks_per_sm(self, block, shmem):
            asked.append((*self.key, block, shmem))
            per_warp = math.ceil(regs[self.key] * 32 / 256) * 256
            return min(65536 // (per_warp * (block // 32)), 64 // (block // 32), 32)

    def kernel(nt, mtw, pf, splits, probe=0, glu=False, rdcl=1, conv=0):
        return Fake(nt, mtw, rdcl)

    monkeypatch.setattr(linear, "_rd_kernel", kernel)
    monkeypatch.setattr(linear, "sm_count", lambda device: 132)
    fit = linear._rd_fit_waves.__wrapped__  # uncached: the fakes must not stay in the cache
    cpu = torch.device("cpu")
    # gate+up at M = 32 (4 slices): 544 four-tile CTAs fill 69% of three waves' slots, 1088 two-tile ones
    # 92% of three: two tiles (session 6: 68.6 -> 54.6 us)
    monkeypatch.setattr(linear, "_rd_cluster_fits", lambda *a: a[4] == 1)
    assert fit((4, 2), 34816 // 16, 4, 4, cpu) == (2, 2)
    # 8 slices at NT 3 and 4 (the verify's out-projections and attention q/k/v; 5120 -> 10240, where one
    # tile would fill three waves better than two tiles fill two but measured slower): two tiles
    for n, nt in ((5120, 4), (14336, 4), (10240, 3), (10240, 4)):
        assert fit((2, 2), n // 16, nt, 8, cpu) == (2, 2), (n, nt)
    # 16 slices at NT 2 (the down projection at M = 16: 160 two-tile CTAs of 16 warps at 102 registers fill
    # 61% of two waves, 320 one-tile ones at 77 registers 81% of three, but measured slower): two tiles
    regs[(2, 2, 1)], regs[(2, 1, 1)] = 102, 77
    assert fit((2, 2), 5120 // 16, 2, 16, cpu) == (2, 2)
    assert fit((2, 2), 5120 // 16, 2, 8, cpu) == (1, 2)  # 8 slices: narrowed (it wins as often as not)
    # A clustered four-tile entry (none is in the table today): its 2-warp CTAs, or one CTA if refused
    monkeypatch.setitem(linear.RD_CLUSTERS, (4, 4, 2, 4), (2, 1))
    for clusters in (True, False):
        monkeypatch.setattr(linear, "_rd_cluster_fits", lambda *a, c=clusters: c or a[4] == 1)
        asked.clear()
        fit((4, 2), 34816 // 16, 4, 4, cpu)
        block = 64 if clusters else 128
        assert (4, 4, 2 if clusters else 1, block, block // 32 * 4 * 4 * 512) in asked, asked


def test_l2_prefetch_budget():
    """prefetch_chunks: the leading chunks per warp that the whole grid's L2 prefetch budget covers (a
    chunk of an m16 tile is 576 bytes with its scales), at most the slice, none for a zero budget."""
    from lumo.kernels.linear import MT, prefetch_chunks

    per_chunk = 80 * MT * 8 * 576  # 6144 -> 5120: 80 row groups, 8 slices
    assert prefetch_chunks(80, 8, 12, 16 << 20) == (16 << 20) // per_chunk == 11
    assert prefetch_chunks(80, 8, 12, 64 << 20) == 12  # the whole slice
    assert prefetch_chunks(3880, 1, 80, 16 << 20) == 1  # lm_head: 8.9 MB per chunk over the grid
    assert prefetch_chunks(80, 8, 12, 0) == 0
    with pytest.raises(ValueError, match="l2pf"):
        prefetch_chunks(80, 8, 12, -1)


def test_no_clusters_below_sm90():
    """max_cluster_size answers 0 for a pre-Hopper cubin without asking the driver (the cluster-reduced
    split-K then falls back to the cross-CTA kernel)."""
    from lumo.kernels.compile import Kernel

    k = Kernel("nvfp4_gemv_cl", object(), [48 * 1024], sm_major=8)
    assert k.max_cluster_size((10, 8, 1), 128, 60000) == 0


def test_split_counts_of_the_27b_shapes():
    """choose_splits on the 27B's NVFP4 shapes: only the fused gate+up (544 row groups) takes the
    at-least-MIN_SPLITS rule; the lm_head (3880 row groups) stays whole."""
    from lumo.kernels.linear import choose_splits

    want = {(10240, 5120): 8, (16384, 5120): 4, (14336, 5120): 8, (5120, 6144): 8, (34816, 5120): 4}
    want |= {(5120, 17408): 16, (248320, 5120): 1, (48, 5120): 8}
    assert {nk: choose_splits(*nk) for nk in want} == want


def test_wave_fill():
    from lumo.kernels.linear import wave_fill

    assert wave_fill(264, 2, 132) == 1.0
    assert wave_fill(320, 2, 132) == pytest.approx(320 / 528)  # 1.21 waves: the second mostly empty
    assert wave_fill(544, 2, 132) == pytest.approx(544 / 792)
    assert wave_fill(1088, 3, 132) == pytest.approx(1088 / 1188)
    assert wave_fill(5, 0, 132) == 0.0  # no CTA fits: never divides by zero


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "sm_121a"])
@pytest.mark.parametrize("probe", ["probe_mma.cu", "probe_wgmma.cu", "probe_boundary.cu", "probe_stream.cu"])
def test_bench_probe_kernel_compiles(arch, probe):
    """The bench probes build like the library's kernels: probe_mma.cu and probe_wgmma.cu (tensor-core
    throughput), probe_boundary.cu (the launch chain), probe_stream.cu (the M = 1 GEMV's loads alone);
    probe_wgmma's wgmma (sm_90a) without ptxas serialising it (NVRTC log remark C7514 and kin)."""
    from pathlib import Path

    from lumo.kernels.compile import compile_test_defines, compile_to_cubin, define_options

    path = Path(__file__).parents[1] / "bench" / probe
    for defines in compile_test_defines(path):
        for dq in ("0", "1", "2") if probe == "probe_wgmma.cu" else (None,):
            log: list[str] = []
            d = defines | ({"DQ": dq} if dq else {})
            assert compile_to_cubin(path.read_text(), arch, define_options(d), path.name, log=log)
            assert "serialized" not in log[0], (probe, arch, d, log[0])


def test_bf16_launch_knobs_are_checked():
    """bf16_linear's launch knobs are refused before anything compiles: rd=True with reg, and a reg whose
    activation ring does not divide the weight ring (slots are compile-time indices) or has a zero."""
    from lumo.kernels.linear import bf16_linear

    x, w = torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    for kw in (dict(rd=True, reg=(1, 2, 2)), dict(reg=(1, 3, 2)), dict(reg=(0, 2, 2)), dict(reg=(1, 2))):
        with pytest.raises(ValueError):
            bf16_linear(x, w, **kw)
