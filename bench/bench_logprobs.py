"""What logprobs cost (lumo/engine/logprobs.py): per emitted token, and in tokens/s of the embedded model.

1. `token_logprobs` alone on random bf16 logits rows: microseconds per token at vocabulary sizes V (the
   embedded model's, Qwen3's 151,936 and the 27B's 248,320), for 1 row (a plain step), 8 rows (an event's
   accepted path) and 256 rows (a block of prompt rows), k = 0 / 5 / 20 alternatives; the host copy
   included. Beside it, in the same run: the previous torch path (session 33: one log_softmax launch per
   row, then torch's gather / top-k, one host copy; the prompt's rows in one log_softmax), and the kernel
   alone per call: its GPU time (CUDA events over launches queued behind a sleep) next to its floor, the
   rows' one read, and the host's time to launch it (cuda-python, the workspace given).
2. The embedded model on the GPU kernels (CUDA graphs), plain and tree decoding, 12 held-out prompts x
   `--tokens`: tokens/s without logprobs and with k = 5; the tokens must not change.
The floor: the rows' bytes at the copy bandwidth measured here. Medians of `--repeats` runs. JSON to $OUT
or bench/results/bench_logprobs.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_spec import embedded_on_gpu, gpu_us_per_call, graphed_decoder, repeated_requests, save_json

from lumo.benchmark import copy_bandwidth
from lumo.engine.llm import embedded_model_path
from lumo.engine.logprobs import token_logprobs
from lumo.engine.sampling import SamplingParams
from lumo.kernels.logprobs import LogprobsWorkspace, row_logprobs
from lumo.weights import load_model


def torch_path(rows: torch.Tensor, tokens: list[int], k: int) -> list:
    """Session 33's token_logprobs on a GPU, kept here as the comparison: torch only."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=rows.device)
    if rows.shape[0] <= 8:  # a decoder's rows: one launch each (the exactness needed it)
        lp = torch.cat([torch.log_softmax(r[None], dim=-1, dtype=torch.float32) for r in rows])
    else:  # a prompt's rows together
        lp = torch.log_softmax(rows, dim=-1, dtype=torch.float32)
    parts = [lp.gather(1, ids[:, None])]
    if k:
        parts += list(torch.topk(lp, k, dim=-1))
    return torch.cat([p.double() for p in parts], dim=1).cpu().tolist()


def _median_us(fn, repeats: int, *args) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args)  # ends in its host copy
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _kernel_us(rows: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[float, float]:
    """(GPU us, host us) per row_logprobs call (gpu_us_per_call)."""
    ws = LogprobsWorkspace.new(rows.shape[0], rows.shape[1], rows.device)
    out = row_logprobs(rows, ids, k, workspace=ws)  # compiled and warm
    return gpu_us_per_call(lambda: row_logprobs(rows, ids, k, out=out, workspace=ws), launches=20)


def micro(vocab: list[int], repeats: int, bw: float) -> list[dict]:
    out = []
    for V in vocab:
        logits = torch.randn(256, V, device="cuda").mul_(4).bfloat16()
        for n in (1, 8, 256):
            rows, tokens = logits[:n], torch.randint(0, V, (n,)).tolist()
            ids = torch.tensor(tokens, device="cuda")
            for k in (0, 5, 20):
                token_logprobs(rows, tokens, k)
                torch_path(rows, tokens, k)
                out.append(
                    {
                        "V": V,
                        "rows": n,
                        "k": k,
                        "us_per_token": _median_us(token_logprobs, repeats, rows, tokens, k) / n,
                        "torch_us_per_token": _median_us(torch_path, repeats, rows, tokens, k) / n,
                        **dict(zip(("kernels_us", "host_us"), _kernel_us(rows, ids, k), strict=True)),
                        "floor_us": n * V * 2 / bw * 1e6,
                    }
                )
    return out


def embedded(tokens: int, repeats: int) -> list[dict]:
    cfg, gw, prompts, capacity = embedded_on_gpu(12, tokens)
    params = SamplingParams(temperature=0.0)
    out = []
    for mode in ("plain", "tree"):
        dec = graphed_decoder(cfg, gw, capacity, mode, params)
        res, ref = {}, None
        for k in (None, 5):
            dec.logprobs = k
            res[k], ref, _ = repeated_requests(
                dec, prompts, tokens, repeats, ref, "logprobs changed the tokens"
            )
        out.append({"mode": mode, "tok_s": res[None], "tok_s_logprobs5": res[5]})
        del dec
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bw = copy_bandwidth(1 << 28)
    cfg = load_model(embedded_model_path(), device="cpu", progress=False)[0]
    m = micro([cfg.vocab_size, 151936, 248320], 20, bw)
    e = embedded(args.tokens, args.repeats)
    print(f"\n{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; medians")
    print("| V | rows | k | us per token | previous (torch) | kernel GPU us | floor us | host us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in m:
        print(
            f"| {r['V']} | {r['rows']} | {r['k']} | {r['us_per_token']:.1f} | {r['torch_us_per_token']:.1f} "
            f"| {r['kernels_us']:.1f} | {r['floor_us']:.2f} | {r['host_us']:.1f} |"
        )
    print("\n| embedded model | tokens/s | with logprobs (k = 5) | ratio |")
    print("|---|---|---|---|")
    for r in e:
        a, b = r["tok_s"], r["tok_s_logprobs5"]
        print(f"| {r['mode']} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    save_json("bench_logprobs.json", {"copy_GBps": bw / 1e9, "micro": m, "embedded": e})


if __name__ == "__main__":
    main()
