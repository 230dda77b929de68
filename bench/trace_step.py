"""Timeline of the NVFP4 GEMVs and row kernels inside one 27B decode step (diagnostics; any sm_90+ GPU).

Thread 0 of every CTA of `nvfp4_gemv_rd` (the decode step's NVFP4 kernel at M <= 8) records %globaltimer at
the CTA's start, after its pdl_wait, after warp 0's main loop and at the end of warp 0's epilogue; so do the
CTAs of `gdn_recurrent_norm` (start, wait, operands prepared, state stored, end) and `rmsnorm1p_residual`
(start, wait, rows loaded and squares summed, end) (trace.cuh; `lumo.kernels.trace.set_trace`). One
graph-replayed step at context 1k is traced.
A launch is identified by its weight pointer (each weight runs once per step). Per weight shape the script
prints medians over the step's launches of that shape, in us:
- span: first pdl_wait return -> last CTA end (the launch's time once its inputs are ready), the time its
  bytes take at the copy bandwidth measured here (ideal), and ideal / span as % of that bandwidth;
- ramp: first wait return -> the first end of a main loop; loop: a CTA's main loop (wait return -> end of
  loop); epi: end of loop -> end of the CTA;
- p50 / p90: when the CTAs end, from the first wait return;
- gap: the previous GEMV's last CTA end -> this launch's first wait return (the row kernels between them);
- early: how long before its first wait return the launch's first CTA started (PDL, its L2 prefetch).
Then, for the launch of each shape nearest the middle of the step, the CTAs running at the middle of each
microsecond from its first wait return, and the CTAs per SM in its first microsecond. Then the row kernels,
medians over each kind's launches, us: early (as above), before (the previous traced launch's last CTA end ->
this one's first wait return: the kernel boundary), load (wait return -> operands in registers), work (->
the GDN state stored), end (-> the CTA's end: barrier, norm, stores), span (first wait return -> last end),
after (-> the next traced launch's first wait return). Also the traced replay's time against the untraced
step's, and the timer's resolution.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from dataclasses import fields, is_dataclass

import torch
from bench_decode import copy_bandwidth, time_decode  # same folder

from lumo.engine.gpu_weights import config_27b, pack_weights, random_model_weights
from lumo.engine.runner import GPURunner
from lumo.kernels.linear import PackedNVFP4
from lumo.kernels.trace import set_trace

KINDS = {0: "nvfp4_gemv_rd", 1: "gdn_recurrent_norm", 2: "rmsnorm1p_residual"}  # trace.cuh TRACE_KIND_*

MAX_RECORDS = 1 << 20  # a 27B step makes ~272k


def packed_weights(obj, seen: set[int] | None = None) -> dict[int, tuple[str, int]]:
    """{qw address: (shape name, bytes)} of every PackedNVFP4 reachable from `obj`."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return {}
    seen.add(id(obj))
    if isinstance(obj, PackedNVFP4):
        nbytes = sum(t.numel() * t.element_size() for t in (obj.qw, obj.qs, obj.gs))
        return {obj.qw.data_ptr(): (f"{obj.k}->{obj.n}" + (" glu" if obj.glu_n else ""), nbytes)}
    found = {}
    if is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            found |= packed_weights(getattr(obj, f.name), seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found |= packed_weights(v, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            found |= packed_weights(v, seen)
    return found


def med(xs) -> float:
    xs = [x for x in xs if x == x]  # without NaN (the first launch has no gap)
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

    plain = GPURunner(cfg, gw, args.context + 256)
    plain.capture()
    plain_ms = time_decode(plain, args.context, 32)[0]
    del plain
    torch.cuda.synchronize()

    buf = torch.zeros(1 + MAX_RECORDS, 8, dtype=torch.int64, device="cuda")
    set_trace(buf)
    try:
        runner = GPURunner(cfg, gw, args.context + 256)
        runner.capture()
        for _ in range(3):
            runner.seek(args.context)
            runner.decode_step()
        runner.seek(args.context)
        torch.cuda.synchronize()
        buf.zero_()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        runner.decode_step()
        t1.record()
        torch.cuda.synchronize()
        traced_ms = t0.elapsed_time(t1)
        n = int(buf[0, 0])
        rec = buf[1 : 1 + min(n, MAX_RECORDS)].cpu().tolist()
    finally:
        set_trace(None)
    if n > MAX_RECORDS:
        raise SystemExit(f"{n} records do not fit the buffer of {MAX_RECORDS}")
    if not rec:
        raise SystemExit("no nvfp4_gemv_rd launch was traced")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s")
    print(
        f"step {plain_ms:.3f} ms (median of replays), this traced replay {traced_ms:.3f} ms; {n} CTA records"
    )
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report([r for r in rec if r[5] == 0], packed_weights(gw), bw, sms)
    report_rows(rec)


def report(rec: list[list[int]], weights: dict[int, tuple[str, int]], bw: float, sms: int) -> None:
    """Print the per-shape table and one launch per shape in detail (see the docstring)."""
    stamps = sorted({r[i] for r in rec for i in range(4)})
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > a]
    if steps:
        print(
            f"timer: {len(stamps)} distinct stamps, smallest step {min(steps)} ns, median {med(steps):.0f} ns"
        )

    launches = defaultdict(list)
    for r in rec:
        launches[r[7]].append(r)
    order = sorted(launches, key=lambda k: min(r[1] for r in launches[k]))
    short = [k for k in order if len(launches[k]) != launches[k][0][6] & 0xFFFFFFFF]
    if short:
        print(
            f"warning: {len(short)} launches lack records of some CTAs (a weight run twice, or lost records)"
        )
    rows = []
    prev_end = None
    for key in order:
        rs = launches[key]
        name, nbytes = weights.get(key, (f"? {key:#x}", 0))
        wait0 = min(r[1] for r in rs)
        ends = sorted(r[3] - wait0 for r in rs)
        rows.append(
            {
                "key": key,
                "name": name,
                "ctas": len(rs),
                "bytes": nbytes,
                "span": ends[-1] / 1e3,
                "ramp": (min(r[2] for r in rs) - wait0) / 1e3,
                "loop": med([(r[2] - r[1]) / 1e3 for r in rs]),
                "epi": med([(r[3] - r[2]) / 1e3 for r in rs]),
                "p50": ends[len(ends) // 2] / 1e3,
                "p90": ends[int(len(ends) * 0.9)] / 1e3,
                "early": (wait0 - min(r[0] for r in rs)) / 1e3,
                "gap": (wait0 - prev_end) / 1e3 if prev_end is not None else float("nan"),
            }
        )
        prev_end = max(r[3] for r in rs)

    first = min(r[1] for r in rec)
    print(
        f"{len(order)} GEMV launches over {(prev_end - first) / 1e3:.0f} us (first wait return -> last end)"
    )
    by_shape = defaultdict(list)
    for row in rows:
        by_shape[row["name"]].append(row)
    print()
    print("medians over each shape's launches, us (see the docstring)")
    cols = ["ideal", "span", "%bw", "ramp", "loop", "epi", "p50", "p90", "gap", "early"]
    print(
        f"{'shape':<22}{'calls':>6}{'CTAs':>6}{'MB':>7}"
        + "".join(f"{c:>7}" for c in cols)
        + "  sum span  sum gap"
    )
    for name, rs in sorted(by_shape.items(), key=lambda kv: -sum(r["span"] for r in kv[1])):
        ideal = rs[0]["bytes"] / bw * 1e6
        span = med([r["span"] for r in rs])
        vals = [ideal, span, 100 * ideal / span if span > 0 else float("nan")] + [
            med([r[c] for r in rs]) for c in cols[3:]
        ]
        sums = f"{sum(r['span'] for r in rs):>10.0f}{sum(r['gap'] for r in rs if r['gap'] == r['gap']):>9.0f}"
        print(
            f"{name:<22}{len(rs):>6}{rs[0]['ctas']:>6}{rs[0]['bytes'] / 1e6:>7.1f}"
            + "".join(f"{v:>7.1f}" for v in vals)
            + sums
        )
    print()
    print(
        "CTAs running at the middle of each us from the first wait return (the launch of each shape nearest"
    )
    print("the middle of the step); '|' marks the p90 end; then CTAs per SM in the first us (min-max)")
    for name, rs in by_shape.items():
        recs = launches[rs[len(rs) // 2]["key"]]
        wait0 = min(r[1] for r in recs)
        ends = sorted(r[3] for r in recs)
        p90 = int((ends[int(len(ends) * 0.9)] - wait0) / 1e3)
        cells = []
        for b in range(int((ends[-1] - wait0) / 1e3) + 1):
            mid = wait0 + b * 1000 + 500
            running = sum(1 for r in recs if r[1] <= mid < r[3])
            cells.append(f"{running}" + ("|" if b == p90 else ""))
        per_sm = [0] * sms
        for r in recs:
            if r[1] < wait0 + 1000 and (r[6] >> 32) < sms:
                per_sm[r[6] >> 32] += 1
        print(f"{name:<22} " + " ".join(cells) + f" ({min(per_sm)}-{max(per_sm)} per SM)")


def report_rows(rec: list[list[int]]) -> None:
    """The row kernels' table (see the docstring), with each launch placed among all traced launches."""
    launches = defaultdict(list)
    for r in rec:
        launches[(r[5], r[7])].append(r)
    order = sorted(launches, key=lambda k: min(r[1] for r in launches[k]))
    bounds = [(min(r[1] for r in launches[k]), max(r[3] for r in launches[k])) for k in order]
    rows = defaultdict(list)
    for i, key in enumerate(order):
        kind, rs = key[0], launches[key]
        if kind == 0:
            continue
        wait0, end = bounds[i]
        row = {
            "early": (wait0 - min(r[0] for r in rs)) / 1e3,
            "before": (wait0 - bounds[i - 1][1]) / 1e3 if i else float("nan"),
            "load": med([(r[2] - r[1]) / 1e3 for r in rs]),
            "work": med([(r[4] - r[2]) / 1e3 for r in rs]) if kind == 1 else float("nan"),
            "end": med([(r[3] - (r[4] if kind == 1 else r[2])) / 1e3 for r in rs]),
            "span": (end - wait0) / 1e3,
            "after": (bounds[i + 1][0] - end) / 1e3 if i + 1 < len(order) else float("nan"),
        }
        rows[kind].append(row | {"ctas": len(rs)})
    if not rows:
        print("no row-kernel launch was traced")
        return
    print()
    first, last = bounds[0][0], max(b[1] for b in bounds)
    between = sum(max(0, b[0] - a[1]) for a, b in zip(bounds, bounds[1:], strict=False)) / 1e3
    print(
        f"{len(order)} traced launches over {(last - first) / 1e3:.0f} us; {between:.0f} us of it between "
        "one traced launch's last CTA end and the next one's first wait return (kernel boundaries and the "
        "untraced kernels: attention, b/a, sampling)"
    )
    cols = ["early", "before", "load", "work", "end", "span", "after"]
    print("row kernels, medians over each kind's launches, us (see the docstring)")
    print(
        f"{'kernel':<22}{'calls':>6}{'CTAs':>6}" + "".join(f"{c:>8}" for c in cols) + "  sum span  sum before"
    )
    for kind, rs in sorted(rows.items()):
        vals = [med([r[c] for r in rs]) for c in cols]
        before = sum(r["before"] for r in rs if r["before"] == r["before"])
        sums = f"{sum(r['span'] for r in rs):>10.0f}{before:>12.0f}"
        print(f"{KINDS[kind]:<22}{len(rs):>6}{rs[0]['ctas']:>6}" + "".join(f"{v:>8.2f}" for v in vals) + sums)


if __name__ == "__main__":
    main()
