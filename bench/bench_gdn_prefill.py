"""The GDN prefill (gdn_prefill) on the 27B's linear-attention shape: the sequential kernel against the
chunked form with each walk kernel (gdn_chunk.cu).

    python -m bench.bench_gdn_prefill [--tokens 128 512 2048 8192] [--reps 6]

One table: milliseconds per call for one layer's T tokens (median of `reps` CUDA-event timed calls after
two warm-up calls), and the relative error of each chunked form's o and final state against the
sequential kernel (fp32 o). The sequential kernel is T decode steps (bitwise plain decoding); "tc" is the
default walk at this shape (tensor cores, three tf32 passes, state tiles of `--tc-dvs` columns), "tc1" one
pass, "fma" fp32 on CUDA cores.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

import lumo.kernels.gdn as G
from lumo.kernels.gdn import gdn_prefill

NK, NV, DK, DV = 16, 48, 128, 128  # the 27B's Gated DeltaNet heads


def operands(T: int, gen: torch.Generator, dev: torch.device) -> dict[str, torch.Tensor]:
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(torch.bfloat16)

    return {
        "mixed": rnd(T, 2 * NK * DK + NV * DV),
        "a": rnd(T, NV),
        "b": rnd(T, NV),
        "A_log": torch.rand(NV, generator=gen, device=dev) * 2 - 1,
        "dt_bias": torch.randn(NV, generator=gen, device=dev) * 0.5,
        "state": torch.randn(NV, DK, DV, generator=gen, device=dev) * 0.1,
    }


def timed_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tc-dvs", type=int, nargs="+", default=[G.CHUNK_TC_DVS], help="tensor-core tile widths")
    args = ap.parse_args()
    dev = torch.device("cuda")
    default_dvs = G.CHUNK_TC_DVS
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"\n## bench_gdn_prefill: {torch.cuda.get_device_name()}, nk {NK}, nv {NV}, dk {DK}, dv {DV}")
    print("| tokens | form | ms/call | x sequential | rel o | rel state |")
    print("|---|---|---|---|---|---|")
    for T in args.tokens:
        inp = operands(T, gen, dev)
        state0 = inp.pop("state")
        forms = [("sequential", {"chunked": False}, None), ("fma", {"chunked": True, "scan": "fma"}, None)]
        forms += [
            (f"{s} dvs {d}", {"chunked": True, "scan": s}, d) for d in args.tc_dvs for s in ("tc", "tc1")
        ]
        ref = None
        for name, kw, dvs in forms:
            G.CHUNK_TC_DVS = dvs or default_dvs
            s_out = torch.empty_like(state0)
            o = torch.empty(T, NV, DV, device=dev)
            call = functools.partial(gdn_prefill, **inp, state=state0, state_out=s_out, out=o, **kw)
            ms = timed_ms(call, args.reps)
            if ref is None:
                ref = (ms, o.clone(), s_out.clone())
                print(f"| {T} | {name} | {ms:.3f} | 1.00 | | |")
                continue
            errs = f"{rel(o, ref[1]):.1e} | {rel(s_out, ref[2]):.1e}"
            print(f"| {T} | {name} | {ms:.3f} | {ref[0] / ms:.2f} | {errs} |")


if __name__ == "__main__":
    main()
