"""What the tensor cores could give an M <= 32 NVFP4 GEMV on Hopper, without memory traffic.

bench/probe_wgmma.cu runs the GEMV's chunk loop from registers: the dequantisation (fp4.cuh) of each
chunk's A fragments, then either wgmma (m64 x 8 NT x k16, A in registers, B in shared memory, CH
independent 64-row chains per warpgroup, the chunk before last awaited before its register set is
rewritten, or every chunk: "wait 0") or mma.sync (the kernels' instruction today: CH m16 tiles per
warp). Prints, per variant, the weight bytes per second the loop could consume (a chunk of 64 columns is
512 bytes per m16 tile), to hold against the copy bandwidth a GEMV must keep up with, and the TFLOP/s.

    python -m bench.probe_wgmma            # H100 / H200 (sm_90a) only
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lumo.kernels.compile import compile_kernel

SRC = Path(__file__).with_name("probe_wgmma.cu")


def time_launch(kern, grid: int, block: int, args: list, reps: int = 5) -> float:
    kern.launch(grid, block, args)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        kern.launch(grid, block, args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2048)
    ap.add_argument("--nt", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ch", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    if torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("probe_wgmma needs an sm_90 GPU (wgmma is sm_90a only)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(1024, device="cuda")
    grid = 16 * sms
    print(f"{torch.cuda.get_device_name()}: {grid} CTAs of 128 threads, {args.iters} chunks each")
    print("| kernel | M (8 NT) | chains | dequant | CTAs / SM | weight TB/s | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for nt in args.nt:
        for ch in args.ch:
            for dq in (0, 1, 2):
                for name in ("mma_dq_peak", "wgmma_peak"):
                    if name == "mma_dq_peak" and dq != 1:
                        continue  # mma.sync's peak without dequant: bench/probe_mma.py
                    kern = compile_kernel(SRC, name, {"NT": nt, "CH": ch, "DQ": dq}, arch="sm_90a")
                    t = time_launch(kern, grid, 128, [out, args.iters, 12345])
                    if name == "wgmma_peak":
                        chunks = grid * args.iters * ch  # 64-row chains
                        wbytes, flops = chunks * 2048, chunks * 4 * 2 * 64 * 8 * nt * 16
                    else:
                        chunks = grid * 4 * args.iters * ch  # m16 tiles, 4 warps per CTA
                        wbytes, flops = chunks * 512, chunks * 4 * nt * 2 * 16 * 8 * 16
                    occ = kern.blocks_per_sm(128, 0)
                    print(
                        f"| {name} | {8 * nt} | {ch} | {('no', 'yes', 'yes, wait 0')[dq]} | {occ} | "
                        f"{wbytes / t / 1e12:.2f} | {flops / t / 1e12:.0f} |"
                    )


if __name__ == "__main__":
    main()
