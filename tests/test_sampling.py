from __future__ import annotations

import math

import pytest
import torch

from lumo.engine.sampling import (
    SamplingParams,
    TokenHistory,
    adjust,
    bias_vector,
    filter_logits,
    penalize,
    sample,
    uniform_noise,
)


def test_noise_depends_only_on_seed_and_position():
    a = uniform_noise(7, 100, 50)
    assert torch.equal(a, uniform_noise(7, 100, 50))
    assert torch.equal(a[:20], uniform_noise(7, 100, 20))  # independent of the vocabulary size asked for
    assert not torch.equal(a, uniform_noise(7, 101, 50))
    assert not torch.equal(a, uniform_noise(8, 100, 50))
    assert float(a.min()) > 0 and float(a.max()) < 1


def test_noise_is_uniform():
    u = torch.cat([uniform_noise(3, p, 1000) for p in range(50)])
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert torch.allclose(hist, torch.full_like(hist, 0.1), atol=0.01)


def test_greedy_is_argmax():
    logits = torch.randn(37)
    assert sample(logits, SamplingParams(temperature=0.0), 5) == int(logits.argmax())
    assert sample(logits, SamplingParams(temperature=0.7, top_k=1), 5) == int(logits.argmax())


def test_sampling_matches_softmax():
    # Over many positions, the Gumbel-max draws follow softmax(logits / T).
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0])
    params = SamplingParams(temperature=0.8, seed=11)
    n = 20000
    counts = torch.bincount(torch.tensor([sample(logits, params, p) for p in range(n)]), minlength=5)
    expected = torch.softmax(logits / 0.8, 0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 4 degrees of freedom, p ~ 0.0004


def test_top_k_top_p_filter():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=2)))
    assert kept.tolist() == [True, True, False, False, False]
    probs = torch.softmax(logits, 0)
    p = float(probs[0] + probs[1]) - 1e-4  # the first two tokens reach p
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_p=p)))
    assert kept.tolist() == [True, True, False, False, False]
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_p=1e-6)))
    assert kept.tolist() == [True, False, False, False, False]


def _penalized_loop(logits, params, counts, prompt):
    """vLLM's penalties element by element (float32 arithmetic through 0-dim tensors)."""
    f = torch.float32
    out = []
    for x, c, p in zip(logits.tolist(), counts.tolist(), prompt.tolist(), strict=True):
        x = torch.tensor(x, dtype=f)
        if p or c > 0:
            rep = torch.tensor(params.repetition_penalty, dtype=f)
            x = x / rep if x > 0 else x * rep
        x = x - torch.tensor(params.frequency_penalty, dtype=f) * torch.tensor(float(c), dtype=f)
        x = x - torch.tensor(params.presence_penalty, dtype=f) * torch.tensor(float(c > 0), dtype=f)
        out.append(float(x))
    return torch.tensor(out, dtype=f)


def test_penalties_follow_the_formula():
    g = torch.Generator().manual_seed(3)
    V = 211
    logits = torch.randn(V, generator=g) * 4
    history = TokenHistory(V, torch.randint(0, V, (30,), generator=g).tolist())
    history.add(torch.randint(0, V, (60,), generator=g).tolist())  # some tokens many times
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7)
    got = penalize(logits, params, history)
    assert torch.equal(got, _penalized_loop(logits, params, history.counts, history.prompt))
    untouched = ~history.prompt & (history.counts == 0)
    assert torch.equal(got[untouched], logits[untouched]) and not torch.equal(got, logits)
    # a node's history: the committed one plus its path's tokens, the committed one unchanged
    node = history.with_tokens([5, 5, 7])
    assert int(node.counts[5]) == int(history.counts[5]) + 2
    assert int(node.counts[7]) == int(history.counts[7]) + 1
    assert torch.equal(node.counts.sum(), history.counts.sum() + 3)


def test_penalties_steer_greedy_and_need_a_history():
    logits = torch.tensor([3.0, 2.9, 1.0, -2.0])
    history = TokenHistory(4, [])
    history.add([0])
    assert sample(logits, SamplingParams(temperature=0.0), 1) == 0
    assert sample(logits, SamplingParams(temperature=0.0, presence_penalty=0.5), 1, history) == 1
    assert sample(logits, SamplingParams(temperature=0.0, repetition_penalty=1.1), 1, history) == 1
    assert sample(logits, SamplingParams(temperature=0.0, frequency_penalty=-0.5), 1, history) == 0
    with pytest.raises(ValueError, match="history"):
        sample(logits, SamplingParams(presence_penalty=0.5), 1)


def test_logit_bias_comes_before_the_penalties():
    """vLLM's order: the bias is added to the raw logits, then the penalties act on the biased values
    (repetition divides a positive logit, multiplies a negative one: the order changes the result)."""
    logits = torch.tensor([1.0, 0.5, -1.0, 2.0])
    history = TokenHistory(4, [0])  # token 0 in the prompt
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias=((0, -3.0), (2, 4.0)))
    got = adjust(logits, params, history)
    assert got.tolist() == [(1.0 - 3.0) * 2.0, 0.5, 3.0, 2.0]  # not 1 / 2 - 3
    assert torch.equal(bias_vector(params.logit_bias, 4), torch.tensor([-3.0, 0.0, 4.0, 0.0]))
    assert sample(logits, params, 1, history) == 2  # the bias lifted token 2 above token 3
    assert sample(logits, SamplingParams(temperature=0.0, logit_bias=((3, -100.0),)), 1) == 0  # no history
    # sampled: a banned token never comes, a lifted one always
    ban = SamplingParams(temperature=1.5, seed=4, logit_bias=((3, -100.0),))
    assert 3 not in {sample(logits, ban, p) for p in range(200)}
    lift = SamplingParams(temperature=1.5, top_k=2, seed=4, logit_bias=((1, 100.0),))
    assert {sample(logits, lift, p) for p in range(50)} == {1}


def test_min_tokens_bans_the_stop_tokens_below_a_position():
    """min_tokens: the stop tokens are -inf while sampling positions below ban_until (whatever the bias
    says: the ban comes first), then sampled as usual."""
    logits = torch.tensor([1.0, 5.0, 0.5, 4.0])
    params = SamplingParams(temperature=0.0, stop_ids=(1, 3), ban_until=10, logit_bias=((3, 9.0),))
    assert [params.bans(p) for p in (0, 9, 10, 11)] == [True, True, False, False]
    assert sample(logits, params, 9) == 0 and sample(logits, params, 10) == 3
    sampled = SamplingParams(temperature=2.0, seed=1, stop_ids=(1,), ban_until=100)
    assert 1 not in {sample(logits, sampled, p) for p in range(100)}
    assert 1 in {sample(logits, sampled, p) for p in range(100, 200)}
    assert not SamplingParams(ban_until=10).bans(0)  # no stop tokens: nothing banned


def test_min_p_keeps_tokens_near_the_best():
    logits = torch.tensor([2.0, 1.5, 0.0, -1.0, 2.0 + math.log(0.3) + 1e-3])
    params = SamplingParams(temperature=1.0, min_p=0.3)
    kept = torch.isfinite(filter_logits(logits, params)).tolist()
    probs = torch.softmax(logits, 0)
    assert kept == (probs >= 0.3 * probs.max()).tolist() == [True, True, False, False, True]
    assert SamplingParams().min_p_threshold == -math.inf and SamplingParams(min_p=1.0).min_p_threshold == 0.0
    # seeded draws stay inside the kept set
    draws = {sample(logits, SamplingParams(temperature=1.0, min_p=0.3, seed=2), p) for p in range(300)}
    assert draws == {0, 1, 4}
