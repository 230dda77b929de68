"""CPU: the attention references (and the SDPA prefill) agree with lumo.model.attention."""

from __future__ import annotations

import pytest
import torch

from lumo.kernels.attention import (
    HEAD_DIMS,
    _shmem,
    attn_decode_ref,
    attn_prefill,
    attn_prefill_ref,
    check_heads,
    chunk_slots,
)
from lumo.model import attention


def rand_cache(max_len: int, nkv: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(max_len, nkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(max_len, nkv, d, generator=gen).to(torch.bfloat16)
    return k, v


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("length,T,nh,nkv,d", [(0, 5, 4, 2, 64), (37, 7, 6, 2, 64), (300, 3, 24, 4, 256)])
def test_decode_ref_chain_is_causal_attention(length, T, nh, nkv, d):
    gen = torch.Generator().manual_seed(length + T)
    kc, vc = rand_cache(length + T + 5, nkv, d, gen)
    q = torch.randn(T, nh, d, generator=gen).to(torch.bfloat16)
    mask = torch.tensor([(1 << (i + 1)) - 1 for i in range(T)], dtype=torch.int64)  # a chain: causal
    got = attn_decode_ref(q, kc, vc, length, mask)
    ref = attention(q[None].float(), kc[None, : length + T].float(), vc[None, : length + T].float(), length)[
        0
    ]
    assert rel_err(got, ref) < 1e-5


def test_decode_ref_tree_rows_are_their_paths():
    gen = torch.Generator().manual_seed(3)
    nh, nkv, d, length = 4, 2, 64, 19
    # spine 0-1-2-3, siblings 4 (child of 0), 5 (child of 1), 6 (child of 2)
    parent = [-1, 0, 1, 2, 0, 1, 2]
    T = len(parent)
    anc = []
    for i in range(T):
        bits, j = 0, i
        while j >= 0:
            bits |= 1 << j
            j = parent[j]
        anc.append(bits)
    kc, vc = rand_cache(length + T + 3, nkv, d, gen)
    q = torch.randn(T, nh, d, generator=gen).to(torch.bfloat16)
    gate = torch.randn(T, nh, d, generator=gen).to(torch.bfloat16)
    got = attn_decode_ref(q, kc, vc, length, torch.tensor(anc), gate=gate)
    for i in range(T):
        slots = list(range(length)) + [length + j for j in range(T) if anc[i] >> j & 1]
        k, v = kc[slots][None].float(), vc[slots][None].float()
        ref = attention(q[None, i : i + 1].float(), k, v, offset=len(slots) - 1)[0, 0]
        assert rel_err(got[i], ref * torch.sigmoid(gate[i].float())) < 1e-5, i


@pytest.mark.parametrize("start,T,nh,nkv,d", [(0, 9, 4, 2, 64), (13, 6, 6, 2, 64), (40, 17, 6, 3, 32)])
def test_prefill_matches_model_attention(start, T, nh, nkv, d):
    gen = torch.Generator().manual_seed(start * 7 + T)
    kc, vc = rand_cache(start + T + 4, nkv, d, gen)
    q = torch.randn(T, nh, d, generator=gen).to(torch.bfloat16)
    ref = attention(q[None].float(), kc[None, : start + T].float(), vc[None, : start + T].float(), start)[0]
    assert rel_err(attn_prefill_ref(q, kc, vc, start), ref) < 1e-5
    assert rel_err(attn_prefill(q, kc, vc, start), ref) < 1e-2  # bf16 output
    gate = torch.randn(T, nh, d, generator=gen).to(torch.bfloat16)
    gated = attn_prefill(q, kc, vc, start, gate=gate)
    assert rel_err(gated, ref * torch.sigmoid(gate.float())) < 1e-2


@pytest.mark.parametrize("nh,nkv,d", [(24, 4, 256), (4, 2, 64), (16, 1, 128), (4, 4, 64)])
def test_check_heads_accepts_what_the_decode_kernel_serves(nh, nkv, d):
    check_heads(nh, nkv, d)


@pytest.mark.parametrize("nh,nkv,d", [(24, 4, 96), (34, 2, 128), (6, 4, 64), (8, 0, 64)])
def test_check_heads_names_unsupported_heads(nh, nkv, d):
    with pytest.raises(ValueError, match="GPU attention supports"):
        check_heads(nh, nkv, d)


def test_decode_kernel_shared_memory_fits_a_gb10():
    """sm_120-family parts (the GB10) let a CTA opt into 99 KB of shared memory: the chunk kernel's
    sub-partials and staged query tiles must fit that for every head size it serves."""
    assert all(_shmem(d) <= 99 * 1024 for d in HEAD_DIMS)


@pytest.mark.parametrize(
    "nkv,nch,ctas,rows,slots",
    [
        (4, 1026, 132, 1, 33),  # 27B on an H200 (one chunk CTA per SM at d = 256), a 128k cache
        (4, 23, 132, 1, 23),  # one row: no more slots than chunks
        (4, 23, 132, 32, 33),  # tree rows: all of them (they split a short prefix's query tiles)
        (5, 1000, 48, 1, 9),  # never more than the device holds at once: 45 of 48 CTAs
        (2, 1000, 264, 1, 132),  # two resident CTAs per SM (d = 64)
        (8, 1000, 4, 32, 1),
        (4, 0, 132, 1, 1),
    ],
)
def test_chunk_slots(nkv, nch, ctas, rows, slots):
    """The chunk kernel's slots per kv head: one wave of the CTAs the device holds (session 16's sweep)."""
    assert chunk_slots(nkv, nch, ctas, rows) == slots


class LaunchLog:
    """Stands in for a compiled kernel: records (name, grid) per launch, runs nothing."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def blocks_per_sm(self, block: int, shmem: int) -> int:
        return 1

    def launch(self, grid, block, args, shmem: int = 0, pdl: bool = False) -> None:
        self.log.append((self.name, tuple(grid)))


@pytest.mark.parametrize(
    "T,kwargs,pipe_default,chunk",
    [
        (1, {}, True, "attn_decode_chunk_pipe"),  # plain decode
        (1, {"pipe": False}, True, "attn_decode_chunk"),
        (1, {}, False, "attn_decode_chunk"),  # the module switch (bench/ab.py)
        (5, {}, True, "attn_tree_chunk"),  # tree rows where the shared memory holds it
        (5, {"tree_chunk": False}, True, "attn_decode_chunk_pipe"),  # pipelines one-tile CTAs only
        (5, {"tree_chunk": False, "pipe": False}, True, "attn_decode_chunk"),
    ],
)
def test_decode_launch_choices(monkeypatch, T, kwargs, pipe_default, chunk):
    """attn_decode's chunk kernel (a launch choice: the kernels give the same bits, GPU-tested) and its
    grid: (kv heads, slots + T) with one wave of slots, then the merge for plain or tree rows."""
    from lumo.kernels import attention as attn

    log: list = []
    names = ("attn_decode_chunk", "attn_decode_chunk_pipe", "attn_tree_chunk", "attn_decode_merge",
             "attn_decode_merge_head")  # fmt: skip
    monkeypatch.setattr(attn, "_kernels", lambda d, g: tuple(LaunchLog(n, log) for n in names))
    monkeypatch.setattr(attn, "sm_count", lambda device: 132)
    monkeypatch.setattr(attn, "DECODE_PIPE", pipe_default)
    nh, nkv, d, max_len = 24, 4, 256, 1000
    gen = torch.Generator().manual_seed(T)
    kc, vc = rand_cache(max_len, nkv, d, gen)
    q = torch.randn(T, nh, d, generator=gen).to(torch.bfloat16)
    mask = torch.tensor([(1 << (i + 1)) - 1 for i in range(T)], dtype=torch.int64)
    length = torch.tensor([500], dtype=torch.int32)
    attn.attn_decode(q, kc, vc, length, mask, **kwargs)
    merge = "attn_decode_merge" if T == 1 else "attn_decode_merge_head"
    slots = chunk_slots(nkv, -(-max_len // 128), 132, T)
    assert log == [(chunk, (nkv, slots + T)), (merge, (T * nh, d // 32 if T == 1 else 1))]
