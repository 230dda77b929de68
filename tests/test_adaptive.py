"""AdaptiveSpec (lumo/engine/adaptive.py): the decisions between tree events and plain steps, from scripted
times (CPU). Exactness of the mixed decoding is tested on the engine (test_gpu_spec_dryrun.py, GPU tests)."""

from __future__ import annotations

import pytest

from lumo.engine.adaptive import AdaptiveSpec


def run(policy: AdaptiveSpec, tokens_per_event: int, event_s: float, plain_s: float, calls: int) -> str:
    """The sequence of choices ('E' event, 'p' plain step) over `calls` calls with fixed costs."""
    out = []
    for _ in range(calls):
        if policy.speculate():
            out.append("E")
            policy.record_event(tokens_per_event, event_s)
        else:
            out.append("p")
            policy.record_plain(plain_s)
    return "".join(out)


def test_events_that_pay_keep_speculating_after_one_probe():
    p = AdaptiveSpec(window=4, probe=2, backoff=8)
    # 5 tokens per 10 ms event against a 5 ms plain step: 500 against 200 tokens/s
    assert run(p, 5, 0.010, 0.005, 20) == "EEEE" + "pp" + "E" * 14
    assert (p.tries, p.fallbacks) == (4, 0)


def test_events_that_do_not_pay_fall_back_and_back_off():
    p = AdaptiveSpec(window=4, probe=2, backoff=3, max_backoff=6)
    # 1 token per 10 ms event against 5 ms plain steps: tries of 4 events, backoffs 3, 6, 6 (capped)
    seq = run(p, 1, 0.010, 0.005, 40)
    assert seq == "EEEE" + "pp" + "ppp" + "EEEE" + "pppppp" + "EEEE" + "pppppp" + "EEEE" + "pppppp" + "E"
    assert p.fallbacks == p.tries == 4


def test_a_try_that_pays_resets_the_backoff():
    p = AdaptiveSpec(window=2, probe=1, backoff=2, max_backoff=16)
    run(p, 1, 0.010, 0.005, 12)  # slow: backoffs grow
    assert p.next_backoff > 2
    seq = run(p, 9, 0.010, 0.005, 30)  # now events pay: after the pending backoff, events only
    assert seq.rstrip("E").count("E") <= 2 and seq.endswith("E" * 20)
    assert p.next_backoff == 2


def test_break_even_is_tokens_per_second_with_a_margin_that_shrinks():
    # 3 tokens per 15 ms event = exactly one 5 ms plain step's rate: speculation is kept
    p = AdaptiveSpec(window=2, probe=1, backoff=4)
    assert "p" not in run(p, 3, 0.015, 0.005, 20)[3:]
    # 10% slower events: kept while the margin (0.5 / sqrt(events)) exceeds 10%, dropped once it does not
    q = AdaptiveSpec(window=2, memory=20, probe=1, backoff=4)
    seq = run(q, 3, 0.0165, 0.005, 60)
    first = seq.index("pppp")  # 0.5 / sqrt(n) < 0.1 from n = 26 events: the 13th decision
    assert seq[:first].count("E") == 26 and q.fallbacks >= 1
    with pytest.raises(ValueError):
        AdaptiveSpec(margin=-1)


def test_one_bad_window_after_good_ones_does_not_fall_back():
    p = AdaptiveSpec(window=2, memory=4, probe=1, backoff=4)
    seq = []
    for tokens in [6, 6, 6, 6, 6, 6, 1, 1, 6, 6]:  # 10 ms events; 5 ms plain steps: 2 tokens break even
        while not p.speculate():
            seq.append("p")
            p.record_plain(0.005)
        seq.append("E")
        p.record_event(tokens, 0.010)
    assert "".join(seq) == "EE" + "p" + "E" * 8 and p.fallbacks == 0


def test_new_request_measures_again_and_keeps_the_backoff():
    p = AdaptiveSpec(window=2, probe=2, backoff=4)
    assert run(p, 1, 0.010, 0.005, 5) == "EE" + "pp" + "p"  # a probe of 2, then 1 of a backoff of 4
    p.new_request()
    assert not p.plain_times and not p.events
    # the backoff's last 3 steps time the plain step afresh: no probe before the next decision
    assert run(p, 9, 0.010, 0.005, 8) == "ppp" + "EEEEE" and p.fallbacks == 1


@pytest.mark.parametrize(
    "kw", [{"window": 0}, {"memory": 0}, {"probe": 0}, {"backoff": 0}, {"backoff": 8, "max_backoff": 4}]
)
def test_bad_settings(kw):
    with pytest.raises(ValueError):
        AdaptiveSpec(**kw)
