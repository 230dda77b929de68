"""GPU: qk_norm_rope_kv (q/k rmsnorm1p + partial RoPE + KV cache write) vs fp32 reference and lumo.model."""

from __future__ import annotations

import math

import pytest
import torch

from lumo import model
from lumo.kernels.rope_kv import qk_norm_rope_kv, qk_norm_rope_kv_ref, rope_inv_freq

pytestmark = pytest.mark.gpu
DEV = "cuda"
EPS = 1e-6
THETA = 1e7


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def frac_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


class Layer:
    """Random inputs of one attention layer; q/k/v are views into one fused projection output."""

    def __init__(self, T: int, nh: int, nkv: int, d: int, rd: int, seed: int, max_len: int = 80) -> None:
        gen = torch.Generator(DEV).manual_seed(seed)
        self.T, self.nh, self.nkv, self.d, self.rd = T, nh, nkv, d, rd
        n_q, n_kv = nh * 2 * d, nkv * d
        self.fused = (torch.randn(T, n_q + 2 * n_kv + 16, generator=gen, device=DEV) * 2).to(torch.bfloat16)
        self.qg = self.fused[:, :n_q].view(T, nh, 2 * d)
        self.k = self.fused[:, n_q : n_q + n_kv].view(T, nkv, d)
        self.v = self.fused[:, n_q + n_kv : n_q + 2 * n_kv].view(T, nkv, d)
        self.q_norm = (torch.randn(d, generator=gen, device=DEV) * 0.2).to(torch.bfloat16)
        self.k_norm = (torch.randn(d, generator=gen, device=DEV) * 0.2).to(torch.bfloat16)
        pos = torch.randint(0, 200_000, (T,), generator=gen, device=DEV)
        pos[0] = 0  # the identity rotation is a case too
        self.positions = pos.to(torch.int32)
        self.slots = torch.randperm(max_len, generator=gen, device=DEV)[:T].to(torch.int32)
        self.k_cache = torch.full((max_len, nkv, d), float("nan"), dtype=torch.bfloat16, device=DEV)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.inv_freq = rope_inv_freq(rd, THETA, DEV)

    def run(self, rows: slice | None = None, q_out: torch.Tensor | None = None) -> torch.Tensor:
        r = rows or slice(0, self.T)
        return qk_norm_rope_kv(
            self.qg[r], self.k[r], self.v[r], self.q_norm, self.k_norm, self.positions[r], self.slots[r],
            self.k_cache, self.v_cache, self.inv_freq, EPS, q_out=q_out,
        )  # fmt: skip


CASES = [
    (T, nh, nkv, d, rd)
    for T in (1, 7, 32)
    for nh, nkv, d, rd in ((24, 4, 256, 64), (4, 2, 64, 16), (6, 3, 128, 32))
]


@pytest.mark.parametrize(
    "T,nh,nkv,d,rd", CASES, ids=[f"T{t}-nh{a}-nkv{b}-d{d}-rot{r}" for t, a, b, d, r in CASES]
)
def test_matches_reference_and_model(T, nh, nkv, d, rd):
    L = Layer(T, nh, nkv, d, rd, seed=T * 1000 + d + nh)
    fused0 = L.fused.clone()
    q = L.run(q_out=torch.full((T, nh, d), float("nan"), dtype=torch.bfloat16, device=DEV))
    assert torch.equal(L.fused, fused0)  # inputs (and the gate, read in place later) untouched

    slots = L.slots.long()
    q_ref, k_ref = qk_norm_rope_kv_ref(L.qg, L.k, L.q_norm, L.k_norm, L.positions, rd, THETA, EPS)
    assert rel_err(q, q_ref) < 1e-2
    assert rel_err(L.k_cache[slots], k_ref) < 1e-2
    assert torch.equal(L.v_cache[slots], L.v)
    untouched = torch.ones(L.k_cache.shape[0], dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert L.k_cache[untouched].isnan().all() and L.v_cache[untouched].isnan().all()

    # lumo.model in bf16: the same roundings (norm -> bf16 -> RoPE in fp32 -> bf16) and the same inv_freq /
    # fp32 angle / cosf / sinf, so only rare sum-order flips of the norm's bf16 rounding differ.
    pos = L.positions.long()
    q_model = model.apply_partial_rope(model.rmsnorm1p(L.qg[..., :d], L.q_norm, EPS), pos, rd, THETA)
    k_model = model.apply_partial_rope(model.rmsnorm1p(L.k, L.k_norm, EPS), pos, rd, THETA)
    assert frac_equal(q, q_model) > 0.98 and rel_err(q, q_model) < 5e-3
    assert frac_equal(L.k_cache[slots], k_model) > 0.98 and rel_err(L.k_cache[slots], k_model) < 5e-3


@pytest.mark.parametrize("d,rd", [(256, 64), (64, 16)])
def test_batch_invariant(d, rd):
    L = Layer(32, 8, 2, d, rd, seed=d + 1)
    q_all = L.run().clone()
    k_all, v_all = L.k_cache.clone(), L.v_cache.clone()
    for m in (1, 3, 17):
        for start in sorted({0, 32 - m, (32 - m) // 2}):
            L.k_cache.fill_(float("nan"))
            L.v_cache.fill_(float("nan"))
            q = L.run(slice(start, start + m))
            assert torch.equal(q, q_all[start : start + m]), (m, start)
            s = L.slots[start : start + m].long()
            assert torch.equal(L.k_cache[s], k_all[s]) and torch.equal(L.v_cache[s], v_all[s]), (m, start)


def test_negative_slot_writes_nothing():
    L = Layer(5, 4, 2, 64, 16, seed=3)
    L.slots[2] = -1
    q = L.run()
    written = L.slots[L.slots >= 0].long()
    assert not L.k_cache[written].isnan().any()
    assert L.k_cache.isnan().all(-1).all(-1).sum() == L.k_cache.shape[0] - 4  # only 4 rows written
    assert torch.isfinite(q).all()


def test_rejects_bad_inputs():
    L = Layer(3, 4, 2, 64, 16, seed=5)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope_kv(
            L.qg, L.k, L.v, L.q_norm, L.k_norm, L.positions.long(), L.slots,
            L.k_cache, L.v_cache, L.inv_freq, EPS,
        )  # fmt: skip
    with pytest.raises(ValueError, match="k_cache"):
        qk_norm_rope_kv(
            L.qg, L.k, L.v, L.q_norm, L.k_norm, L.positions, L.slots,
            L.k_cache.float(), L.v_cache, L.inv_freq, EPS,
        )  # fmt: skip


def test_graph_replays_with_new_positions_and_slots():
    L = Layer(4, 24, 4, 256, 64, seed=9)
    q = torch.empty(4, 24, 256, dtype=torch.bfloat16, device=DEV)
    L.run(q_out=q)  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        L.run(q_out=q)
    gen = torch.Generator(DEV).manual_seed(10)
    for _ in range(2):
        L.fused.copy_(torch.randn(L.fused.shape, generator=gen, device=DEV))
        L.positions.copy_(torch.randint(0, 100_000, (4,), generator=gen, device=DEV))
        L.slots.copy_(torch.randperm(80, generator=gen, device=DEV)[:4])
        L.k_cache.fill_(float("nan"))
        L.v_cache.fill_(float("nan"))
        q.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        k_g, v_g = L.k_cache.clone(), L.v_cache.clone()
        L.k_cache.fill_(float("nan"))
        L.v_cache.fill_(float("nan"))
        q_eager = L.run()
        assert torch.equal(q, q_eager)
        assert torch.equal(k_g.nan_to_num(7.0), L.k_cache.nan_to_num(7.0))
        assert torch.equal(v_g.nan_to_num(7.0), L.v_cache.nan_to_num(7.0))


@pytest.mark.parametrize("d,rd", [(256, 64), (64, 16)])
def test_yarn_scaling(d, rd):
    """A yarn RoPE (Qwen's recipe: factor 4 over a 262k context): the scaled table and rope_scale (cos / sin
    times the attention factor) against the fp32 reference and lumo.model."""
    from lumo.config import RopeScaling
    from lumo.rope import rope_table

    L = Layer(7, 4, 2, d, rd, seed=d + 7)
    plain = L.run().clone()
    yarn = RopeScaling("yarn", 4.0, 262144, attention_factor=0.1 * math.log(4.0) + 1)
    L.inv_freq, scale = rope_table(rd, THETA, yarn, DEV)
    assert scale == yarn.attention_factor and not torch.equal(L.inv_freq, rope_inv_freq(rd, THETA, DEV))
    slots = L.slots.long()
    q = qk_norm_rope_kv(
        L.qg, L.k, L.v, L.q_norm, L.k_norm, L.positions, L.slots, L.k_cache, L.v_cache, L.inv_freq, EPS,
        rope_scale=scale,
    )  # fmt: skip
    q_ref, k_ref = qk_norm_rope_kv_ref(L.qg, L.k, L.q_norm, L.k_norm, L.positions, rd, THETA, EPS, yarn)
    assert rel_err(q, q_ref) < 1e-2 and rel_err(L.k_cache[slots], k_ref) < 1e-2
    pos = L.positions.long()
    q_model = model.apply_partial_rope(model.rmsnorm1p(L.qg[..., :d], L.q_norm, EPS), pos, rd, THETA, yarn)
    assert frac_equal(q, q_model) > 0.98 and rel_err(q, q_model) < 5e-3
    assert rel_err(q, plain) > 1e-2  # the scaling changed the rotated dims
