from __future__ import annotations

import torch

from lumo.engine.sampling import SamplingParams, filter_logits, sample, uniform_noise


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
