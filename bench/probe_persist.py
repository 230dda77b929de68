"""nvfp4_gemv_rd as one full wave of CTAs looping over the row blocks (RDP builds) against the library's
launch (a CTA per row block, in several waves where they do not fit one), with three hand-outs of the
blocks after each CTA's first (b + grid, a global counter, per-SM queues), at M = 1 on the 27B shapes that
take more than a wave: gate+up (fused SwiGLU) and the attention q(+gate)/k/v. Diagnostics (any sm_90+ GPU).

    python -m bench.probe_persist [--copies 4]

The grid is SMs x the build's occupancy, so that every SM holds the same number of CTAs (session 14's
one-wave tile groups left SMs partly empty: docs/kernels.md, sessions 14 and 28). Each case is a CUDA graph
cycling over `copies` distinct random weights; us per call, median of the replays, and % of the copy
bandwidth measured in the same run. The bits are checked equal to the library's launch."""

from __future__ import annotations

import argparse

import torch

from bench.bench_decode import copy_bandwidth
from bench.bench_linear import time_graph
from lumo.kernels import linear
from lumo.kernels.compile import sm_count
from lumo.kernels.linear import MT, choose_rd, nvfp4_linear, pack_fused, pack_nvfp4

HANDOUT = {0: "b + grid", 1: "counter", 2: "per-SM"}


def rand_nvfp4(n: int, k: int, gen: torch.Generator):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device="cuda")
    s = (torch.rand(n, k // 16, generator=gen, device="cuda") * 300 + 0.002).to(torch.float8_e4m3fn)
    return w, s, torch.tensor(1e-3, device="cuda")


def persistent(x: torch.Tensor, p, out: torch.Tensor, pf: int | None = None, dyn: int = 0, ahead: int = 0):
    """A call of the RDP build of nvfp4_gemv_rd for weight p at M = 1 (MTW 1, the library's PF)."""
    mtw, pf0 = choose_rd(p.splits, 1)
    pf = pf or pf0
    blocks = p.row_groups * MT // mtw
    glu = bool(p.glu_n)
    kern = linear._rd_kernel(1, mtw, pf, p.splits, glu=glu, rdp=blocks, rdp_dyn=dyn, rdp_ahead=ahead)
    grid, block, shmem = linear._rd_shape(p.row_groups, 1, mtw, p.splits, 1)
    grid = (min(blocks, sm_count(x.device) * kern.blocks_per_sm(block, shmem)), 1, 1)
    chunks = p.chunks
    cps = -(-chunks // p.splits)
    npf = linear.prefetch_chunks(p.row_groups, p.splits, cps, linear.L2_PREFETCH_BYTES)
    args = [p.qw, p.qs, p.gs, x, out, 1, p.out_features, p.k, chunks, cps, npf]
    return grid, lambda: kern.launch(grid, block, args, shmem, pdl=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=4)
    args = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    bw = copy_bandwidth()
    h = 5120
    shapes = {
        "gate+up 5120 -> 2 x 17408 (fused SwiGLU)": lambda: pack_fused(
            [rand_nvfp4(17408, h, gen), rand_nvfp4(17408, h, gen)], glu=True
        ),
        "attention q/k/v 5120 -> 14336": lambda: pack_nvfp4(*rand_nvfp4(14336, h, gen)),
    }
    x = torch.randn(1, h, generator=gen, device="cuda").to(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s, {sm_count(x.device)} SMs")
    print(f"{'shape':42s} {'launch':44s} {'us':>7s} {'% bw':>6s}")
    for name, make in shapes.items():
        ws = [make() for _ in range(args.copies)]
        nbytes = sum(t.numel() * t.element_size() for t in (ws[0].qw, ws[0].qs, ws[0].gs))
        out = torch.empty(1, ws[0].out_features, dtype=torch.bfloat16, device="cuda")
        want = nvfp4_linear(x, ws[0])
        us = time_graph([lambda w=w, out=out: nvfp4_linear(x, w, out=out) for w in ws], 16 * args.copies)
        print(f"{name:42s} {'library (a CTA per block)':44s} {us:7.1f} {100 * nbytes / bw * 1e6 / us:6.1f}")
        for pf, dyn, ahead in ((None, 0, 0), (None, 0, 1), (3, 0, 1), (None, 1, 0)):
            calls = [persistent(x, w, out, pf, dyn, ahead) for w in ws]
            out.fill_(float("nan"))
            calls[0][1]()
            assert torch.equal(out, want), (name, pf)  # the same bits
            us = time_graph([c for _, c in calls], 16 * args.copies)
            label = f"one wave, grid {calls[0][0][0]}, {HANDOUT[dyn]}" + (", ahead" if ahead else "")
            label += f", PF {pf}" if pf else ""
            print(f"{name:42s} {label:44s} {us:7.1f} {100 * nbytes / bw * 1e6 / us:6.1f}")


if __name__ == "__main__":
    main()
