"""Does the order of the packed NVFP4 weights in memory change what DRAM delivers to the M = 1 GEMV?

bench/probe_stream.cu replays nvfp4_gemv_rd's loads at M = 1 (one m16 tile per CTA, a warp per split-K
slice, 16 bytes of weights and a 2-byte scale pair per lane and chunk, PF - 1 chunks in flight) with a
stand-in for the arithmetic, over three orders of the same bytes: the library's packing ([row group][chunk]
[tile]), step-major ([chunk][row group][tile]: the CTAs at the same step of their slices read one range)
and tile-major (each warp's slice one contiguous run). Prints, per 27B shape, us and % of the device
copy for each order, ring depth, stand-in work and CTAs per SM, next to the library GEMV's own time; and,
from the same runs at K and 2K, the steady rate (the bytes 2K adds over the time it adds) apart from the
fixed cost of a launch (ramp, tail, epilogue).

    python -m bench.probe_stream [--shapes gate down ...] [--work 0 16] [--pf 2 3 4] [--occ 0 9] [--kmul 1 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path

import torch

from bench.bench_linear import copy_bandwidth, random_packed, time_graph
from lumo.kernels.compile import compile_kernel
from lumo.kernels.linear import CHUNK, MT, ROWS, choose_splits, nvfp4_linear

# name -> (N, K), the 27B's M = 1 weights of the decode step
SHAPES = {
    "gate": (34816, 5120),
    "qkvz": (16384, 5120),
    "down": (5120, 17408),
    "attn": (14336, 5120),
    "out": (5120, 6144),
}
LAYOUTS = {0: "library", 1: "step-major", 2: "tile-major"}
MIN_ROTATION = 256 << 20  # bytes of weight copies cycled, so L2 (50-60 MB) never serves them


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--work", nargs="+", type=int, default=[0, 16])
    ap.add_argument("--pf", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--occ", nargs="+", type=int, default=[0], help="CTAs per SM (0: as many as fit)")
    ap.add_argument("--kmul", nargs="+", type=int, default=[1, 2], help="K times these: fixed vs steady cost")
    args = ap.parse_args()
    dev = torch.cuda.get_device_properties(0)
    bw = max(copy_bandwidth().values())
    print(f"{dev.name}: device copy {bw:.0f} GB/s (read+write); us per launch, % of the copy")
    for name in args.shapes:
        n, k = SHAPES[name]
        lib, sizes = {}, {}
        probe: dict[tuple, dict[int, float]] = {}
        s = choose_splits(n, k)  # kept at every K multiple: a longer K changes only the chunks per warp
        for kmul in args.kmul:
            cps, sizes[kmul], lib[kmul] = library_time(n, k * kmul, s)
            print(
                f"\n{name} x{kmul}: N {n} K {k * kmul}, {s} slices of {cps} chunks, "
                f"{-(-n // ROWS) * MT} CTAs of {32 * s} threads, {sizes[kmul] / 1e6:.1f} MB; "
                f"library GEMV {lib[kmul]:.1f} us ({pct(sizes[kmul], lib[kmul], bw)}%)"
            )
            stream = Stream(n, k * kmul, s, cps)
            for occ in args.occ:
                shmem = 0 if occ == 0 else dev.shared_memory_per_multiprocessor // occ - 1024
                for work in args.work:
                    for pf in args.pf:
                        cells = []
                        for layout in LAYOUTS:
                            us = stream.time({"PF": pf, "LAYOUT": layout, "WORK": work}, shmem)
                            probe.setdefault((occ, work, pf, layout), {})[kmul] = us
                            cells.append(f"{LAYOUTS[layout]} {us:6.1f} ({pct(sizes[kmul], us, bw):3d}%)")
                        head = f"  occ {occ or 'max':>3} work {work:2d} PF {pf}: "
                        print(head + "  ".join(cells), flush=True)
            del stream
        if len(args.kmul) > 1:  # the steady stream: the bytes a longer K adds over the time it adds
            print(f"\n{name}: K x{min(args.kmul)} -> x{max(args.kmul)}: library {split(lib, sizes, bw)}")
            for (occ, work, pf, layout), t in probe.items():
                head = f"  occ {occ or 'max':>3} work {work:2d} PF {pf} {LAYOUTS[layout]:>10}: "
                print(head + split(t, sizes, bw))


class Stream:
    """Random weight and scale buffers of an N x K weight's packed size, cycled through, and the probe's
    grid: one CTA per m16 tile, a warp per slice."""

    def __init__(self, n: int, k: int, slices: int, cps: int) -> None:
        self.groups, self.chunks, self.slices, self.cps = -(-n // ROWS), -(-k // CHUNK), slices, cps
        units, copies = packed_size(n, k)
        self.bufs = [
            (
                torch.randint(-(2**31), 2**31 - 1, (units * 4,), dtype=torch.int32, device="cuda"),
                torch.randint(0, 1 << 15, (units,), dtype=torch.int16, device="cuda"),
            )
            for _ in range(copies)
        ]
        self.out = torch.zeros(self.groups * MT, dtype=torch.int32, device="cuda")

    def time(self, defines: dict[str, int], shmem: int) -> float:
        kern = compile_kernel(Path(__file__).with_name("probe_stream.cu"), "stream_probe", defines)
        grid, block = self.groups * MT, 32 * self.slices
        args = [self.groups, self.chunks, self.cps]
        fns = [
            functools.partial(kern.launch, grid, block, [w, sc, self.out, *args], shmem=shmem)
            for w, sc in self.bufs
        ]
        return time_graph(fns, reps=4 * len(self.bufs))


def split(t: dict[int, float], sizes: dict[int, int], bw: float) -> str:
    """The steady rate (% of the copy) and the fixed cost of a launch, from times `t` at two K multiples."""
    lo, hi = min(t), max(t)
    fixed = t[lo] - (t[hi] - t[lo]) * lo / (hi - lo)
    return f"steady {pct(sizes[hi] - sizes[lo], t[hi] - t[lo], bw)}% of the copy, fixed {fixed:.1f} us"


def pct(nbytes: int, us: float, bw: float) -> int:
    return round(100 * nbytes / (us * 1e-6) / 1e9 / bw) if us > 0 else 0


def packed_size(n: int, k: int) -> tuple[int, int]:
    """(lane units, copies to cycle) of an N x K packed weight: a unit is one lane's 16 bytes of weights and
    2 of scales in one tile-chunk; enough copies that L2 never serves them."""
    units = -(-n // ROWS) * MT * -(-k // CHUNK) * 32
    return units, max(2, -(-MIN_ROTATION // (units * 18)))


def library_time(n: int, k: int, splits: int) -> tuple[int, int, float]:
    """(chunks per slice, bytes, us per launch) of the library's M = 1 GEMV of an N x K weight in `splits`
    slices."""
    units, copies = packed_size(n, k)
    packs = [dataclasses.replace(p, splits=splits) for p in random_packed(n, k, copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    us = time_graph([lambda p=p: nvfp4_linear(x, p) for p in packs], reps=4 * copies)
    chunks = -(-k // CHUNK)
    return -(-chunks // splits), units * 18, us


if __name__ == "__main__":
    main()
