"""What logprobs cost (lumo/engine/logprobs.py): per emitted token, and in tokens/s of the embedded model.

1. `token_logprobs` alone on random bf16 logits rows: microseconds per token at vocabulary sizes V (the
   embedded model's, Qwen3's 151,936 and the 27B's 248,320), for 1 row (a plain step) and 8 rows (an
   event's accepted path, scored row by row), k = 0 / 5 / 20 alternatives; the host copy included.
2. The embedded model on the GPU kernels (CUDA graphs), plain and tree decoding, 12 held-out prompts x
   `--tokens`: tokens/s without logprobs and with k = 5; the tokens must not change.
The floor printed beside (1): one log_softmax's read of the row at the copy bandwidth measured here. Medians
of `--repeats` runs. JSON to $OUT or bench/results/bench_logprobs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from bench_spec import decode_timed, held_out_prompts

from lumo.config import TreeConfig
from lumo.engine.gpu_decode import GPUDecoder
from lumo.engine.gpu_spec import GPUSpecDecoder, GPUSpecEngine
from lumo.engine.gpu_weights import pack_weights
from lumo.engine.llm import embedded_model_path
from lumo.engine.logprobs import token_logprobs
from lumo.engine.runner import GPURunner
from lumo.engine.sampling import SamplingParams
from lumo.weights import load_model


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * x.numel() / statistics.median(times)


def micro(vocab: list[int], repeats: int, bw: float) -> list[dict]:
    rows = []
    for V in vocab:
        logits = torch.randn(8, V, device="cuda").mul_(4).bfloat16()
        for n in (1, 8):
            tokens = torch.randint(0, V, (n,)).tolist()
            for k in (0, 5, 20):
                times = []
                for _ in range(repeats):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    token_logprobs(logits[:n], tokens, k)  # ends in its host copy
                    times.append(time.perf_counter() - t0)
                us = statistics.median(times) / n * 1e6
                rows.append({"V": V, "rows": n, "k": k, "us_per_token": us, "floor_us": V * 2 / bw * 1e6})
    return rows


def embedded(tokens: int, repeats: int) -> list[dict]:
    path = embedded_model_path()
    cfg, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    gw = pack_weights(cfg, w, "cuda", mtp=True)
    prompts = held_out_prompts(path, 12)
    capacity = max(len(p) for p in prompts) + tokens + 128
    params = SamplingParams(temperature=0.0)
    out = []
    for mode in ("plain", "tree"):
        runner = GPURunner(cfg, gw, capacity)
        if mode == "plain":
            dec = GPUDecoder(runner, params, use_graph=True)
        else:
            dec = GPUSpecDecoder(GPUSpecEngine(runner, TreeConfig()), params, use_graph=True)
        res, ref = {}, None
        for k in (None, 5):
            dec.logprobs = k
            runs = []
            for _ in range(repeats):
                n, secs, got = 0, 0.0, []
                for p in prompts:
                    toks, t = decode_timed(dec, p, tokens)
                    n, secs = n + len(toks) - 1, secs + t
                    got.append(toks[:tokens])
                if ref is None:
                    ref = got
                assert got == ref, "logprobs changed the tokens"
                runs.append(n / secs)
            res[k] = statistics.median(runs)
        out.append({"mode": mode, "tok_s": res[None], "tok_s_logprobs5": res[5]})
        del dec, runner
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bw = copy_bandwidth()
    cfg = load_model(embedded_model_path(), device="cpu", progress=False)[0]
    m = micro([cfg.vocab_size, 151936, 248320], 20, bw)
    e = embedded(args.tokens, args.repeats)
    print(f"\n{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; medians")
    print("| V | rows | k | us per token | floor us (row read once) |")
    print("|---|---|---|---|---|")
    for r in m:
        print(f"| {r['V']} | {r['rows']} | {r['k']} | {r['us_per_token']:.1f} | {r['floor_us']:.2f} |")
    print("\n| embedded model | tokens/s | with logprobs (k = 5) | ratio |")
    print("|---|---|---|---|")
    for r in e:
        a, b = r["tok_s"], r["tok_s_logprobs5"]
        print(f"| {r['mode']} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    dst = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "bench_logprobs.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "micro": m, "embedded": e}
    dst.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
