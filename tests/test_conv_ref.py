"""CPU: conv window tables (conv_pred) and the fp32 conv references vs lumo.model.causal_conv."""

from __future__ import annotations

import pytest
import torch

from lumo import model
from lumo.kernels.conv import (
    conv_commit_rows,
    conv_gather_ref,
    conv_pred,
    conv_pred_chain,
    conv_prefill_ref,
    conv_state_commit_ref,
)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def rand(T: int, C: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen) * 0.5
    state = torch.randn(C, K - 1, generator=gen)
    return x, w, state


def test_pred_one_token_and_chain():
    assert conv_pred_chain(1, 4).tolist() == [[-1, -2, -3]]  # plain decoding: the whole state
    assert conv_pred_chain(5, 4).tolist() == [[-1, -2, -3], [-2, -3, 0], [-3, 0, 1], [0, 1, 2], [1, 2, 3]]
    assert conv_pred_chain(2, 2).tolist() == [[-1], [0]]
    assert conv_pred_chain(3, 4).dtype == torch.int32


def test_pred_tree_follows_ancestry():
    # root 0; spine 0-1-2-3; sibling 4 of 1 (parent 0); 5 child of 4; 6 child of 2
    parent = [-1, 0, 1, 2, 0, 4, 2]
    pred = conv_pred(parent, 4).tolist()
    assert pred[5] == [-3, 0, 4]
    assert pred[6] == [0, 1, 2]
    assert pred[3] == [0, 1, 2]
    assert pred[4] == [-2, -3, 0]
    with pytest.raises(ValueError, match="parent"):
        conv_pred([0], 4)


@pytest.mark.parametrize(
    "T,C,K", [(1, 5, 4), (2, 7, 4), (9, 33, 4), (6, 4, 2), (70, 3, 3)], ids=lambda v: str(v)
)
def test_prefill_ref_matches_model(T, C, K):
    x, w, state = rand(T, C, K, T * C + K)
    y, new_state = conv_prefill_ref(x, w, state)
    y_model, state_model = model.causal_conv(x, w, state)
    assert rel_err(y, y_model) < 1e-6
    assert torch.equal(new_state, state_model)


def test_prefill_ref_splits():
    x, w, state = rand(11, 6, 4, 1)
    y, s = conv_prefill_ref(x, w, state)
    y1, s1 = conv_prefill_ref(x[:2], w, state)  # shorter than the state
    y2, s2 = conv_prefill_ref(x[2:], w, s1)
    assert torch.allclose(torch.cat([y1, y2]), y, rtol=1e-6, atol=1e-6) and torch.equal(s2, s)


@pytest.mark.parametrize("T,K", [(1, 4), (6, 4), (3, 2)], ids=lambda v: str(v))
def test_gather_ref_chain_equals_prefill(T, K):
    x, w, state = rand(T, 9, K, T + K)
    y = conv_gather_ref(x, w, state, conv_pred_chain(T, K))
    assert torch.allclose(y, conv_prefill_ref(x, w, state)[0], rtol=1e-6, atol=1e-6)


def test_gather_ref_tree_equals_conv_along_each_path():
    parent = [-1, 0, 1, 2, 0, 4, 2, 6, 7, 1]
    K, C = 4, 11
    x, w, state = rand(len(parent), C, K, 5)
    y = conv_gather_ref(x, w, state, conv_pred(parent, K))
    for t in range(len(parent)):
        path, a = [], t
        while a >= 0:
            path.append(a)
            a = parent[a]
        y_path, _ = model.causal_conv(x[path[::-1]], w, state)  # the node's root-to-node sequence
        assert rel_err(y[t], y_path[-1]) < 1e-6, f"node {t}"


def test_state_commit_ref():
    parent = [-1, 0, 1, 0, 3, 4]
    K, C = 4, 6
    x, w, state = rand(len(parent), C, K, 9)
    path = [0, 3, 4, 5]
    rows = conv_commit_rows(path, 8)
    assert rows.tolist() == [0, 3, 4, 5, -1, -1, -1, -1]
    new = conv_state_commit_ref(state, x, rows.tolist())
    assert torch.equal(new, model.causal_conv(x[path], w, state)[1])
    assert torch.equal(conv_state_commit_ref(state, x, [1, -1, 2]), model.causal_conv(x[[1]], w, state)[1])
    assert torch.equal(conv_state_commit_ref(state, x, [-1]), state)
    with pytest.raises(ValueError, match="capacity"):
        conv_commit_rows([0, 1, 2], 2)
