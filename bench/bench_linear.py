"""NVFP4 / BF16 linear at the 27B layer shapes on one GPU, against the measured copy bandwidth.

One table, printed last: median microseconds per launch (CUDA-graph replay of back-to-back launches over
rotating weight copies, so L2 does not serve the weights), bytes, GB/s, % of device-copy bandwidth, and
the torch peer (BF16 weights through cuBLAS) as a speed ratio; then lumo's own BF16 GEMV on the same BF16
weights (bf16_linear: bf16 us, bf16%bw, and bf16x = its speed against cuBLAS). --bf16-configs sweeps its
launch variants (--no-nvfp4 skips the NVFP4 ones). JSON goes to $OUT or bench/results/.
The fused gate+up is packed as the runner packs it (pack_fused(glu=True)): the GEMV stores silu(gate) * up,
17408 wide; the torch / bf16 peers run the plain 5120 -> 34816 product.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch

from lumo.benchmark import copy_rates
from lumo.kernels import bf16_linear, nvfp4_linear, pack_fused, pack_nvfp4
from lumo.kernels.linear import MAX_SPLITS

SHAPES = [  # (name, K, N)
    ("in 5120->10240", 5120, 10240),
    ("qkvz 5120->6144", 5120, 6144),
    ("small 5120->48", 5120, 48),
    ("gate+up 5120->34816", 5120, 34816),
    ("down 17408->5120", 17408, 5120),
    ("out 6144->5120", 6144, 5120),
    ("lm_head 5120->248320", 5120, 248320),
    # the 27B's other decode shapes: a GDN layer's fused q/k/v/z and an attention layer's fused q(+gate)/k/v
    ("gdn qkvz 5120->16384", 5120, 16384),
    ("attn qkv 5120->14336", 5120, 14336),
    ("mtp fc 10240->5120", 10240, 5120),  # the MTP head's fc (BF16 in ModelOpt checkpoints, like mtp.*)
]
L2_ROTATE_BYTES = 512 << 20  # rotate through at least this many weight bytes (L2 is 60 MB)


def time_graph(fns, reps: int, trials: int = 15) -> float:
    """Median microseconds per call of `fns` (cycled) replayed from one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def copy_bandwidth() -> dict[str, float]:
    """GB/s of a 2 GiB device copy, bytes read + written: cudaMemcpy (eager), an elementwise kernel, and a
    memcpy captured in a graph (which measured slower here). The fastest is the reference."""
    n = 2 << 30
    # 100 warm-up launches: the first run measured an idle-clocked GPU
    res = {name: bps / 1e9 for name, bps in copy_rates(n, warm=100).items()}
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    res["graph_memcpy"] = 2 * n / (time_graph([lambda: dst.copy_(src)], reps=10, trials=10) * 1e-6) / 1e9
    return res


def random_packed(n: int, k: int, copies: int, glu: bool = False):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    s = (torch.rand(n, k // 16, device="cuda") * 300 + 0.002).to(torch.float8_e4m3fn)
    s2 = torch.tensor(0.003, device="cuda")
    if glu:  # an MLP's [gate | up], packed for the fused SwiGLU as the runner does
        p = pack_fused([(w[: n // 2], s[: n // 2], s2), (w[n // 2 :], s[n // 2 :], s2)], glu=True)
    else:
        p = pack_nvfp4(w, s, s2)
    del w, s
    return [p] + [dataclasses.replace(p, qw=p.qw.clone(), qs=p.qs.clone()) for _ in range(copies - 1)]


def config_kwargs(cfg: str) -> dict:
    """Launch knobs (none changes the result bits): "dflt" the library's choice, "cross" the cross-CTA
    kernel + splitk_reduce, "cl" the cross-CTA kernel reduced in clusters, "SxR" cross-CTA with STAGES x
    RGW, "clTxR" / "cTxR" the cluster-reduced / cross-CTA kernel with T m16 tiles per warp and R row groups
    per CTA, "rMxP" the register-direct in-CTA split-K kernel with MTW x PF (its slices in RD_CLUSTERS'
    clusters where that table names the config; "rMxPcC": over clusters of C CTAs, "rMxPc1" one CTA),
    "sWxMxP" the slice-activations kernel (nvfp4_gemv_sx) with W warps of M m16 tiles and PF P. A suffix
    "@B" sets the L2 prefetch budget to B MiB (l2pf), e.g. "dflt@16", "r1x2@0". On the fused gate+up only
    the register-direct kernel applies the SwiGLU in its epilogue: the other configs' times include the
    separate silu_mul launch."""
    if "@" in cfg:
        cfg, mib = cfg.split("@")
        return {**config_kwargs(cfg), "l2pf": int(float(mib) * (1 << 20))}
    if cfg == "dflt":
        return {}
    if cfg == "cross":
        return dict(rd=False, cluster=False)
    if cfg == "cl":
        return dict(rd=False, cluster=True)
    if cfg[0] == "c":  # "clTxR" / "cTxR": cluster-reduced / cross-CTA with T m16 tiles per warp, R row groups
        tpw, rgw = (int(v) for v in cfg[2 if cfg.startswith("cl") else 1 :].split("x"))
        return dict(rd=False, cluster=cfg.startswith("cl"), tpw=tpw, rgw=rgw)
    if cfg.startswith("r"):  # "rMxP", "rMxPcC": C CTAs per cluster (rdcl)
        rd, _, cl = cfg[1:].partition("c")
        return dict(rd=tuple(int(v) for v in rd.split("x"))) | (dict(rdcl=int(cl)) if cl else {})
    if cfg.startswith("s"):  # "sWxMxP": activations in shared memory, W warps of M m16 tiles, PF P
        return dict(sx=tuple(int(v) for v in cfg[1:].split("x")))
    st, rgw = (int(v) for v in cfg.split("x"))
    return dict(stages=st, rgw=rgw, cluster=False)


def bf16_config_kwargs(cfg: str) -> dict:
    """BF16 launch knobs (none changes the result bits): "dflt" the library's choice, "rd" the one-warp
    kernel, "gMxPxX" bf16_gemv with M m16 tiles per warp, P weight and X activation chunks in flight."""
    if cfg == "dflt":
        return {}
    if cfg == "rd":
        return dict(rd=True)
    return dict(reg=tuple(int(v) for v in cfg[1:].split("x")))


def bench_shape(
    name: str,
    k: int,
    n: int,
    ms: list[int],
    bw: float,
    configs: list[str],
    splits: list[int] = (),
    bf16_configs: list[str] = (),
    nvfp4: bool = True,
) -> list[dict]:
    wbytes = n * k // 2 + n * k // 16 + n * 4
    reps = max(20, min(1000, int(2e9 / wbytes)))
    copies = min(reps, max(2, -(-L2_ROTATE_BYTES // wbytes)))
    packs = random_packed(n, k, copies, glu=name.startswith("gate+up"))
    n_out = packs[0].out_features
    bcopies = min(reps, max(2, -(-L2_ROTATE_BYTES // (n * k * 2))))
    wbs = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(bcopies)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        out = torch.empty(m, n_out, dtype=torch.bfloat16, device="cuda")
        rows_ws = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")  # GLU rows of non-fusing kernels
        bout = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        ws = torch.empty(MAX_SPLITS, 32, n, device="cuda")  # any bf16 split count
        res = {}
        # "cfg/sS": that launch choice with S split-K slices instead of the weight's (other result bits)
        variants = [(c, {}) for c in ["dflt", *configs]]
        variants += [(f"{c}/s{s}", dict(splits=s)) for s in splits for c in ["dflt", *configs]]
        for cfg, extra in variants if nvfp4 else [("dflt", {})]:
            kw = {**config_kwargs(cfg.split("/")[0]), **extra} | ({"rows": rows_ws} if n_out != n else {})
            try:
                res[cfg] = time_graph(
                    [lambda p=p, x=x, o=out, kw=kw: nvfp4_linear(x, p, out=o, **kw) for p in packs], reps
                )
            except (RuntimeError, ValueError) as e:  # a variant that does not launch is reported, not fatal
                print(f"{name} M={m} config {cfg}: {e}", flush=True)
                torch.cuda.synchronize()
        # Launch knobs never change the result bits; the table reports the library default and the best
        # (a --splits variant changes them: it asks what another choose_splits would give).
        us = res["dflt"]
        best = min(res, key=res.get)
        t_torch = time_graph([lambda w=w, x=x, o=bout: torch.matmul(x, w.t(), out=o) for w in wbs], reps)
        bf16_res = {}
        for cfg in ["dflt", *bf16_configs]:
            kw = bf16_config_kwargs(cfg)
            kw["workspace"] = ws
            fns = [lambda w=w, x=x, o=bout, kw=kw: bf16_linear(x, w, out=o, **kw) for w in wbs]
            bf16_res[cfg] = time_graph(fns, reps)
        t_bf16 = bf16_res["dflt"]
        nbytes = wbytes + m * k * 2 + m * n_out * 2
        gbs = nbytes / (us * 1e-6) / 1e9
        bf16_gbs = (n * k * 2 + m * k * 2 + m * n * 2) / (t_bf16 * 1e-6) / 1e9
        rows.append(
            dict(
                shape=name,
                m=m,
                k=k,
                n=n,
                splits=packs[0].splits,
                best_cfg=best,
                best_us=res[best],
                us=us,
                bytes=nbytes,
                gbs=gbs,
                pct_bw=100 * gbs / bw,
                torch_us=t_torch,
                speedup_vs_torch=t_torch / us,
                bf16_us=t_bf16,
                bf16_pct_bw=100 * bf16_gbs / bw,
                bf16_vs_torch=t_torch / t_bf16,
                config_sweep=res,
                bf16_sweep=bf16_res,
                bf16_bytes=n * k * 2 + m * k * 2 + m * n * 2,
            )
        )
    del packs, wbs
    torch.cuda.empty_cache()
    return rows


def print_sweep(what: str, rows: list[dict], sweep: str, nbytes: str, bw: float) -> None:
    """One line per (shape, M): each launch variant's us and % of copy bandwidth (BF16 rows: and cuBLAS)."""
    print(f"\n{what}sweep: us per launch (median, graph replay) and % of copy bandwidth by launch variant")
    for r in rows:
        pct = {c: 100 * r[nbytes] / (us * 1e-6) / 1e9 / bw for c, us in r[sweep].items()}
        cells = [f"{c} {us:.1f} ({pct[c]:.0f}%)" for c, us in r[sweep].items()]
        peer = f"cuBLAS {r['torch_us']:.1f}  " if sweep == "bf16_sweep" else ""
        print(f"{r['shape']:22} {r['m']:3d}  {peer}" + "  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="*", default=[1, 8, 16, 32])
    ap.add_argument("--configs", nargs="*", default=[], help="launch variants timed besides the default")
    ap.add_argument("--only", nargs="*", default=[], help="shapes whose name contains one of these")
    ap.add_argument("--splits", type=int, nargs="*", default=[], help="also time each config with S slices")
    ap.add_argument("--bf16-configs", nargs="*", default=[], help="BF16 launch variants (bf16_config_kwargs)")
    ap.add_argument("--no-nvfp4", action="store_true", help="time the NVFP4 default only (BF16 sweeps)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bws = copy_bandwidth()
    bw = max(bws.values())
    print(f"copy bandwidth {bws}", flush=True)
    rows = []
    for name, k, n in SHAPES:
        if args.only and not any(o in name for o in args.only):
            continue
        rows += bench_shape(
            name, k, n, args.m, bw, args.configs, args.splits, args.bf16_configs, not args.no_nvfp4
        )
        print(f"done {name}", flush=True)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.cuda.get_device_name()
    bw_end = copy_bandwidth()
    print(f"copy bandwidth at the end {bw_end}", flush=True)
    (out_dir / "bench_linear.json").write_text(
        json.dumps(dict(device=dev, copy_gbs=bw, copy=bws, copy_end=bw_end, rows=rows), indent=1)
    )
    if args.configs or args.splits:
        print_sweep("", rows, "config_sweep", "bytes", bw)
    if args.bf16_configs:
        print_sweep("BF16 ", rows, "bf16_sweep", "bf16_bytes", bw)
    print(f"\n{dev}: device copy {bw:.0f} GB/s (read+write); NVFP4 W4A16, times in us (median, graph replay)")
    hdr = f"{'shape':22} {'M':>3} {'S':>2} {'us':>8} {'MB':>8} {'GB/s':>6} {'%bw':>5} "
    hdr += f"{'/M1':>5} {'cuBLAS us':>9} {'xcuBLAS':>7} {'bf16 us':>8} {'bf16%bw':>7} {'bf16x':>5} "
    hdr += f"{'best':>5} {'cfg':>7}"
    print(hdr)
    m1 = {r["shape"]: r["us"] for r in rows if r["m"] == 1}
    for r in rows:
        rel = r["us"] / m1.get(r["shape"], r["us"])
        print(
            f"{r['shape']:22} {r['m']:3d} {r['splits']:2d} {r['us']:8.1f} "
            f"{r['bytes'] / 1e6:8.1f} {r['gbs']:6.0f} {r['pct_bw']:5.1f} {rel:5.2f} {r['torch_us']:9.1f} "
            f"{r['speedup_vs_torch']:7.2f} "
            f"{r['bf16_us']:8.1f} {r['bf16_pct_bw']:7.1f} {r['bf16_vs_torch']:5.2f} "
            f"{r['best_us']:5.1f} {r['best_cfg']:>7}"
        )


if __name__ == "__main__":
    main()
