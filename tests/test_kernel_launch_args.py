"""Every launcher passes its kernel the arguments the kernel declares, without a GPU.

(The linear GEMVs are not here: their launchers read the device's occupancy, and a one-slice launch hands
the unused split-K partial buffer its output tensor as a stand-in pointer; the GPU tests run them.)

ctypes launches check nothing: an argument too many, two swapped or an int where the kernel reads a
pointer is found only by a wrong result or a crash on the GPU. Here each launcher runs on CPU tensors with
its kernels replaced by stand-ins that compare every launch's arguments, by count and kind, with the
kernel's parameter list read from its .cu source (`compile.kernel_params`): for each pointer a null or a
tensor of a matching dtype (so two swapped buffers of different types are caught), a Python int for an
int, ctypes.c_longlong for a long long, a float for a float.
"""

from __future__ import annotations

import ctypes
import importlib

import pytest
import torch

from lumo.kernels.compile import kernel_params, resolve_source

MODULES = ("sampling", "token_mask", "tree_ops", "logprobs", "norms", "rope_kv", "conv", "gdn", "attention")
f32, bf16, i32, i64, u8 = torch.float32, torch.bfloat16, torch.int32, torch.int64, torch.uint8
# the tensor dtypes a kernel's pointer type takes (typedefs a build chooses: each choice)
POINTEE = {
    "float": {f32},
    "bf16": {bf16},
    "int": {i32},
    "unsigned int": {i32},
    "long": {i64},
    "u64": {i64},
    "unsigned char": {u8, torch.bool},
    "logit_t": {f32, bf16},
    "o_t": {f32, bf16},
    "gdn_param_t": {f32, bf16},
    "param_t": {f32, bf16},
    "gdn_out_t": {f32, bf16},
    "out_t": {f32, bf16},
}


class StandIn:
    """A kernel that checks its launches against the source's parameter list and records them."""

    sm_major = 9

    def __init__(self, source: str, name: str) -> None:
        self.name = name
        self.kinds = kernel_params(resolve_source(source).read_text(), name)
        self.launches = 0

    def launch(self, grid, block, args, shmem=0, pdl=False, cluster=None) -> None:
        assert len(args) == len(self.kinds), f"{self.name}: {len(args)} arguments for {len(self.kinds)}"
        for i, (a, kind) in enumerate(zip(args, self.kinds, strict=True)):
            if kind.startswith("ptr:"):
                ok = (isinstance(a, ctypes.c_void_p) and not a.value) or (
                    isinstance(a, torch.Tensor) and a.dtype in POINTEE[kind[4:]]
                )
            else:
                ok = {
                    "i32": type(a) is int and -(2**31) <= a < 2**31,
                    "i64": isinstance(a, ctypes.c_longlong),
                    "f32": type(a) is float,
                }[kind]
            got = f"a {a.dtype} tensor" if isinstance(a, torch.Tensor) else f"{type(a).__name__} {a!r}"
            assert ok, f"{self.name}: argument {i} is {got}, the kernel reads {kind}"
        LAUNCHED.add(self.name)
        self.launches += 1

    def blocks_per_sm(self, block: int, shmem: int) -> int:
        return 2

    def max_cluster_size(self, grid, block: int, shmem: int) -> int:
        return 8


LAUNCHED: set[str] = set()


@pytest.fixture
def stand_ins(monkeypatch):
    """Each launcher module's compile_kernel replaced by StandIn; the modules' kernel caches emptied before
    and after (a GPU session in the same process must not keep stand-ins)."""

    def clear() -> None:
        for name in MODULES:
            module = importlib.import_module(f"lumo.kernels.{name}")
            for getter in ("_kernel", "_kernels", "_chunk_kernel"):
                getattr(getattr(module, getter, None), "cache_clear", lambda: None)()

    clear()
    LAUNCHED.clear()
    for name in MODULES:
        module = importlib.import_module(f"lumo.kernels.{name}")
        monkeypatch.setattr(
            module, "compile_kernel", lambda src, kname, defines=None, arch=None: StandIn(src, kname)
        )
    yield
    clear()


def test_kernel_params_reads_signatures():
    src = """
    #define ARGS const float* a, int n, \\
      long long s
    extern "C" __global__ void __launch_bounds__(128, MINB(2)) one(const int* __restrict__ x, // note
        unsigned n, float eps, long long stride, bf16** p) {}
    extern "C" __global__ void two(ARGS) {}
    """
    assert kernel_params(src, "one") == ("ptr:int", "i32", "f32", "i64", "ptr:bf16")
    assert kernel_params(src, "two") == ("ptr:float", "i32", "i64")
    with pytest.raises(KeyError):
        kernel_params(src, "three")


def test_every_kernel_signature_reads():
    """Every extern "C" kernel of the package has a parameter list kernel_params reads, pointers to types
    this file maps to dtypes (a new typedef must be added to POINTEE)."""
    import re

    from lumo.kernels.compile import kernel_sources

    names = []
    for path in kernel_sources():
        src = path.read_text()
        for name in re.findall(
            r"^extern \"C\" __global__ void(?: __launch_bounds__\([^\n]*\))?\s+(\w+)\(", src, re.M
        ):
            kinds = kernel_params(src, name)
            assert all(
                k[4:] in POINTEE or k[4:] in ("uint4", "unsigned short") for k in kinds if k[:4] == "ptr:"
            )
            names.append(name)
    assert len(names) >= 38 and {"sample_partial", "nvfp4_gemv_rd", "gdn_tree"} <= set(names)


def test_sampling_launchers(stand_ins):
    from lumo.kernels.sampling import Penalties, sample_tokens

    T, V, R, E = 3, 1000, 8, 4
    f32 = dict(dtype=torch.float32)
    rows = (
        torch.randn(T, V),
        torch.full((T,), 0.7),
        torch.full((T,), 5, dtype=torch.int32),
        torch.full((T,), 0.9),
        torch.arange(T, dtype=torch.int64),
        torch.arange(T, dtype=torch.int64),
    )
    pen = Penalties(
        torch.ones(T, 4),
        torch.zeros(V, dtype=torch.int32),
        torch.zeros(V, dtype=torch.uint8),
        torch.zeros(T, E, dtype=torch.int32),
        torch.zeros(R, dtype=torch.int32),
        torch.zeros(V, **f32),
        torch.zeros(V, dtype=torch.uint8),
        torch.zeros(T, dtype=torch.int64),
    )
    count = torch.zeros(V, dtype=torch.int32)
    sample_tokens(*rows, min_p=torch.zeros(T), penalties=pen, count_out=count)
    sample_tokens(rows[0].bfloat16(), *rows[1:])  # nothing optional: the nulls
    sample_tokens(*rows, penalties=Penalties(torch.ones(T, 4), count, pen.prompt))  # no path, no bias
    assert {"sample_partial", "sample_final"} <= LAUNCHED


def test_token_mask_launcher(stand_ins):
    from lumo.kernels.token_mask import apply_token_mask

    T, V = 3, 1001
    apply_token_mask(torch.zeros(T, V, dtype=bf16), torch.zeros(T, 32, dtype=i32), torch.ones(T, dtype=i32))
    assert "apply_token_mask" in LAUNCHED
    with pytest.raises(ValueError, match="mask must be"):  # a [T, W] bitmask of V / 32 rounded up
        apply_token_mask(
            torch.zeros(T, V, dtype=bf16), torch.zeros(T, 31, dtype=i32), torch.ones(T, dtype=i32)
        )


def test_tree_ops_launchers(stand_ins):
    from lumo.kernels.sampling import Penalties
    from lumo.kernels.tree_ops import accept_buffers, kv_remap, kv_table, topk_select, tree_accept

    V, R = 700, 8
    logits = torch.randn(2, V)
    tokens, nodes = torch.zeros(R, dtype=torch.int32), torch.full((2, 3), -1, dtype=torch.int32)
    pen = Penalties(
        torch.ones(1, 4), torch.zeros(2 * V, dtype=torch.int32), torch.zeros(2 * V, dtype=torch.uint8)
    )
    pen.bias = torch.zeros(2 * V)
    id_map = torch.arange(0, 2 * V, 2, dtype=torch.int32)
    topk_select(logits, 3, tokens=tokens, nodes=nodes)
    topk_select(logits[:1], 3, tokens=tokens, nodes=nodes[:1], id_map=id_map, penalties=pen, n_path=2)
    topk_select(logits.bfloat16(), 2)
    accepted, result = accept_buffers(4, "cpu")
    parent = torch.tensor([-1, 0, 1, 0, 2, 3, 4, 5], dtype=torch.int32)
    counts = torch.zeros(V, dtype=torch.int32)
    tree_accept(tokens, tokens.clone(), parent, R, accepted, result, 4, count_out=counts)
    tree_accept(tokens, tokens.clone(), parent, R, accepted, result, 4)
    caches = [torch.zeros(16, 2, 8, dtype=torch.bfloat16) for _ in range(3)]
    kv_remap(kv_table(caches), accepted, result[:1], torch.zeros(1, dtype=torch.int32))
    assert {"topk_partial", "topk_final", "tree_accept", "kv_remap"} <= LAUNCHED


def test_row_kernel_launchers(stand_ins):
    """logprobs, the norms, q/k norm + RoPE + KV write, the convs."""
    from lumo.kernels.conv import conv_decode, conv_gather, conv_gather_qk, conv_prefill, conv_state_commit
    from lumo.kernels.logprobs import row_logprobs
    from lumo.kernels.norms import gated_rmsnorm, rmsnorm1p, silu_mul
    from lumo.kernels.rope_kv import qk_norm_rope_kv

    bf = dict(dtype=torch.bfloat16)
    row_logprobs(torch.randn(3, 500), torch.zeros(3, dtype=torch.int64), 4)
    row_logprobs(torch.randn(2, 500, **bf), torch.zeros(2, dtype=torch.int64), 0)
    h, w = torch.zeros(2, 256, **bf), torch.zeros(256, **bf)
    rmsnorm1p(h, w, 1e-6, delta=torch.zeros(2, 256, **bf))
    rmsnorm1p(h, w, 1e-6)
    gated_rmsnorm(torch.zeros(2, 4, 64), torch.zeros(2, 4, 64, **bf), torch.zeros(64, **bf), 1e-6)
    silu_mul(torch.zeros(2, 128, **bf))
    T, nh, nkv, d = 3, 4, 2, 64
    i32 = dict(dtype=torch.int32)
    qk_norm_rope_kv(
        torch.zeros(T, nh, 2 * d, **bf),
        torch.zeros(T, nkv, d, **bf),
        torch.zeros(T, nkv, d, **bf),
        torch.zeros(d, **bf),
        torch.zeros(d, **bf),
        torch.arange(T, **i32),
        torch.arange(T, **i32),
        torch.zeros(8, nkv, d, **bf),
        torch.zeros(8, nkv, d, **bf),
        torch.ones(d // 4),
        1e-6,
    )
    C, K = 2 * 2 * 32 + 2 * 32, 4
    x, cw, state = torch.zeros(T, C, **bf), torch.zeros(C, K, **bf), torch.zeros(C, K - 1, **bf)
    pred = torch.zeros(T, K - 1, **i32)
    conv_prefill(x, cw, state)
    conv_gather(x, cw, state, pred)
    conv_gather_qk(x, cw, state, pred, (2, 2, 32, 32))
    conv_state_commit(state, x, torch.tensor([0, 1, -1], **i32))
    conv_decode(x[:1], cw, state)
    want = {"lp_rows", "rmsnorm1p_residual", "gated_rmsnorm", "silu_mul", "qk_norm_rope_kv"}
    assert (
        want | {"conv_prefill", "conv_gather", "conv_gather_qk", "conv_state_commit", "conv_decode"}
        <= LAUNCHED
    )


def test_gdn_and_attention_launchers(stand_ins):
    """The GDN recurrence (decode, fused norm, chunked prefill), the tree walk, decode attention."""
    from lumo.kernels.attention import attn_decode, attn_decode_workspace
    from lumo.kernels.gdn import gdn_decode, gdn_decode_norm, gdn_prefill
    from lumo.kernels.gdn_tree import gdn_qk, gdn_tree

    bf = dict(dtype=torch.bfloat16)
    i32 = dict(dtype=torch.int32)
    nk, nv, dk, dv = 2, 4, 64, 64
    C = 2 * nk * dk + nv * dv
    A_log, dt_bias, state = torch.zeros(nv), torch.zeros(nv), torch.zeros(nv, dk, dv)

    def rows(t: int):
        return torch.zeros(t, C, **bf), torch.zeros(t, nv, **bf), torch.zeros(t, nv, **bf)

    gdn_decode(*rows(1), A_log, dt_bias, state)
    gdn_decode_norm(
        *rows(1), A_log, dt_bias, state, torch.zeros(1, nv, dv, **bf), torch.zeros(dv, **bf), 1e-6
    )
    gdn_prefill(*rows(300), A_log, dt_bias, state)
    R = 6
    items, items_len = torch.full((2, 4), -1, **i32), torch.zeros(2, **i32)
    gdn_tree(*rows(R), A_log, dt_bias, state, items, items_len)
    gdn_qk(rows(R)[0], (nk, nv, dk, dv))
    nh, nkv, d, L = 4, 2, 64, 256
    attn_decode(
        torch.zeros(1, nh, d, **bf),
        torch.zeros(L, nkv, d, **bf),
        torch.zeros(L, nkv, d, **bf),
        torch.tensor([10], **i32),
        torch.ones(1, dtype=torch.int64),
        workspace=attn_decode_workspace(1, nh, d, L, "cpu"),
    )
    want = {
        "gdn_recurrent",
        "gdn_recurrent_norm",
        "gdn_chunk_prep",
        "gdn_chunk_scan_tc",
        "gdn_tree",
        "gdn_qk",
    }
    assert want | {"attn_decode_chunk_pipe", "attn_decode_merge"} <= LAUNCHED
