"""Attention: decode / tree-verify split-K kernel (attention.cu), chunked prefill (torch SDPA), references.

Decode rows see the committed prefix [0, len) of the cache and the tree slots len + j whose bit j is set in
their ancestor mask (plain decode: T = 1, mask = 1, the new token's K/V already written at slot len). `len`
and the masks are device tensors, so a captured CUDA graph replays for any length. The kernel is batch
invariant (see attention.cu): a tree row is bitwise the plain decode of the same token.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .compile import Kernel, compile_kernel, sm_count
from .linear import smem_limit

# torch SDPA backends for attn_prefill on CUDA, in order (its docstring says why not cuDNN)
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

CHUNK = 128  # positions per split-K partial (must match attention.cu)
_SUB = 16  # positions per warp (attention.cu)
_NSUB = CHUNK // _SUB
THREADS = 32 * _NSUB
_QROWS = 8  # query rows per cross-warp combine (attention.cu QROWS)
_MERGE_THREADS = 256  # the merge kernels: 8 chunk groups x 32 lanes (attention.cu MERGE_GROUPS)
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16  # query heads per kv head: the range the decode kernel is built and tested for
# Tree rows (T > 1): attn_tree_chunk, whose slot CTAs that walk the prefix chunk by chunk stage a chunk's K
# and V in shared memory and give each warp whole query tiles (the same bits as attn_decode_chunk), where the
# device's shared memory per block holds them (d = 256: 164 KB; not a GB10's 99 KB). False: attn_decode_chunk
# for every T (bench/ab.py switch).
TREE_CHUNK = True
# Walking slot CTAs with one query tile (plain decode: T = 1; any T x G <= 16) load their next chunk's K rows
# into the registers this chunk's scores have finished with (attn_decode_chunk_pipe). False:
# attn_decode_chunk (bench/ab.py switch). The same bits.
DECODE_PIPE = True


def check_heads(nh: int, nkv: int, d: int) -> None:
    """Raise ValueError unless the decode kernel supports these attention heads (checked at model load)."""
    if nkv < 1 or nh % nkv or not 1 <= nh // nkv <= MAX_GROUP or d not in HEAD_DIMS:
        raise ValueError(
            f"GPU attention supports head_dim in {HEAD_DIMS} and 1..{MAX_GROUP} query heads per KV head; "
            f"the model has head_dim {d}, {nh} query heads, {nkv} KV heads"
        )


@functools.cache
def _kernels(d: int, g: int) -> tuple[Kernel, Kernel, Kernel, Kernel, Kernel]:
    defines = {"D": d, "G": g}
    return (
        compile_kernel("attention.cu", "attn_decode_chunk", defines),
        compile_kernel("attention.cu", "attn_decode_chunk_pipe", defines),
        compile_kernel("attention.cu", "attn_tree_chunk", defines),
        compile_kernel("attention.cu", "attn_decode_merge", defines),
        compile_kernel("attention.cu", "attn_decode_merge_head", defines),
    )


def _shmem(d: int) -> int:
    """attention.cu SMEM_BYTES: the sub-partials of QROWS query rows, then two staged query tiles."""
    return 4 * _NSUB * _QROWS * (d + 2) + 2 * 16 * (d + 8) * 2


def _tree_shmem(d: int) -> int:
    """attn_tree_chunk's dynamic shared memory (attention.cu TSMEM_BYTES: a chunk's K and V, then each warp's
    P^T fragments and fold factors), or SMEM_BYTES if more."""
    return max(_shmem(d), 2 * CHUNK * d * 2 + _NSUB * 4 * (_NSUB * 4 * 32 + _NSUB * 16))


def tree_chunk_kernel(t: int, d: int, device: torch.device | str) -> bool:
    """Whether attn_decode's default runs t rows on attn_tree_chunk (a launch choice: the same bits)."""
    return TREE_CHUNK and t > 1 and tree_chunk_fits(d, device)


def tree_chunk_fits(d: int, device: torch.device | str) -> bool:
    """Whether the device grants attn_tree_chunk's shared memory per block at head dim d."""
    return _tree_shmem(d) <= smem_limit(torch.device(device))


def chunk_slots(nkv: int, nch: int, ctas: int, rows: int = 1) -> int:
    """CTAs per kv head along the chunks below the committed length (launch choice only: a CTA walks
    chunks z, z + slots, ..., or where at most half as many chunks as slots lie below the length takes
    one (chunk, query tiles) item). As many in all as the device holds at once (`ctas`: SMs x resident
    chunk CTAs per SM, one at d = 128 and 256), so the slot CTAs are one wave and the rows' tail CTAs the
    next. (H200, d = 256, session 16: twice that was up to 15% slower for 32 rows, and 40-50 per kv head at
    132 SMs up to 1.6x slower for one row at long caches.) Tree rows keep all the slots where the cache
    has fewer chunks: there the slots split the rows' query tiles of a short prefix."""
    per = max(1, ctas // nkv)
    return per if rows > 1 else max(1, min(nch, per))


def attn_decode_workspace(
    t: int, nh: int, d: int, max_len: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials for t rows and a max_len-slot cache: (acc [t, nh, nch, d] f32, ml [t, nh, nch, 2])."""
    nch = -(-max_len // CHUNK)
    return (
        torch.empty(t, nh, nch, d, dtype=torch.float32, device=device),
        torch.empty(t, nh, nch, 2, dtype=torch.float32, device=device),
    )


def attn_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    mask: torch.Tensor,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree_chunk: bool | None = None,
    pipe: bool | None = None,
) -> torch.Tensor:
    """Attention of T rows q [T, nh, d] bf16 over k/v_cache [max_len, nkv, d] bf16 -> [T, nh, d] bf16.

    length: [1] int32 committed positions; mask: [T] int64, bit j = row may see tree slot length + j.
    gate: [T, nh, d] bf16 or None (a strided view is fine, e.g. the gate half of a [T, nh, 2d] projection);
    with it the output is attention * sigmoid(gate) (fused, fp32).
    Pass out= and workspace= (attn_decode_workspace) on the hot path: then nothing is allocated.
    tree_chunk: which chunk kernel (the same bits either way): None = tree_chunk_kernel's choice, True =
    attn_tree_chunk (T > 1, where it fits), False = attn_decode_chunk.
    pipe: where attn_decode_chunk runs (not tree_chunk), whether as attn_decode_chunk_pipe, whose walking CTAs
    load their next chunk's K during this one (the same bits): None = DECODE_PIPE, True or False.
    """
    T, nh, d = q.shape
    max_len, nkv, dk = k_cache.shape
    if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16:
        raise TypeError("attn_decode: q, k_cache, v_cache must be bf16")
    if dk != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"attn_decode: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    check_heads(nh, nkv, d)
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("attn_decode: q and the caches must be contiguous")
    if length.dtype != torch.int32 or length.numel() != 1:
        raise ValueError("attn_decode: length must be a [1] int32 device tensor")
    if mask.dtype != torch.int64 or mask.shape != (T,) or not mask.is_contiguous():
        raise ValueError(f"attn_decode: mask must be [{T}] int64")
    if gate is not None and (gate.shape != q.shape or gate.dtype != torch.bfloat16 or gate.stride(2) != 1):
        raise ValueError("attn_decode: gate must be bf16 shaped like q with contiguous head dims")
    nch = -(-max_len // CHUNK)
    if workspace is None:
        workspace = attn_decode_workspace(T, nh, d, max_len, q.device)
    acc, ml = workspace
    if acc.shape[0] < T or acc.shape[1:] != (nh, nch, d) or ml.shape[1:] != (nh, nch, 2):
        raise ValueError(f"attn_decode: workspace {tuple(acc.shape)} too small for T={T} nh={nh} nch={nch}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError("attn_decode: out must be a contiguous bf16 tensor shaped like q")
    chunk_k, pipe_k, tree_k, merge_k, merge_head_k = _kernels(d, nh // nkv)
    if tree_chunk is None:
        tree_chunk = tree_chunk_kernel(T, d, q.device)
    elif tree_chunk and (T == 1 or not tree_chunk_fits(d, q.device)):
        raise ValueError(f"attn_decode: attn_tree_chunk needs T > 1 and {_tree_shmem(d)} B of shared memory")
    if pipe is None:
        pipe = DECODE_PIPE
    if tree_chunk:
        chunk, shmem = tree_k, _tree_shmem(d)
    else:
        chunk, shmem = (pipe_k if pipe else chunk_k), _shmem(d)
    ctas = sm_count(q.device) * max(1, chunk.blocks_per_sm(THREADS, shmem))
    slots = chunk_slots(nkv, nch, ctas, T)
    chunk.launch(
        (nkv, slots + T),
        THREADS,
        (q, k_cache, v_cache, length, mask, acc, ml, nkv, max_len, nch, T),
        shmem=shmem,
        pdl=True,
    )
    g_rs, g_hs = (0, 0) if gate is None else (gate.stride(0), gate.stride(1))
    # Plain decode: a CTA per 32 dims; tree rows: a whole head per CTA (attention.cu). The same bits.
    merge, dim_blocks = (merge_k, d // 32) if T == 1 else (merge_head_k, 1)
    merge.launch(
        (T * nh, dim_blocks),
        _MERGE_THREADS,
        (acc, ml, length, mask, q if gate is None else gate, ctypes.c_longlong(g_rs), g_hs, out, nh, nch)
        + (int(gate is not None),),
        pdl=True,
    )
    return out


def attn_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: int | torch.Tensor,
    mask: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain fp32 reference of attn_decode: row t attends to [0, len) and the tree slots set in mask[t]."""
    T, nh, d = q.shape
    nkv = k_cache.shape[1]
    n = int(length)
    out = torch.empty(T, nh, d, dtype=torch.float32, device=q.device)
    for t in range(T):
        bits = int(mask[t])
        slots = list(range(n)) + [n + j for j in range(64) if bits >> j & 1]
        idx = torch.tensor(slots, device=q.device)
        k = k_cache[idx].float().repeat_interleave(nh // nkv, dim=1)  # [S, nh, d]
        v = v_cache[idx].float().repeat_interleave(nh // nkv, dim=1)
        p = torch.softmax(torch.einsum("hd,shd->hs", q[t].float(), k) * d**-0.5, dim=-1)  # [nh, S]
        out[t] = torch.einsum("hs,shd->hd", p, v)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out


def attn_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk q [T, nh, d] at positions start.. over cache [0, start + T) -> [T, nh, d].

    The chunk's K/V must already be in the cache. torch SDPA per kv head: the kv head is broadcast to its G
    query heads with a stride-0 view (no copy, no reliance on enable_gqa support in every backend), and
    the offset causal mask is SDPA's lower-right causal bias, which flash attention implements natively
    (query i sees keys <= start + i); CPU falls back to the math backend with the same mask.
    On CUDA only flash attention (memory-efficient attention where flash cannot run): torch's default
    also picks cuDNN for some shapes (a chunk from position 0), whose first call at each new length
    plans for 65 ms to 1.5 s on an H100 (bench/probe_sdpa.py), a cost every prompt of an unseen length
    paid; flash runs at the same speed with nothing to plan.
    """
    T, nh, d = q.shape
    nkv = k_cache.shape[1]
    S, G = start + T, nh // nkv
    if k_cache.shape[0] < S or nh % nkv or k_cache.shape[2] != d:
        raise ValueError(f"attn_prefill: q {tuple(q.shape)}, start {start} vs cache {tuple(k_cache.shape)}")
    if out is None:
        out = torch.empty_like(q)
    bias = causal_lower_right(T, S)
    with sdpa_kernel(PREFILL_SDPA) if q.is_cuda else contextlib.nullcontext():
        for h in range(nkv):
            qh = q[:, h * G : (h + 1) * G].transpose(0, 1)[None]  # [1, G, T, d]
            kh = k_cache[:S, h][None, None].expand(1, G, S, d)  # [1, G, S, d] stride 0 over G
            vh = v_cache[:S, h][None, None].expand(1, G, S, d)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)[0].transpose(0, 1)  # [T, G, d]
            if gate is not None:
                o = (o.float() * torch.sigmoid(gate[:, h * G : (h + 1) * G].float())).to(out.dtype)
            out[:, h * G : (h + 1) * G] = o
    return out


def attn_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain fp32 reference of attn_prefill."""
    T, nh, d = q.shape
    nkv = k_cache.shape[1]
    S = start + T
    k = k_cache[:S].float().repeat_interleave(nh // nkv, dim=1)  # [S, nh, d]
    v = v_cache[:S].float().repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) * d**-0.5  # [nh, T, S]
    visible = torch.arange(S, device=q.device)[None, :] <= start + torch.arange(T, device=q.device)[:, None]
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("hts,shd->thd", p, v)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out
