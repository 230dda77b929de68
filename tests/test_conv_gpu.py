"""GPU: conv prefill / gather (one token, chain, tree) / state commit vs fp32 references; bitwise agreement
between prefill, chained decode and tree gathers (they share one conv_silu)."""

from __future__ import annotations

import pytest
import torch

from lumo import model
from lumo.kernels.conv import (
    conv_commit_rows,
    conv_decode,
    conv_gather,
    conv_gather_ref,
    conv_pred,
    conv_pred_chain,
    conv_prefill,
    conv_prefill_ref,
    conv_state_commit,
    conv_state_commit_ref,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
K = 4


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "non-finite output (unwritten element?)"
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def inputs(T: int, C: int, seed: int, pad: int = 13) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as a view into a wider fused projection output (row stride C + pad, odd offset), w, state."""
    gen = torch.Generator(DEV).manual_seed(seed)
    fused = torch.randn(T, C + pad, generator=gen, device=DEV).to(torch.bfloat16)
    x = fused[:, 3 : 3 + C]
    w = (torch.randn(C, K, generator=gen, device=DEV) * 0.5).to(torch.bfloat16)
    state = torch.randn(C, K - 1, generator=gen, device=DEV).to(torch.bfloat16)
    return x, w, state


def nan_out(T: int, C: int) -> torch.Tensor:
    return torch.full((T, C), float("nan"), dtype=torch.bfloat16, device=DEV)


PREFILL = [(T, C) for T in (1, 2, 3, 5, 64, 65, 200) for C in (300, 512, 10240)]


@pytest.mark.parametrize("T,C", PREFILL, ids=[f"T{t}-C{c}" for t, c in PREFILL])
def test_prefill_matches_reference(T, C):
    x, w, state = inputs(T, C, seed=T * 100 + C)
    y_ref, state_ref = conv_prefill_ref(x, w, state)
    y_model, state_model = model.causal_conv(x, w, state)  # bf16, cuDNN
    y = conv_prefill(x, w, state, out=nan_out(T, C))
    assert rel_err(y, y_ref) < 1e-2
    assert rel_err(y, y_model.float()) < 1e-2
    assert torch.equal(state, state_ref) and torch.equal(state, state_model)


@pytest.mark.parametrize("split", [1, 2, 3, 64, 70])
def test_prefill_in_pieces_is_bitwise_one_prefill(split):
    x, w, state = inputs(130, 700, seed=split)
    s_all = state.clone()
    y_all = conv_prefill(x, w, s_all)
    s = state.clone()
    y = torch.cat([conv_prefill(x[:split], w, s), conv_prefill(x[split:], w, s)])
    assert torch.equal(y, y_all) and torch.equal(s, s_all)


@pytest.mark.parametrize("T", [1, 2, 5, 32])
def test_chain_gather_and_decode_loop_equal_prefill(T):
    C = 1000
    x, w, state = inputs(T, C, seed=T + 7)
    s_pre = state.clone()
    y_pre = conv_prefill(x, w, s_pre)
    # one gather over the chain (what a spine-only verify does); the state is only read
    s_g = state.clone()
    y_chain = conv_gather(x, w, s_g, conv_pred_chain(T, K).to(DEV), out=nan_out(T, C))
    assert torch.equal(s_g, state)
    assert torch.equal(y_chain, y_pre)
    assert rel_err(y_chain, conv_gather_ref(x, w, state, conv_pred_chain(T, K))) < 1e-2
    # plain decoding: T one-token steps, each a gather then a commit of row 0
    pred1, row0 = conv_pred_chain(1, K).to(DEV), conv_commit_rows([0], 1).to(DEV)
    s_d = state.clone()
    ys = []
    for t in range(T):
        ys.append(conv_gather(x[t : t + 1], w, s_d, pred1))
        conv_state_commit(s_d, x[t : t + 1], row0)
    assert torch.equal(torch.cat(ys), y_pre) and torch.equal(s_d, s_pre)
    # the runner's decode step: conv_decode (gather + commit in one launch), odd channel count
    s_1 = state.clone()
    ys = [conv_decode(x[t : t + 1], w, s_1, out=nan_out(1, C)) for t in range(T)]
    assert torch.equal(torch.cat(ys), y_pre) and torch.equal(s_1, s_pre)


def test_decode_odd_channels_and_bad_input():
    C = 333
    x, w, state = inputs(1, C, seed=5)
    s_ref = state.clone()
    y_ref = conv_gather(x, w, s_ref, conv_pred_chain(1, K).to(DEV))
    conv_state_commit(s_ref, x, conv_commit_rows([0], 1).to(DEV))
    s = state.clone()
    assert torch.equal(conv_decode(x, w, s), y_ref) and torch.equal(s, s_ref)
    with pytest.raises(ValueError, match="one token"):
        conv_decode(torch.zeros(2, C, dtype=torch.bfloat16, device=DEV), w, s)


def test_tree_gather_equals_prefill_along_each_path_and_commit():
    parent = [-1, 0, 1, 2, 3, 0, 5, 1, 7, 2, 9, 10, 4]
    T, C = len(parent), 10240
    x, w, state = inputs(T, C, seed=99)
    pred = conv_pred(parent, K).to(DEV)
    y = conv_gather(x, w, state, pred, out=nan_out(T, C))
    assert rel_err(y, conv_gather_ref(x, w, state, pred)) < 1e-2
    for t in range(T):
        path, a = [], t
        while a >= 0:
            path.append(a)
            a = parent[a]
        path = path[::-1]
        y_path = conv_prefill(x[path].contiguous(), w, state.clone())
        assert torch.equal(y[t], y_path[-1]), f"node {t}"
    # commit an accepted path (padded rows buffer), as after acceptance
    accepted = [0, 1, 2, 9, 10, 11]
    rows = conv_commit_rows(accepted, 16).to(DEV)
    s = state.clone()
    conv_state_commit(s, x, rows)
    assert torch.equal(s, conv_state_commit_ref(state, x, rows.tolist()))
    s_pre = state.clone()
    conv_prefill(x[accepted].contiguous(), w, s_pre)
    assert torch.equal(s, s_pre)


def test_commit_short_paths():
    x, w, state = inputs(6, 333, seed=4)
    for path in ([], [4], [2, 5]):
        s = state.clone()
        conv_state_commit(s, x, conv_commit_rows(path, 8).to(DEV))
        assert torch.equal(s, conv_state_commit_ref(state, x, path)), path


def test_graph_replay_equals_eager():
    parent = [-1, 0, 1, 0, 3]
    T, C = len(parent), 10240
    x, w, state = inputs(T, C, seed=5)
    pred = conv_pred(parent, K).to(DEV)
    rows = conv_commit_rows([0, 3], 8).to(DEV)
    y = nan_out(T, C)
    conv_gather(x, w, state.clone(), pred, out=y)  # compile and load outside the capture
    conv_state_commit(state.clone(), x, rows)
    s = state.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        conv_gather(x, w, s, pred, out=y)
        conv_state_commit(s, x, rows)
    gen = torch.Generator(DEV).manual_seed(6)
    for path in ([0, 1, 2], [0, 3, 4]):
        x.copy_(torch.randn(x.shape, generator=gen, device=DEV))
        rows.copy_(conv_commit_rows(path, 8).to(DEV))
        s.copy_(state)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        s_eager = state.clone()
        assert torch.equal(y, conv_gather(x, w, s_eager, pred))
        conv_state_commit(s_eager, x, conv_commit_rows(path, 8).to(DEV))
        assert torch.equal(s, s_eager)
