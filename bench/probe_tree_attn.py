"""Probe: where attn_tree_chunk's time goes (TREE_PROBE builds of attention.cu), H200, the 27B shape.

    python -m bench.probe_tree_attn

Launches the chunk kernels alone (graph replay, 32 tree rows) at a few contexts: the tree kernel in full, with
scores only, without its partial stores, without its K/V staging, staging only; attn_decode_chunk; the
merge alone. Also prints ptxas's register / spill lines for the device's own build.
"""

from __future__ import annotations

import torch

from bench.bench_linear import time_graph
from lumo.kernels.attention import THREADS, _shmem, _tree_shmem, attn_decode_workspace, chunk_slots
from lumo.kernels.compile import (
    arch_of,
    compile_kernel,
    compile_to_cubin,
    define_options,
    resolve_source,
    sm_count,
)

NH, NKV, D, T = 24, 4, 256, 32
MAX_LEN = 131264


def launcher(kern, grid, block, args, shmem=0):
    return lambda: kern.launch(grid, block, args, shmem=shmem, pdl=True)


def ptxas_lines(defines: dict) -> None:
    log: list[str] = []
    src = resolve_source("attention.cu").read_text()
    compile_to_cubin(
        src, arch_of(), define_options(defines) + ("--ptxas-options=-v",), "attention.cu", log=log
    )
    lines = "\n".join(log).splitlines()
    for i, line in enumerate(lines):
        if "Function properties for attn_" in line and "merge" not in line:
            print(defines, line.split("for ")[-1], "|", lines[i + 1].strip(), "|", lines[i + 2].strip())


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    kc, vc = (torch.randn(MAX_LEN, NKV, D, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(T, NH, D, device=dev, generator=gen, dtype=torch.bfloat16)
    mask = torch.tensor([(1 << (i + 1)) - 1 for i in range(T)], dtype=torch.int64, device=dev)
    acc, ml = attn_decode_workspace(T, NH, D, MAX_LEN, dev)
    nch = acc.shape[2]
    out = torch.empty_like(q)
    for si in (1, 2, 4):
        ptxas_lines({"D": D, "G": NH // NKV, "TREE_SI": si})
    variants = [(f"tree SI={si}", "attn_tree_chunk", {"TREE_SI": si}) for si in (2, 1, 4)]
    variants += [("tree PVU=2", "attn_tree_chunk", {"TREE_PVU": 2})]
    variants += [(f"tree probe {p}", "attn_tree_chunk", {"TREE_PROBE": p}) for p in (1, 2, 3, 4)]
    variants += [("decode_chunk", "attn_decode_chunk", {})]
    merge = compile_kernel("attention.cu", "attn_decode_merge_head", {"D": D, "G": NH // NKV})
    print("| kernel | " + " | ".join(f"{c} us" for c in (2880, 8192, 32768, 131072)) + " |")
    print("|---|---|---|---|---|")
    for name, kname, extra in variants + [("merge_head", None, {})]:
        cells = []
        for ctx in (2880, 8192, 32768, 131072):
            length = torch.tensor([ctx], dtype=torch.int32, device=dev)
            if kname is None:
                args = (acc, ml, length, mask, q, 0, 0, out, NH, nch, 0)
                fn = launcher(merge, (T * NH, 1), 256, args)
            else:
                kern = compile_kernel("attention.cu", kname, {"D": D, "G": NH // NKV, **extra})
                shmem = _tree_shmem(D) if "tree" in kname else _shmem(D)
                slots = chunk_slots(NKV, nch, sm_count(dev) * max(1, kern.blocks_per_sm(THREADS, shmem)), T)
                args = (q, kc, vc, length, mask, acc, ml, NKV, MAX_LEN, nch, T)
                fn = lambda k=kern, a=args, s=slots, m=shmem: k.launch(
                    (NKV, s + T), THREADS, a, shmem=m, pdl=True
                )  # noqa: E731
            cells.append(f"{time_graph([fn], reps=20, trials=7):.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
