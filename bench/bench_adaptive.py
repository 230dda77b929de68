"""Adaptive speculation: tokens/s of plain decoding, tree decoding, and tree decoding that falls back to
plain steps while events do not pay (lumo/engine/adaptive.py), in cases where speculation pays and where
it does not. The output is the same in the three modes (checked here: token for token).

Cases (one table, printed last):
- the embedded model (held-out prompts, `--tokens` each), greedy (~6 accepted drafts per event: the tree
  pays) and at temperature 1.0 (under 1: it does not);
- a random 27B NVFP4 model (its MTP head drafts noise: ~0 accepted drafts per event, the worst case for
  speculation) at `--contexts` positions of random prompt.
Each mode decodes with CUDA graphs and its one host sync per call; time excludes prefill. The goal printed
beside the adaptive mode: its tokens/s over the better of plain and tree (1.0 = as fast as the better).
JSON goes to $OUT or bench/results/bench_adaptive.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from bench_spec import decode_timed, held_out_prompts

from lumo.config import TreeConfig
from lumo.engine.adaptive import AdaptiveSpec
from lumo.engine.gpu_decode import GPUDecoder
from lumo.engine.gpu_spec import GPUSpecDecoder, GPUSpecEngine
from lumo.engine.gpu_weights import config_27b, pack_weights, random_model_weights
from lumo.engine.llm import embedded_model_path
from lumo.engine.runner import GPURunner
from lumo.engine.sampling import SamplingParams
from lumo.weights import load_model

MODES = ("plain", "tree", "adaptive")


def decode(cfg, gw, mode: str, prompts: list[list[int]], new: int, params: SamplingParams) -> dict:
    """Tokens/s of one mode over the prompts (one runner, graphs captured once), its tokens and counts."""
    capacity = max(len(p) for p in prompts) + new + 128
    runner = GPURunner(cfg, gw, capacity)
    if mode == "plain":
        dec = GPUDecoder(runner, params, use_graph=True)
    else:
        dec = GPUSpecDecoder(GPUSpecEngine(runner, TreeConfig()), params, use_graph=True)
    tokens, n_tok, secs, events, plain_steps, accepted = [], 0, 0.0, 0, 0, 0
    if mode == "adaptive":
        dec.adaptive = AdaptiveSpec()  # one for all the prompts, as SpecBackend keeps it
    for p in prompts:
        out, t = decode_timed(dec, p, new)
        secs += t
        n_tok += len(out) - 1
        tokens.append(out[:new])
        if mode != "plain":
            events += dec.stats.events
            plain_steps += dec.stats.plain_steps
            accepted += sum(dec.stats.accepted)
    del dec, runner
    torch.cuda.empty_cache()
    return {
        "tokens_per_s": n_tok / secs,
        "events": events,
        "plain_steps": plain_steps,
        "accepted_per_event": accepted / events if events else 0.0,
        "tokens": tokens,
    }


def case(name: str, cfg, gw, prompts, new: int, params: SamplingParams) -> dict:
    res = {m: decode(cfg, gw, m, prompts, new, params) for m in MODES}
    same = all(res[m]["tokens"] == res["plain"]["tokens"] for m in MODES)
    best = max(res["plain"]["tokens_per_s"], res["tree"]["tokens_per_s"])
    row = {"case": name, "same_tokens": same, "adaptive_vs_best": res["adaptive"]["tokens_per_s"] / best}
    for m in MODES:
        r = res[m]
        row[m] = {k: v for k, v in r.items() if k != "tokens"}
    print(
        f"{name}: plain {res['plain']['tokens_per_s']:.0f}, tree {res['tree']['tokens_per_s']:.0f}, "
        f"adaptive {res['adaptive']['tokens_per_s']:.0f} tok/s; same tokens {same}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per prompt, embedded model")
    ap.add_argument("--contexts", type=int, nargs="*", default=[1024, 32768], help="27B prompt lengths")
    ap.add_argument("--tokens-27b", type=int, default=96)
    ap.add_argument("--layers", type=int, default=64)
    args = ap.parse_args()
    rows = []

    path = embedded_model_path()
    cfg, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    gw = pack_weights(cfg, w, "cuda", mtp=True)
    prompts = held_out_prompts(path, args.prompts)
    for name, params in (
        ("embedded, greedy", SamplingParams(temperature=0.0)),
        ("embedded, temperature 1.0", SamplingParams(temperature=1.0, seed=1)),
    ):
        rows.append(case(name, cfg, gw, prompts, args.tokens, params))

    if args.contexts:
        cfg = config_27b(args.layers)
        w = random_model_weights(cfg, "cuda", nvfp4=True, seed=0, mtp=True)
        gw = pack_weights(cfg, w, "cuda", mtp=True, draft_nvfp4=True)
        del w
        torch.cuda.empty_cache()
        for C in args.contexts:
            ids = torch.randint(0, cfg.vocab_size, (C,), generator=torch.Generator().manual_seed(C)).tolist()
            greedy = SamplingParams(temperature=0.0)
            rows.append(case(f"27B random, {C} context", cfg, gw, [ids], args.tokens_27b, greedy))

    print(f"\n{torch.cuda.get_device_name()}; tokens/s with CUDA graphs, host syncs included")
    print("case | plain | tree (accepted / event) | adaptive (events / plain steps) | adaptive / best | same")
    for r in rows:
        t, a = r["tree"], r["adaptive"]
        print(
            f"{r['case']} | {r['plain']['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} "
            f"({t['accepted_per_event']:.2f}) | {a['tokens_per_s']:.0f} "
            f"({a['events']} / {a['plain_steps']}) | {r['adaptive_vs_best']:.2f} | {r['same_tokens']}"
        )
    out = Path(os.environ.get("OUT", "bench/results")) / "bench_adaptive.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
