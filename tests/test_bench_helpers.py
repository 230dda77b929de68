"""bench/bench_spec.py's shared request timing on the CPU, with a scripted decoder (the benchmarks that use
it, bench_sampling / bench_logprobs, need a GPU)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

_BENCH = str(Path(__file__).parents[1] / "bench")
sys.path.insert(0, _BENCH)  # bench_spec imports bench_decode from its own folder
try:
    bench_spec = importlib.import_module("bench_spec")
finally:
    sys.path.remove(_BENCH)


class Scripted:
    """prefill -> [the prompt's last token]; each step emits `per_step` tokens (an event of per_step - 1
    accepted drafts when `speculates`)."""

    def __init__(self, per_step: int, speculates: bool):
        self.per_step, self.speculates = per_step, speculates

    def prefill(self, prompt):
        if self.speculates:
            self.stats = type("Stats", (), {"accepted": []})()
        self.next = prompt[-1] + 1
        return [prompt[-1]]

    def step(self):
        out = list(range(self.next, self.next + self.per_step))
        self.next += self.per_step
        if self.speculates:
            self.stats.accepted.append(self.per_step - 1)
        return out


def test_timed_requests_counts_tokens_and_acceptance(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    rate, got, accepted = bench_spec.timed_requests(Scripted(3, True), [[1, 2], [10]], 5)
    assert got == [[2, 3, 4, 5, 6], [10, 11, 12, 13, 14]]  # each prompt's first 5 tokens
    assert accepted == [2, 2, 2, 2]  # two events per prompt (1 + 3 + 3 >= 5), 2 accepted drafts each
    assert rate > 0
    rate, got, accepted = bench_spec.timed_requests(Scripted(1, False), [[4]], 3)
    assert got == [[4, 5, 6]] and accepted == []  # a plain decoder: no stats, nothing accepted


def test_repeated_requests_checks_every_run(monkeypatch):
    """repeated_requests: the median rate, the tokens, every run's acceptance; a run (or a reference)
    with other tokens is an error."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    rate, got, accepted = bench_spec.repeated_requests(Scripted(3, True), [[1, 2]], 5, 3)
    assert rate > 0 and got == [[2, 3, 4, 5, 6]] and accepted == [2, 2] * 3
    with pytest.raises(AssertionError, match="not the same"):
        bench_spec.repeated_requests(Scripted(3, True), [[1, 2]], 5, 2, [[9]], "not the same")
