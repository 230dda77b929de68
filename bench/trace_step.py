"""Timeline of the NVFP4 GEMVs inside one 27B decode step (diagnostics; H200 or any sm_90+ GPU).

Every CTA of `nvfp4_gemv_rd` (the decode step's NVFP4 kernel at M <= 8) records %globaltimer at its start,
after its pdl_wait, after its main loop and at its end (linear.cu, LUMO_TRACE; `lumo.kernels.linear.
set_trace`). One graph-replayed step at context 1k is traced; per weight shape the script prints, as
medians over the step's launches of that shape (us):
- span: first pdl_wait return -> last CTA end (the launch's time once its inputs are ready), its bytes /
  span as % of the copy bandwidth measured here, and the time bytes / bandwidth would take;
- ramp: first wait return -> the first CTA's end of main loop; CTA: a CTA's median main-loop time (wait
  return or start, whichever later, -> end of loop); epi: median loop end -> CTA end;
- p50 / p90 / last: when the CTAs end, from the first wait return (the tail is last - p90);
- gap: the previous GEMV's last CTA end -> this launch's first wait return (the row kernels between them);
- early: how long before its first wait return the launch's first CTA started (PDL, its L2 prefetch).
Also the traced step's time against the untraced one (the trace's own cost), and the timer's resolution.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from dataclasses import fields, is_dataclass

import torch

from bench.bench_decode import copy_bandwidth, time_decode
from lumo.engine.gpu_weights import config_27b, pack_weights, random_model_weights
from lumo.engine.runner import GPURunner
from lumo.kernels import linear
from lumo.kernels.linear import PackedNVFP4

MAX_RECORDS = 1 << 20


def packed_weights(obj, path: str = "", seen=None) -> dict[int, tuple[str, int, PackedNVFP4]]:
    """{qw address: (shape name, bytes, packed)} of every PackedNVFP4 reachable from `obj`."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return {}
    seen.add(id(obj))
    found = {}
    if isinstance(obj, PackedNVFP4):
        nbytes = sum(t.numel() * t.element_size() for t in (obj.qw, obj.qs, obj.gs))
        name = f"{obj.k}->{obj.n}" + (" glu" if obj.glu_n else "")
        return {obj.qw.data_ptr(): (name, nbytes, obj)}
    if is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            found |= packed_weights(getattr(obj, f.name), f"{path}.{f.name}", seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found |= packed_weights(v, f"{path}[{i}]", seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found |= packed_weights(v, f"{path}[{k}]", seen)
    return found


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    cfg = config_27b(num_layers=args.layers)
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    gw = pack_weights(cfg, random_model_weights(cfg, "cuda", nvfp4=True, seed=0), "cuda")
    weights = packed_weights(gw)

    plain = GPURunner(cfg, gw, args.context + 256)
    plain.capture()
    plain_ms = time_decode(plain, args.context, 32)[0]
    del plain
    torch.cuda.synchronize()

    buf = torch.zeros(1 + MAX_RECORDS, 8, dtype=torch.int64, device="cuda")
    linear.set_trace(buf)
    runner = GPURunner(cfg, gw, args.context + 256)
    runner.capture()
    traced_ms = time_decode(runner, args.context, 32)[0]
    runner.seek(args.context)
    runner.decode_step()
    torch.cuda.synchronize()
    buf.zero_()
    runner.decode_step()
    torch.cuda.synchronize()
    linear.set_trace(None)
    n = int(buf[0, 0])
    if n > MAX_RECORDS:
        raise SystemExit(f"{n} records do not fit the buffer of {MAX_RECORDS}")
    rec = buf[1 : 1 + n].cpu().tolist()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s")
    print(f"step {plain_ms:.3f} ms, traced {traced_ms:.3f} ms; {n} CTA records")
    report(rec, {k: (name, nbytes) for k, (name, nbytes, _) in weights.items()}, bw)


def report(rec: list[list[int]], weights: dict[int, tuple[str, int]], bw: float) -> None:
    """Print the per-shape table and the per-launch CTA counts of the records (see the docstring)."""

    stamps = sorted({r[i] for r in rec for i in range(4)})
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a]
    print(f"timer: {len(stamps)} distinct stamps, smallest step {min(steps)} ns, median {med(steps):.0f} ns")

    launches = defaultdict(list)
    for r in rec:
        launches[r[7]].append(r)
    order = sorted(launches, key=lambda k: min(r[1] for r in launches[k]))
    t_zero = min(r[0] for r in rec)
    rows = []
    prev_end = None
    for key in order:
        rs = launches[key]
        name, nbytes = weights.get(key, (f"? {key:#x}", 0))
        wait0 = min(r[1] for r in rs)
        ends = sorted(r[3] - wait0 for r in rs)
        last = ends[-1]
        row = {
            "name": name,
            "ctas": len(rs),
            "sms": len({r[6] >> 32 for r in rs}),
            "bytes": nbytes,
            "start": (wait0 - t_zero) / 1e3,
            "span": last / 1e3,
            "ramp": (min(r[2] for r in rs) - wait0) / 1e3,
            "cta": med([(r[2] - max(r[0], r[1])) / 1e3 for r in rs]),
            "epi": med([(r[3] - r[2]) / 1e3 for r in rs]),
            "p50": ends[len(ends) // 2] / 1e3,
            "p90": ends[int(len(ends) * 0.9)] / 1e3,
            "early": (wait0 - min(r[0] for r in rs)) / 1e3,
            "gap": (wait0 - prev_end) / 1e3 if prev_end is not None else float("nan"),
        }
        prev_end = max(r[3] for r in rs)
        rows.append(row)

    total = (prev_end - min(min(r[1] for r in launches[k]) for k in order)) / 1e3
    print(f"{len(order)} GEMV launches over {total:.0f} us (first wait return -> last end)")
    by_shape = defaultdict(list)
    for row in rows:
        by_shape[row["name"]].append(row)
    print()
    print("medians over each shape's launches, us (see the docstring)")
    hdr = (
        f"{'shape':<22}{'calls':>6}{'CTAs':>6}{'MB':>7}{'ideal':>7}{'span':>7}{'%bw':>5}{'ramp':>7}{'CTA':>7}"
        f"{'epi':>6}{'p50':>7}{'p90':>7}{'last':>7}{'gap':>7}{'early':>7}{'sum span':>9}{'sum gap':>8}"
    )
    print(hdr)
    for name, rs in sorted(by_shape.items(), key=lambda kv: -sum(r["span"] for r in kv[1])):
        mb = rs[0]["bytes"] / 1e6
        ideal = rs[0]["bytes"] / bw * 1e6
        span = med([r["span"] for r in rs])
        print(
            f"{name:<22}{len(rs):>6}{rs[0]['ctas']:>6}{mb:>7.1f}{ideal:>7.1f}{span:>7.1f}"
            f"{100 * ideal / span:>5.0f}{med([r['ramp'] for r in rs]):>7.1f}"
            f"{med([r['cta'] for r in rs]):>7.1f}"
            f"{med([r['epi'] for r in rs]):>6.1f}{med([r['p50'] for r in rs]):>7.1f}"
            f"{med([r['p90'] for r in rs]):>7.1f}{span:>7.1f}{med([r['gap'] for r in rs]):>7.1f}"
            f"{med([r['early'] for r in rs]):>7.1f}{sum(r['span'] for r in rs):>9.0f}"
            f"{sum(r['gap'] for r in rs if r['gap'] == r['gap']):>8.0f}"
        )
    # One launch of each shape in detail: CTAs running per 1 us from its first wait return.
    print()
    print("CTAs past their wait and not yet ended, per us from the first wait return (one launch per shape,")
    print("the one nearest the middle of the step); '|' marks the p90 end")
    for name in by_shape:
        keys = [k for k in order if weights.get(k, ("",))[0] == name]
        recs = launches[keys[len(keys) // 2]]
        wait0 = min(r[1] for r in recs)
        ends = sorted(r[3] for r in recs)
        p90 = int((ends[int(len(ends) * 0.9)] - wait0) / 1e3)
        cells = []
        for b in range(int((ends[-1] - wait0) / 1e3) + 1):
            lo, hi = wait0 + b * 1000, wait0 + (b + 1) * 1000
            c = sum(1 for r in recs if max(r[0], r[1]) < hi and r[3] > lo)
            cells.append(f"{c}" + ("|" if b == p90 else ""))
        per_sm = defaultdict(int)
        for r in recs:
            if max(r[0], r[1]) < wait0 + 1000:
                per_sm[r[6] >> 32] += 1
        cells.append(f"(first us: {min(per_sm.values())}-{max(per_sm.values())} CTAs per SM)")
        print(f"{name:<22} " + " ".join(cells))


if __name__ == "__main__":
    main()
