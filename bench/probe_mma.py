"""Peak throughput of the tensor-core instruction the GEMVs use (mma.sync m16n8k16 bf16 -> fp32).

The M = 32 GEMV runs 4 such mma per 16 weight rows x 16 columns; this says how much of the tensor pipe a
given GEMV time implies. Prints TFLOP/s and cycles per mma per SM sub-partition (at the boost clock)
for 1..8 independent accumulator chains per warp and 4..16 warps per CTA, 4 CTAs per SM.

    python -m bench.probe_mma
"""

from __future__ import annotations

from pathlib import Path

import torch

from lumo.kernels.compile import compile_kernel

ITERS = 4096
BOOST_GHZ = 1.98  # H200 SXM; only scales the cycles column


def main() -> None:
    src = Path(__file__).with_name("probe_mma.cu")
    out = torch.zeros(1024, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = 4 * sms
    print(f"{torch.cuda.get_device_name()}: mma.sync m16n8k16 bf16 -> f32, {grid} CTAs")
    for ilp in (1, 2, 4, 8):
        kern = compile_kernel(src, "mma_peak", {"ILP": ilp})
        for warps in (4, 8, 16):
            kern.launch(grid, 32 * warps, [out, ITERS])
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                kern.launch(grid, 32 * warps, [out, ITERS])
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3)
            t = sorted(times)[len(times) // 2]
            mmas = ilp * ITERS * warps * grid
            cycles = t * BOOST_GHZ * 1e9 / (mmas / sms / 4)
            print(
                f"chains {ilp} warps/CTA {warps:2d}: {2 * 16 * 8 * 16 * mmas / t / 1e12:4.0f} TFLOP/s, "
                f"{cycles:.1f} cycles per mma per sub-partition at {BOOST_GHZ} GHz"
            )


if __name__ == "__main__":
    main()
