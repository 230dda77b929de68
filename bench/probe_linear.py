"""Where the NVFP4 GEMV's time goes: the library kernels next to measurement variants of themselves.

Variants (linear.cu LUMO_PROBE): "nomath" skips the dequant + mma (the cp.async pipeline and barriers
alone), "l2w" reads every chunk's weights from its row group's first two chunks (L2-resident: the
arithmetic and pipeline without DRAM), "fmadq" computes the dequant's shifts as integer products (the
same bits on the FMA pipe instead of the ALU pipe), "x0" reads every chunk's activations from its slice's
first chunk (the register-direct kernel only: no activation traffic beyond L1), "l2w+x0" both. The bf16
cuBLAS GEMV of the same shape is the bandwidth reference.

    python -m bench.probe_linear            # timing table (graph replay, median), printed last
    ncu --profile-from-start off ... python -m bench.probe_linear --ncu    # one launch of each case
"""

from __future__ import annotations

import argparse

import torch

from bench.bench_linear import L2_ROTATE_BYTES, copy_bandwidth, random_packed, time_graph
from lumo.kernels import linear

SHAPES = [("gate+up", 5120, 34816), ("in 5120->10240", 5120, 10240), ("down", 17408, 5120)]
SHAPES += [("gdn qkvz", 5120, 16384), ("out", 6144, 5120)]
PROBES = {"lib": 0, "nomath": 1, "l2w": 2, "fmadq": 3, "x0": 4, "l2w+x0": 5}


def cases(m: int) -> list[tuple[str, dict]]:
    out = [("dflt", {}), ("cross", dict(rd=False, cluster=False))]
    if m > 8:
        out.append(("cl", dict(rd=False, cluster=True)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ncu", action="store_true", help="one launch per case between profiler start/stop")
    ap.add_argument("--m", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--probes", nargs="*", default=list(PROBES), choices=list(PROBES))
    ap.add_argument("--cases", nargs="*", default=["dflt", "cross", "cl"], help="launch variants to run")
    ap.add_argument("--only", nargs="*", default=[], help="shapes whose name contains one of these")
    ap.add_argument("--no-cublas", action="store_true", help="skip the cuBLAS peer")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = None if args.ncu else max(copy_bandwidth().values())
    rows = []
    for name, k, n in SHAPES:
        if args.only and not any(o in name for o in args.only):
            continue
        wbytes = n * k // 2 + n * k // 16
        reps = max(20, min(400, int(2e9 / wbytes)))
        packs = random_packed(n, k, 2 if args.ncu else max(2, -(-L2_ROTATE_BYTES // wbytes)))
        wbs = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(2)]
        for m in args.m:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            runs = []
            for pname in args.probes:
                probe = PROBES[pname]
                for cname, kw in cases(m):
                    if cname not in args.cases:
                        continue
                    runs.append((f"{pname}/{cname}", probe, kw))
            ref = linear.nvfp4_linear(x, packs[0])
            for label, probe, kw in runs:
                kw = dict(kw, probe=probe)
                fns = [lambda p=p, kw=kw, x=x, o=out: linear.nvfp4_linear(x, p, out=o, **kw) for p in packs]
                if args.ncu:
                    fns[0]()  # compiled and warm before the profiled launch
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    fns[1]()
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                    print(f"ncu case {name} M={m} {label}", flush=True)
                    continue
                us = time_graph(fns, reps)
                if probe in (0, 3):  # the library kernels (and the product dequant) give the library's bits
                    linear.nvfp4_linear(x, packs[0], out=out, **kw)
                    assert torch.equal(out, ref), f"{name} M={m} {label}: result changed"
                rows.append((name, m, label, us, 100 * wbytes / (us * 1e-6) / 1e9 / bw))
            if args.no_cublas:
                continue
            if args.ncu:
                torch.matmul(x, wbs[0].t())
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                torch.matmul(x, wbs[1].t())
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
                print(f"ncu case {name} M={m} cublas", flush=True)
                continue
            us = time_graph([lambda w=w, x=x, o=out: torch.matmul(x, w.t(), out=o) for w in wbs * 8], reps)
            rows.append((name, m, "cublas bf16", us, 100 * n * k * 2 / (us * 1e-6) / 1e9 / bw))
        del packs, wbs
        torch.cuda.empty_cache()
    if args.ncu:
        return
    print(
        f"\n{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; us = median of graph replays; "
        "%bw = weight bytes / time / copy bandwidth"
    )
    print(f"{'shape':16} {'M':>3} {'variant':>14} {'us':>8} {'%bw':>6}")
    for name, m, label, us, pct in rows:
        print(f"{name:16} {m:3d} {label:>14} {us:8.1f} {pct:6.1f}")


if __name__ == "__main__":
    main()
