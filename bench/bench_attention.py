"""Decode / tree-verify attention (attn_decode: split-K chunk kernel + merge) on the 27B's attention shape.

    python -m bench.bench_attention [--contexts 1024 8192 ...] [--rows 1 32]

One table: microseconds per call (median of graph replays, rotating over 16 layer caches of the model's
131264-slot capacity, as in the decode step), the K/V bytes a call must read (the committed prefix once,
whatever the row count), GB/s and % of the device copy bandwidth measured in the same run, and the floor:
those bytes plus, for tree rows, the split-K partials the chunk kernel writes and the merge reads back
(T x nh x 1 KB per 128-position chunk, 4 bytes per dim; the bits require them), at the copy bandwidth.
Rows 32 is a 32-node tree verify (a chain of masks: row i sees tree slots 0..i). The last column times the
same call on the previous kernel, whose outputs must be bitwise equal (checked here too): for tree rows
attn_decode_chunk against attn_tree_chunk (the default where it fits); for one row attn_decode_chunk
against attn_decode_chunk_pipe (the default: a walking CTA loads its next chunk's K during this chunk).
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import torch

from bench.bench_linear import copy_bandwidth, time_graph
from lumo.kernels import attention
from lumo.kernels.attention import CHUNK, attn_decode, attn_decode_workspace, tree_chunk_kernel

NH, NKV, D = 24, 4, 256  # the 27B's gated attention
MAX_LEN = 131264  # bench_decode's cache capacity (128k context + tree slots)
LAYERS = 16  # the 27B's attention layers: the caches a decode step walks through


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_attention.json"))
    args = ap.parse_args()
    if max(args.contexts) + max(args.rows) > MAX_LEN or max(args.rows) > 63:
        raise SystemExit(f"bench_attention: context + rows must fit {MAX_LEN} slots, rows <= 63")
    dev = torch.device("cuda")
    bw = max(copy_bandwidth().values())
    gen = torch.Generator(device=dev).manual_seed(0)
    caches = [
        tuple(torch.randn(MAX_LEN, NKV, D, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        for _ in range(LAYERS)
    ]
    name = torch.cuda.get_device_name()
    rows_out = []
    print(f"\n## bench_attention: {name}, nh {NH}, nkv {NKV}, d {D}; copy bandwidth {bw:.0f} GB/s")
    print("| context | rows | us/call | K/V MB | GB/s | % of copy bw | floor us | x floor | previous us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in args.rows:
        q = torch.randn(T, NH, D, device=dev, generator=gen, dtype=torch.bfloat16)
        gate = torch.randn(T, NH, D, device=dev, generator=gen, dtype=torch.bfloat16)
        mask = torch.tensor([(1 << (i + 1)) - 1 for i in range(T)], dtype=torch.int64, device=dev)
        out = torch.empty_like(q)
        ws = attn_decode_workspace(T, NH, D, MAX_LEN, dev)
        for ctx in args.contexts:
            length = torch.tensor([ctx], dtype=torch.int32, device=dev)
            call = partial(attn_decode, gate=gate, out=out, workspace=ws)
            fns = [partial(call, q, k, v, length, mask) for k, v in caches]
            us = time_graph(fns, reps=4 * LAYERS, trials=9)
            kv_bytes = 2 * (ctx + T) * NKV * D * 2
            part_bytes = 0 if T == 1 else 2 * T * NH * (ctx // CHUNK) * (D + 2) * 4
            floor_us = (kv_bytes + part_bytes) / (bw * 1e9) * 1e6
            gbs = kv_bytes / (us * 1e-6) / 1e9
            row = {"context": ctx, "rows": T, "us": us, "kv_mb": kv_bytes / 1e6, "gbs": gbs}
            row["floor_us"] = floor_us
            old_us = ""
            if tree_chunk_kernel(T, D, dev):  # the same call on the previous kernel: time and bits
                previous = {"tree_chunk": False}
            elif T * NH // NKV <= 16 and attention.DECODE_PIPE:
                previous = {"pipe": False}
            else:
                previous = None
            if previous:
                fns[0]()
                new_out = out.clone()
                old = [partial(call, q, k, v, length, mask, **previous) for k, v in caches]
                row["previous_us"] = time_graph(old, reps=4 * LAYERS, trials=9)
                old[0]()
                row["bits_equal"] = torch.equal(out, new_out)
                old_us = f"{row['previous_us']:.1f}" + ("" if row["bits_equal"] else " (BITS DIFFER)")
            rows_out.append(row)
            print(
                f"| {ctx} | {T} | {us:.1f} | {kv_bytes / 1e6:.1f} | {gbs:.0f} | {100 * gbs / bw:.1f} | "
                f"{floor_us:.1f} | {us / floor_us:.2f} | {old_us} |"
            )
    Path(args.json).write_text(json.dumps({"device": name, "copy_gbs": bw, "rows": rows_out}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
