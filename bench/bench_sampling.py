"""What the sampling penalties, min-p and the logit bias cost (lumo.engine.sampling; sampling.cu).

1. `sample_tokens` alone on random bf16 logits rows (V = the 27B's 248,320 and the embedded model's), 1
   row (a plain step) and 32 rows (a tree verify, each row with a path of 11 drafted tokens), greedy,
   temperature 0.8 / top-k 20 / top-p 0.95 (Qwen's defaults: a top-k row's candidates by warp merges) and
   temperature 0.8 / top-p 0.95 (256 candidates by sorts): the kernels' GPU time per call (CUDA events
   over launches queued behind a sleep) with nothing on, with Qwen's presence_penalty 1.5 plus repetition
   1.1, with min_p 0.05 and with a logit bias on 300 tokens; the floor is the rows' bytes at the copy
   bandwidth measured here.
2. The embedded model on the GPU kernels (CUDA graphs), plain and tree decoding, 12 held-out prompts x
   `--tokens`, greedy: tokens/s and accepted drafts per event without and with presence_penalty 1.5, and
   with a logit bias (the drafter proposes under the same penalties and bias: tree_ops.cu topk_partial);
   tree must equal plain in each.
Medians of `--repeats` runs. JSON to $OUT or bench/results/bench_sampling.json.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_spec import embedded_on_gpu, gpu_us_per_call, graphed_decoder, repeated_requests, save_json

from lumo.benchmark import copy_bandwidth
from lumo.engine.llm import embedded_model_path
from lumo.engine.sampling import SamplingParams, bias_vector
from lumo.kernels.sampling import Penalties, sample_tokens, sample_workspace
from lumo.weights import load_model

PATH = 11  # drafted tokens on a verify row's path (the default tree's depth)
BENCH_BIAS = tuple((7 + 331 * i, 5.0 - 10 * (i % 2)) for i in range(300))  # ids modulo V (331: coprime)
SETTINGS = {
    "off": SamplingParams(),
    "presence 1.5, repetition 1.1": SamplingParams(presence_penalty=1.5, repetition_penalty=1.1),
    "min_p 0.05": SamplingParams(min_p=0.05),
    "logit bias, 300 tokens": SamplingParams(logit_bias=BENCH_BIAS),
}
# The embedded model's logit bias (tests/test_gpu_spec_gpu.py: '0' banned, '\n' lowered, ' the' lifted)
EMBEDDED_BIAS = ((15, -100.0), (198, -3.0), (339, 5.0))


def _kernel_us(args: tuple, kw: dict) -> float:
    """GPU us per sample_tokens call (gpu_us_per_call)."""
    sample_tokens(*args, **kw)  # compiled and warm
    return gpu_us_per_call(lambda: sample_tokens(*args, **kw))[0]


def micro(vocab: list[int], repeats: int, bw: float) -> list[dict]:
    out = []
    for V in vocab:
        for T in (1, 32):
            logits = torch.randn(T, V, device="cuda").mul_(4).bfloat16()
            counts = torch.zeros(V, dtype=torch.int32, device="cuda")
            counts[torch.randint(0, V, (2000,), device="cuda")] = 1  # ~2000 tokens generated
            prompt = (torch.rand(V, device="cuda") < 0.02).to(torch.uint8)
            path = torch.randint(0, 32, (T, PATH), dtype=torch.int32, device="cuda") if T > 1 else None
            node_tokens = torch.randint(0, V, (32,), dtype=torch.int32, device="cuda")
            ws = sample_workspace(T, V, "cuda")
            for mode, base in (
                ("greedy", dict(temperature=0.0)),
                ("t0.8 k20 p0.95", dict(top_k=20, top_p=0.95)),
                ("t0.8 p0.95", dict(top_p=0.95)),
            ):
                for name, s in SETTINGS.items():
                    p = SamplingParams(**{**s.__dict__, "temperature": 0.8, **base})
                    f32 = dict(dtype=torch.float32, device="cuda")
                    args = (
                        logits,
                        torch.full((T,), p.temperature, **f32),
                        torch.full((T,), p.top_k, dtype=torch.int32, device="cuda"),
                        torch.full((T,), p.top_p, **f32),
                        torch.full((T,), 3, dtype=torch.int64, device="cuda"),
                        torch.arange(T, dtype=torch.int64, device="cuda") + 1000,
                    )
                    pen = torch.tensor([Penalties.row(p)] * T, **f32)
                    bias = bias_vector(tuple((i % V, b) for i, b in p.logit_bias), V, "cuda")  # distinct ids
                    kw = dict(
                        out=torch.empty(T, dtype=torch.int32, device="cuda"),
                        workspace=ws,
                        min_p=torch.full((T,), p.min_p_threshold, **f32),
                        penalties=Penalties(pen, counts, prompt, path, node_tokens, bias),
                    )
                    us = statistics.median(_kernel_us(args, kw) for _ in range(repeats))
                    floor = T * V * 2 / bw * 1e6
                    out.append(
                        {"V": V, "rows": T, "mode": mode, "setting": name, "us": us, "floor_us": floor}
                    )
    return out


def embedded(tokens: int, repeats: int) -> list[dict]:
    cfg, gw, prompts, capacity = embedded_on_gpu(12, tokens)
    out = []
    for name, params in (
        ("off", SamplingParams(temperature=0.0)),
        ("presence 1.5", SamplingParams(temperature=0.0, presence_penalty=1.5)),
        ("logit bias", SamplingParams(temperature=0.0, logit_bias=EMBEDDED_BIAS)),
    ):
        ref = None
        for mode in ("plain", "tree"):
            dec = graphed_decoder(cfg, gw, capacity, mode, params)
            what = f"{mode} with penalties {name}: not plain decoding's tokens"
            rate, ref, accepted = repeated_requests(dec, prompts, tokens, repeats, ref, what)
            mean = sum(accepted) / len(accepted) if accepted else float("nan")
            out.append({"penalties": name, "mode": mode, "tok_s": rate, "accepted": mean})
            del dec
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    bw = copy_bandwidth(1 << 28)
    cfg = load_model(embedded_model_path(), device="cpu", progress=False)[0]
    m = micro([248320, cfg.vocab_size], args.repeats, bw)
    e = embedded(args.tokens, args.repeats)
    print(f"\n{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; medians")
    print("| V | rows | mode | setting | sample_tokens GPU us | floor us (rows' bytes) |")
    print("|---|---|---|---|---|---|")
    for r in m:
        print(
            f"| {r['V']} | {r['rows']} | {r['mode']} | {r['setting']} | {r['us']:.1f} | {r['floor_us']:.2f} |"
        )
    print("\n| embedded model, greedy | penalties / bias | tokens/s | accepted drafts / event |")
    print("|---|---|---|---|")
    for r in e:
        print(f"| {r['mode']} | {r['penalties']} | {r['tok_s']:.0f} | {r['accepted']:.2f} |")
    save_json("bench_sampling.json", {"copy_GBps": bw / 1e9, "micro": m, "embedded": e})


if __name__ == "__main__":
    main()
