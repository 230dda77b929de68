"""Probe: one decode row's attention split into its two launches, us per call at the 27B shape.

    python -m bench.probe_decode_attn [--contexts 8192 32768 131072]

For each context: the chunk kernel alone (attn_decode_chunk and attn_decode_chunk_pipe, whose partials are
compared bitwise with attn_decode_chunk's), the merge kernel alone (attn_decode_merge, its output compared
bitwise with the library call's) and the library call (attn_decode), graph replays rotating over 16 layer
caches as in bench_attention. Session 30's runs (with the builds of its experiment commit 9984776):
bench/results/probe_decode_attn_session30.log.
"""

from __future__ import annotations

import argparse
import ctypes
from functools import partial

import torch

from bench.bench_attention import LAYERS, MAX_LEN, NH, NKV, D
from bench.bench_linear import time_graph
from lumo.kernels.attention import CHUNK, THREADS, _shmem, attn_decode, attn_decode_workspace, chunk_slots
from lumo.kernels.compile import compile_kernel, sm_count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    caches = [
        tuple(torch.randn(MAX_LEN, NKV, D, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        for _ in range(LAYERS)
    ]
    q = torch.randn(1, NH, D, device=dev, generator=gen, dtype=torch.bfloat16)
    gate = torch.randn(1, NH, D, device=dev, generator=gen, dtype=torch.bfloat16)
    mask = torch.ones(1, dtype=torch.int64, device=dev)
    ws = attn_decode_workspace(1, NH, D, MAX_LEN, dev)
    acc, ml = ws
    nch = acc.shape[2]
    defines = {"D": D, "G": NH // NKV}
    names = ("attn_decode_chunk", "attn_decode_chunk_pipe")
    chunks = [compile_kernel("attention.cu", n, defines) for n in names]
    merge = compile_kernel("attention.cu", "attn_decode_merge", defines)
    out = torch.empty_like(q)
    heads = [f"{n} us" for n in names] + ["attn_decode_merge us", "attn_decode us"]
    print("| context | " + " | ".join(heads) + " |")
    print("|---" * (1 + len(heads)) + "|")
    for ctx in args.contexts:
        length = torch.tensor([ctx], dtype=torch.int32, device=dev)
        row = []
        for kern in chunks:
            slots = chunk_slots(NKV, nch, sm_count(dev) * max(1, kern.blocks_per_sm(THREADS, _shmem(D))), 1)
            fns = [
                partial(
                    kern.launch,
                    (NKV, slots + 1),
                    THREADS,
                    (q, k, v, length, mask, acc, ml, NKV, MAX_LEN, nch, 1),
                    shmem=_shmem(D),
                    pdl=True,
                )
                for k, v in caches
            ]
            row.append(time_graph(fns, reps=4 * LAYERS, trials=9))
            fns[0]()
            nc = -(-(ctx + 1) // CHUNK)
            if kern is chunks[0]:
                ref_parts = (acc[:, :, :nc].clone(), ml[:, :, :nc].clone())
            assert torch.equal(acc[:, :, :nc], ref_parts[0]) and torch.equal(ml[:, :, :nc], ref_parts[1])
        ref = attn_decode(q, *caches[0], length, mask, gate=gate, workspace=ws).clone()
        margs = (
            acc,
            ml,
            length,
            mask,
            gate,
            ctypes.c_longlong(gate.stride(0)),
            gate.stride(1),
            out,
            NH,
            nch,
            1,
        )
        fn = partial(merge.launch, (NH, D // 32), 256, margs, pdl=True)
        row.append(time_graph([fn], reps=4 * LAYERS, trials=9))
        fn()
        assert torch.equal(out, ref), "merge: bits differ"
        lib = [
            partial(attn_decode, q, k, v, length, mask, gate=gate, out=out, workspace=ws) for k, v in caches
        ]
        row.append(time_graph(lib, reps=4 * LAYERS, trials=9))
        print(f"| {ctx} | " + " | ".join(f"{x:.1f}" for x in row) + " |")


if __name__ == "__main__":
    main()
