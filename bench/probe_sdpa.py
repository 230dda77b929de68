"""Which torch SDPA backend attn_prefill runs, and what a prompt length it has not seen costs.

Session 43: a 600-token prefill after a 4096-token warm-up took 1.7 s on an H100, 1.5 s of it in
`scaled_dot_product_attention` (cProfile, bench/probe_first_prompt.py), and every later new length
75-140 ms more than a repeat. Per-shape planning points at the cuDNN backend. This runs attn_prefill on the
27B's attention shape (24 query heads, 4 kv heads, head_dim 256, bf16) in one process per backend choice
(each starts cold): the first and a repeated call for a sequence of chunk lengths and starts, the steady
time of full 2048-token chunks at long starts, and whether each choice's output equals the default's.
Prints one table.

    python bench/probe_sdpa.py            # all choices, each in a subprocess
    python bench/probe_sdpa.py --only flash,efficient
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

CHOICES = ["default", "flash,efficient", "flash", "efficient", "cudnn"]
SHAPES = [(2048, 0), (2048, 2048), (600, 0), (600, 0), (700, 0), (1500, 0), (130, 0), (500, 8192), (4, 4096)]
STEADY = [(2048, 32768), (2048, 131072)]


def one(choice: str) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lumo.kernels.attention import attn_prefill

    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
    names["cudnn"] = SDPBackend.CUDNN_ATTENTION
    names["math"] = SDPBackend.MATH
    nh, nkv, d, L = 24, 4, 256, 131072 + 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(L, nkv, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(L, nkv, d, device="cuda", generator=g).to(torch.bfloat16)
    q = torch.randn(2048, nh, d, device="cuda", generator=g).to(torch.bfloat16)

    def call(T, start):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if choice == "default":
            o = attn_prefill(q[:T], k, v, start)
        else:
            with sdpa_kernel([names[c] for c in choice.split(",")]):
                o = attn_prefill(q[:T], k, v, start)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, o

    rows, outs = [], {}
    for T, start in SHAPES:
        t1, o = call(T, start)
        t2, _ = call(T, start)
        rows.append([T, start, t1 * 1e3, t2 * 1e3])
        outs[f"{T},{start}"] = o
    steady = []
    for T, start in STEADY:
        call(T, start)
        ts = sorted(call(T, start)[0] for _ in range(5))
        steady.append([T, start, ts[2] * 1e3])
    torch.save({k_: o.cpu() for k_, o in outs.items()}, f"/tmp/sdpa_{choice.replace(',', '_')}.pt")
    return {"choice": choice, "rows": rows, "steady": steady}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="one choice, in this process")
    ap.add_argument("--choices", default=";".join(CHOICES))
    args = ap.parse_args()
    if args.only:
        print("JSON " + json.dumps(one(args.only)))
        return
    results = []
    for c in args.choices.split(";"):
        r = subprocess.run([sys.executable, __file__, "--only", c], capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("JSON ")]
        if r.returncode or not line:
            print(f"{c}: failed\n{r.stderr[-1500:]}")
            continue
        results.append(json.loads(line[0][5:]))
    base = torch.load("/tmp/sdpa_default.pt") if results and results[0]["choice"] == "default" else None
    print(
        f"\n{torch.cuda.get_device_name()}: attn_prefill, 24 / 4 heads, head_dim 256, bf16; ms first / repeat"
    )
    print(
        "choice | "
        + " | ".join(f"T {T} at {s}" for T, s in SHAPES)
        + " | steady "
        + " | ".join(f"T {T} at {s}" for T, s in STEADY)
        + " | == default"
    )
    for r in results:
        same = "-"
        if base is not None:
            got = torch.load(f"/tmp/sdpa_{r['choice'].replace(',', '_')}.pt")
            same = all(torch.equal(got[k], base[k]) for k in base)
        cells = [f"{a:.1f} / {b:.1f}" for _, _, a, b in r["rows"]] + [f"{t:.2f}" for _, _, t in r["steady"]]
        print(f"{r['choice']} | " + " | ".join(cells) + f" | {same}")


if __name__ == "__main__":
    main()
