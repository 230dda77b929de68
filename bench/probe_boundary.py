"""What a kernel boundary costs: a CUDA graph of N chained launches of an empty (or spinning) kernel.

Each launch of `chain_step` (bench/probe_boundary.cu) waits for its predecessor (PDL or a plain launch),
spins for a given time and writes a value its successor reads. Per grid shape (one CTA, one CTA per SM, four
per SM), launch kind (plain; PDL waiting then triggering, as lumo's row kernels; PDL triggering first) and
spin, it prints the graph replay's time per launch and that less the spin: the boundary. The decode step of
the 27B makes 536 launches (bench/results/bench_decode.log), so this bounds what fewer launches could save.

    python -m bench.probe_boundary
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.bench_linear import time_graph
from lumo.kernels.compile import compile_kernel

N = 256  # launches per graph


def per_launch_us(kern, grid: int, block: int, pdl: bool, spin_ns: int, buf: torch.Tensor) -> float:
    buf.zero_()
    fns = [lambda i=i: kern.launch(grid, block, [buf, i, spin_ns], pdl=pdl) for i in range(N)]
    us = time_graph(fns, N, trials=7)  # one graph of the N launches in order
    if buf[N - 1].item() != N:  # the chain ran in order, every launch after the one before
        raise SystemExit(f"chain broken: buf[{N - 1}] = {buf[N - 1].item()}")
    return us


def main() -> None:
    src = Path(__file__).with_name("probe_boundary.cu")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    buf = torch.zeros(N, device="cuda")
    print(f"{torch.cuda.get_device_name()}: {N} chained launches per graph, median of 7 replays")
    print(f"{'grid x block':<14}{'launch':<22}{'spin us':>8}{'us/launch':>11}{'boundary us':>13}")
    kinds = [("plain", False, 0), ("PDL, wait first", True, 0), ("PDL, trigger first", True, 1)]
    for grid, block in ((1, 32), (1, 640), (sms, 128), (4 * sms, 256)):
        for name, pdl, early in kinds:
            kern = compile_kernel(src, "chain_step", {"EARLY": early})
            for spin in (0, 2000):
                us, shape = per_launch_us(kern, grid, block, pdl, spin, buf), f"{grid} x {block}"
                print(f"{shape:<14}{name:<22}{spin / 1e3:>8.1f}{us:>11.2f}{us - spin / 1e3:>13.2f}")


if __name__ == "__main__":
    main()
