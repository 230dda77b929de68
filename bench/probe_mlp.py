"""The 27B MLP (fused gate+up 5120 -> 2 x 17408, then down 17408 -> 5120) at M = 1: the two register-direct
GEMVs against the persistent nvfp4_mlp in its build variants (H200 / any sm_90+; diagnostics).

    python -m bench.probe_mlp [--pairs 4] [--variants static=0,sleep=256,pf=2 static=1 pf=3 ...]

Each case is a CUDA graph cycling over `pairs` distinct random MLPs (so the weights stream from DRAM), one
launch after another with nothing between (PDL); us per MLP, median of the graph's replays, next to the
weight bytes at the copy bandwidth of the same run."""

from __future__ import annotations

import argparse

import torch

from bench.bench_decode import copy_bandwidth
from bench.bench_linear import time_graph
from lumo.kernels import linear
from lumo.kernels.linear import mlp_work, nvfp4_linear, nvfp4_mlp, pack_fused, pack_nvfp4


def rand_nvfp4(n: int, k: int, gen: torch.Generator):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device="cuda")
    s = (torch.rand(n, k // 16, generator=gen, device="cuda") * 300 + 0.002).to(torch.float8_e4m3fn)
    return w, s, torch.tensor(1e-3, device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--inter", type=int, default=17408)
    ap.add_argument("--variants", nargs="*", default=["static=0,sleep=256"])
    args = ap.parse_args()
    h, i = args.hidden, args.inter
    gen = torch.Generator("cuda").manual_seed(0)
    mlps = []
    for _ in range(args.pairs):
        gu = pack_fused([rand_nvfp4(i, h, gen), rand_nvfp4(i, h, gen)], glu=True)
        mlps.append((gu, pack_nvfp4(*rand_nvfp4(h, i, gen))))
    size = lambda p: sum(t.numel() * t.element_size() for t in (p.qw, p.qs, p.gs))  # noqa: E731
    nbytes, gu_bytes = size(mlps[0][0]) + size(mlps[0][1]), size(mlps[0][0])
    bw = copy_bandwidth()
    x = torch.randn(1, h, generator=gen, device="cuda").to(torch.bfloat16)
    act, out = torch.empty(1, i, dtype=torch.bfloat16, device="cuda"), torch.empty_like(x)
    want = nvfp4_linear(nvfp4_linear(x, mlps[0][0]), mlps[0][1])

    def two(p):
        return lambda: (nvfp4_linear(x, p[0], out=act), nvfp4_linear(act, p[1], out=out))

    reps = 16 * args.pairs
    rows = [("two GEMVs (nvfp4_gemv_rd x 2)", time_graph([two(p) for p in mlps], reps), nbytes)]
    gate_up = [lambda p=p: nvfp4_linear(x, p[0], out=act) for p in mlps]
    rows.append(("gate+up GEMV alone", time_graph(gate_up, reps), gu_bytes))
    for v in args.variants:
        knobs = dict(kv.split("=") for kv in v.split(","))
        linear.MLP_STATIC = int(knobs.get("static", 0))
        linear.MLP_SLEEP = int(knobs.get("sleep", 256))
        linear.MLP_PF = int(knobs.get("pf", 2))
        linear.MLP_PROBE = int(knobs.get("probe", 0))
        linear.MLP_NPF = int(knobs.get("npf", 0))
        linear._mlp_kernel.cache_clear()
        work = mlp_work(mlps, x.device)

        def one(p, work=work):
            return lambda: nvfp4_mlp(p[0], p[1], x, act, out, work)

        out.fill_(float("nan"))
        one(mlps[0])()
        assert linear.MLP_PROBE or torch.equal(out, want), v  # the same bits as the two GEMVs
        rows.append(
            (
                f"nvfp4_mlp {v}",
                time_graph([one(p) for p in mlps], reps),
                gu_bytes if linear.MLP_PROBE == 1 else nbytes,
            )
        )
    print(
        f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; MLP {h} -> {i} -> {h}: "
        f"{nbytes / 1e6:.1f} MB, "
        f"{nbytes / bw * 1e6:.1f} us at copy bandwidth (gate+up alone {gu_bytes / bw * 1e6:.1f})"
    )
    print(f"{'case':44s} {'us':>8s} {'% bw':>6s}")
    for name, us, b in rows:
        print(f"{name:44s} {us:8.1f} {100 * b / bw * 1e6 / us:6.1f}")


if __name__ == "__main__":
    main()
