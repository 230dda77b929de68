"""Where a prompt's first prefill of a new length spends its time (session 43: bench_prefix's first
600-token side request took 1.66 s on an H100 after a 4096-token warm-up, later ones 0.12-0.15 s).

The 27B config with random NVFP4 weights (as bench_prefix.py). After a warm-up prefill of 4096 tokens,
prompts of several lengths are timed one after another on a fresh prefix state, each with the NVRTC
compiles and kernel loads it caused; the slowest call is profiled (cProfile, host time) and its top
functions printed. Then the same with the prefix cache and parking on (bench_prefix's side request).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import lumo.kernels.compile as kc
from lumo.engine.gpu_weights import config_27b, pack_weights, random_model_weights
from lumo.engine.runner import GPURunner

COUNTS = {"compile": 0, "compile_s": 0.0, "load": 0}


def _counting(fn, key):
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            COUNTS[key] += 1
            if key == "compile":
                COUNTS["compile_s"] += time.perf_counter() - t0

    return wrapped


def first_token(runner: GPURunner, ids: list[int]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start = runner.resume(ids)
    runner.prefill(ids[start:])
    runner.token()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[600, 600, 700, 1500, 4100, 130, 600])
    args = ap.parse_args()
    kc.compile_to_cubin = _counting(kc.compile_to_cubin, "compile")
    kc._load = _counting(kc._load, "load")
    cfg = config_27b(num_layers=args.layers)
    w = random_model_weights(cfg, "cuda", nvfp4=True, seed=0)
    gw = pack_weights(cfg, w, "cuda")
    del w
    runner = GPURunner(cfg, gw, 40000)
    gen = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()

    rows = []

    def timed(label, ids, prof=False):
        before = dict(COUNTS)
        p = cProfile.Profile() if prof else None
        if p:
            p.enable()
        t = first_token(runner, ids)
        if p:
            p.disable()
            s = io.StringIO()
            pstats.Stats(p, stream=s).sort_stats("cumulative").print_stats(25)
            print(s.getvalue())
        rows.append(
            (
                label,
                len(ids),
                t * 1e3,
                COUNTS["compile"] - before["compile"],
                COUNTS["compile_s"] - before["compile_s"],
                COUNTS["load"] - before["load"],
            )
        )

    timed("warm-up", rand(4096))
    for n in args.lengths:
        runner.prefix = None
        timed("fresh", rand(n), prof=(n == args.lengths[0] and len(rows) == 1))
    runner.enable_prefix_cache(4, 8192)
    turn1 = rand(8192)
    timed("turn 1 (cache on)", turn1)
    for _ in range(8):
        runner.decode_step(use_graph=False)
    timed("side (parks turn 1)", rand(600), prof=True)
    timed("turn 2 (swaps back)", turn1 + rand(500))
    print(f"{torch.cuda.get_device_name()}, {args.layers} layers")
    print("call | tokens | ms | NVRTC compiles (s) | kernel loads")
    for label, n, ms, c, cs, ld in rows:
        print(f"{label} | {n} | {ms:.1f} | {c} ({cs:.2f}) | {ld}")


if __name__ == "__main__":
    main()
