"""Prefix caching on the 27B model: time to first token of a follow-up turn, cold and from a snapshot.

Weights: random NVFP4 at the real 27B config (as bench_decode.py). A conversation's next prompt is the
previous prompt + the answer + a new message, so the engine can resume after the previous prompt
(lumo/engine/prefix.py: from the latest snapshot of the recurrent state on the 2048-token prefill grid;
the answer, decoded, is prefilled again). For each context C: turn 1 = C random tokens, turn 2 = turn 1 +
`--answer` + `--message` tokens. One table, printed last:
- turn 2's time to first token (prefill + first sample, one host sync; median of `--trials`) cold (no
  prefix cache) and warm (after turn 1 on the same runner), the tokens each prefilled, and the speedup;
- the floor of the warm time: its prefilled tokens at the cold prefill's own rate (tokens/s of this run);
- turn 1's cost of taking its snapshots (with the cache on against off) and their memory;
- whether warm and cold agree bitwise: the first token's logits, every GDN/conv state and the K/V;
- with an unrelated `--side`-token request (a coding agent's side call) between the two turns: turn 2's
  time to first token and cached tokens with the conversation parked (prefix.py; `--park` positions at
  most) and without parking, the side request's time with and without parking (its copy aside), and
  whether turn 2 after it still equals the cold one bitwise;
- a coding agent with a sub-agent: turn 1, a side request, a `--sub`-token sub-agent conversation, a side
  request, the sub-agent's next turn (+ `--answer` + `--message`), a side request, turn 2: the two next
  turns' time to first token and cached tokens with two lines parked (the default) and with one.
JSON goes to $OUT or bench/results/bench_prefix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from lumo.engine.gpu_weights import config_27b, pack_weights, random_model_weights
from lumo.engine.prefix import PARK_POSITIONS
from lumo.engine.runner import GPURunner

GB = 1e9


def first_token(runner: GPURunner, ids: list[int]) -> tuple[float, int]:
    """(seconds, tokens taken from the prefix cache) of resume + prefill + the first token's host read."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start = runner.resume(ids)
    runner.prefill(ids[start:])
    runner.token()
    return time.perf_counter() - t0, start


def state(runner: GPURunner, n: int) -> list[torch.Tensor]:
    kv = [t[:n] for t in runner.kv_k + runner.kv_v]
    return [t.clone() for t in (runner.logits[0], *runner.gdn_state, *runner.conv_state, *kv)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64, help="model depth (64 = the real 27B)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--answer", type=int, default=400, help="tokens of the previous answer in turn 2")
    ap.add_argument("--message", type=int, default=100, help="tokens of the new message in turn 2")
    ap.add_argument("--snapshots", type=int, default=4, help="prefix snapshots kept (LLM's default)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--side", type=int, default=600, help="tokens of the side request between the turns")
    ap.add_argument("--park", type=int, default=PARK_POSITIONS, help="positions a parked prefix keeps aside")
    ap.add_argument("--sub", type=int, default=8192, help="tokens of the sub-agent's conversation")
    args = ap.parse_args()

    cfg = config_27b(num_layers=args.layers)
    dev = torch.cuda.get_device_name()
    w = random_model_weights(cfg, "cuda", nvfp4=True, seed=0)
    gw = pack_weights(cfg, w, "cuda")
    del w
    extra = args.answer + args.message
    runner = GPURunner(cfg, gw, max(args.contexts) + extra + 64)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for C in args.contexts:
        turn1 = torch.randint(0, cfg.vocab_size, (C,), generator=gen).tolist()
        turn2 = turn1 + torch.randint(0, cfg.vocab_size, (extra,), generator=gen).tolist()
        side = torch.randint(0, cfg.vocab_size, (args.side,), generator=gen).tolist()
        runner.prefix = None
        for warm_up in (turn1[:4096], side):  # kernels compiled and loaded, each prefill's shapes seen
            first_token(runner, warm_up)
        cold, cold1, warm, warm1 = [], [], [], []
        after = {True: [], False: []}  # parked: turn 2's time after the side request
        side_t = {True: [], False: []}  # parked: the side request's time
        for _ in range(args.trials):
            runner.prefix = None
            cold1.append(first_token(runner, turn1)[0])
            t, _ = first_token(runner, turn2)
            cold.append(t)
            want = state(runner, len(turn2))
            runner.enable_prefix_cache(args.snapshots)
            warm1.append(first_token(runner, turn1)[0])
            snap_bytes = runner.prefix.nbytes()
            for _ in range(8):  # the answer decoded: positions past turn 1, never reused
                runner.decode_step(use_graph=False)
            t, cached = first_token(runner, turn2)
            warm.append(t)
            got = state(runner, len(turn2))
            equal = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            for parked in (True, False):
                runner.enable_prefix_cache(args.snapshots, args.park if parked else 0)
                first_token(runner, turn1)
                for _ in range(8):
                    runner.decode_step(use_graph=False)
                side_t[parked].append(first_token(runner, side)[0])
                for _ in range(8):
                    runner.decode_step(use_graph=False)
                t, cached_after = first_token(runner, turn2)
                after[parked].append((t, cached_after))
                if parked:
                    got = state(runner, len(turn2))
                    equal_after = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        sub = torch.randint(0, cfg.vocab_size, (args.sub,), generator=gen).tolist()
        sub2 = sub + torch.randint(0, cfg.vocab_size, (extra,), generator=gen).tolist()
        agent = {2: [], 1: []}  # lines parked: (sub-agent's turn 2 s, cached, turn 2 s, cached) per trial
        for _ in range(args.trials):
            for lines in agent:
                runner.enable_prefix_cache(args.snapshots, args.park, lines)
                for prompt in (turn1, sub):
                    first_token(runner, prompt)
                    for _ in range(8):
                        runner.decode_step(use_graph=False)
                    first_token(runner, side)
                ts, cs = first_token(runner, sub2)
                for _ in range(8):
                    runner.decode_step(use_graph=False)
                first_token(runner, side)
                agent[lines].append((ts, cs, *first_token(runner, turn2)))
        cold_s, warm_s = statistics.median(cold), statistics.median(warm)
        rate = len(turn2) / cold_s  # tokens/s of a cold prefill of turn 2
        row = {
            "context": C,
            "turn2_tokens": len(turn2),
            "cold_ms": cold_s * 1e3,
            "warm_ms": warm_s * 1e3,
            "cached_tokens": cached,
            "warm_prefilled": len(turn2) - cached,
            "warm_floor_ms": (len(turn2) - cached) / rate * 1e3,
            "speedup": cold_s / warm_s,
            "turn1_off_ms": statistics.median(cold1) * 1e3,
            "turn1_on_ms": statistics.median(warm1) * 1e3,
            "snapshot_gb": snap_bytes / GB,
            "bitwise_equal": equal,
            "after_side_ms": statistics.median(t for t, _ in after[True]) * 1e3,
            "after_side_cached": after[True][-1][1],
            "after_side_unparked_ms": statistics.median(t for t, _ in after[False]) * 1e3,
            "after_side_unparked_cached": after[False][-1][1],
            "side_ms": statistics.median(side_t[True]) * 1e3,
            "side_unparked_ms": statistics.median(side_t[False]) * 1e3,
            "after_side_bitwise_equal": equal_after,
            "trials": {
                "agent": agent,
                "cold": cold,
                "warm": warm,
                "turn1_off": cold1,
                "turn1_on": warm1,
                "after": after,
                "side": side_t,
            },
        }
        for lines, trials in agent.items():  # medians over the trials
            sub_s, sub_cached, turn2_s, turn2_cached = (
                statistics.median(x) for x in zip(*trials, strict=True)
            )
            row |= {f"agent_sub_ms_{lines}": sub_s * 1e3, f"agent_sub_cached_{lines}": sub_cached}
            row |= {f"agent_turn2_ms_{lines}": turn2_s * 1e3, f"agent_turn2_cached_{lines}": turn2_cached}
        rows.append(row)
        print(
            f"context {C}: turn 2 cold {row['cold_ms']:.1f} ms, warm {row['warm_ms']:.1f} ms "
            f"({cached} cached), equal {equal}",
            flush=True,
        )

    print(f"\n{dev}, {args.layers}-layer 27B config, random NVFP4; turn 2 = turn 1 + {extra} tokens")
    head = (
        "context | turn 2 cold ms | warm ms | floor ms | cached / prefilled | speedup | "
        "turn 1 snapshots on / off ms | snapshots GB | bitwise"
    )
    print(head)
    for r in rows:
        print(
            f"{r['context']} | {r['cold_ms']:.1f} | {r['warm_ms']:.1f} | {r['warm_floor_ms']:.1f} | "
            f"{r['cached_tokens']} / {r['warm_prefilled']} | {r['speedup']:.1f}x | "
            f"{r['turn1_on_ms']:.1f} / {r['turn1_off_ms']:.1f} | {r['snapshot_gb']:.2f} | "
            f"{r['bitwise_equal']}"
        )
    print(
        f"\nturn 2 after an unrelated {args.side}-token request (a side call); "
        f"a parked prefix keeps at most {args.park} positions"
    )
    print(
        "context | turn 2 ms parked (cached) | unparked (cached) | side request ms parked / unparked "
        "| bitwise"
    )
    for r in rows:
        print(
            f"{r['context']} | {r['after_side_ms']:.1f} ({r['after_side_cached']}) | "
            f"{r['after_side_unparked_ms']:.1f} ({r['after_side_unparked_cached']}) | "
            f"{r['side_ms']:.1f} / {r['side_unparked_ms']:.1f} | {r['after_side_bitwise_equal']}"
        )
    print(
        f"\na coding agent: turn 1, a {args.sub}-token sub-agent conversation, the sub-agent's next turn, "
        f"turn 2, a {args.side}-token side request after each; two lines parked / one"
    )
    print("context | sub-agent's turn 2 ms (cached), 2 lines | 1 line | turn 2 ms (cached), 2 lines | 1 line")
    for r in rows:
        cells = [
            f"{r[f'agent_{w}_ms_{n}']:.1f} ({r[f'agent_{w}_cached_{n}']:.0f})"
            for w in ("sub", "turn2")
            for n in (2, 1)
        ]
        print(f"{r['context']} | " + " | ".join(cells))
    out = Path(os.environ.get("OUT", "bench/results")) / "bench_prefix.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": dev, "layers": args.layers, "rows": rows}, indent=1))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
