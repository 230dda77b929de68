"""When to speculate: tree events while they outpace plain decoding, plain steps otherwise.

An event emits (accepted drafts + 1) tokens in one event time; a plain step emits one token in a step
time. Both change as decoding goes on: acceptance with the content and the sampling temperature, the
times with the context (a verify's 32-row attention grows faster than a plain step's; on an H200 the
default tree needs 1.4 accepted drafts per event to beat plain decoding at 1k positions, 2.8 at 128k).
`AdaptiveSpec` measures both while decoding and picks the faster. The output cannot change: a plain step
is the same kernels on the same state as plain decoding, whose tokens tree decoding equals bitwise; the
engine's plain step also feeds the drafter, so an event may follow at any time (GPUSpecEngine.plain_step).

The rule: every `window` events, compare the tokens per second of the events since the last plain stretch
(at most `memory` windows of them: acceptance comes in bursts, and one window of a few events is noisy)
with 1 / (median of the latest plain step times); events lose only if they are slower by more than
`margin` / sqrt(events compared) (18% after one window of 8, 9% over four), so that a bad window does
not interrupt speculation that pays on average. No plain time yet (a new request: its context may differ):
take `probe` plain steps first. Slower: take `backoff` plain steps, then try events again; each failed try
doubles the next backoff (to `max_backoff`), a try that pays resets it. One policy serves a backend's
requests in turn (`new_request`), so a backoff carries over to the next request. The time of a call is
the host's wall time around it; every event and plain step ends with its one device-to-host read, so it
is the GPU's time plus launch overhead.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class AdaptiveSpec:
    window: int = 8  # events between decisions
    memory: int = 4  # windows of events a decision looks back over (since the last plain stretch)
    probe: int = 3  # plain steps timed when no plain step time is known
    backoff: int = 64  # plain steps after a try that did not pay
    max_backoff: int = 4096
    margin: float = 0.5  # events must be slower by margin / sqrt(events) to lose
    events: deque = field(init=False)  # (tokens, seconds) since the last plain stretch
    plain_times: deque = field(init=False)  # seconds of the latest plain steps
    plain_left: int = field(init=False, default=0)  # plain steps to take before the next event
    next_backoff: int = field(init=False, default=0)
    since: int = field(init=False, default=0)  # events since the last decision
    tries: int = field(init=False, default=0)  # decisions taken
    fallbacks: int = field(init=False, default=0)  # decisions for plain decoding

    def __post_init__(self) -> None:
        if min(self.window, self.memory, self.probe, self.backoff) < 1 or self.max_backoff < self.backoff:
            raise ValueError("window, memory, probe and backoff must be >= 1 and max_backoff >= backoff")
        if not self.margin >= 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        self.events = deque(maxlen=self.window * self.memory)
        self.plain_times = deque(maxlen=self.probe)
        self.next_backoff = self.backoff

    def reset(self) -> None:
        """Forget everything measured, backoffs included (as a new policy)."""
        self.new_request()
        self.plain_left, self.next_backoff, self.tries, self.fallbacks = 0, self.backoff, 0, 0

    def new_request(self) -> None:
        """A new request: its times are measured afresh (its context differs); a backoff in progress and
        the next one carry over."""
        self.events.clear()
        self.plain_times.clear()
        self.since = 0

    def speculate(self) -> bool:
        """Whether the next call should be an event (else a plain step)."""
        return self.plain_left == 0

    def record_event(self, tokens: int, seconds: float) -> None:
        self.events.append((tokens, seconds))
        self.since += 1
        if self.since < self.window:
            return
        if len(self.plain_times) < self.probe:
            self.plain_left = self.probe - len(self.plain_times)  # time plain steps, then decide
            return
        self._decide()

    def record_plain(self, seconds: float) -> None:
        self.plain_times.append(seconds)
        self.plain_left = max(self.plain_left - 1, 0)
        if self.plain_left == 0 and self.since >= self.window:
            self._decide()  # a probe just ended (after a backoff `since` is 0: events come first)

    def _decide(self) -> None:
        self.tries += 1
        self.since = 0
        tokens = sum(n for n, _ in self.events)
        seconds = sum(t for _, t in self.events)
        slack = 1.0 + self.margin / len(self.events) ** 0.5
        if tokens * statistics.median(self.plain_times) * slack < seconds:  # fewer tokens per second
            self.fallbacks += 1
            self.events.clear()
            self.plain_left = self.next_backoff
            self.next_backoff = min(2 * self.next_backoff, self.max_backoff)
        else:
            self.next_backoff = self.backoff
