"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges and histograms.

A `Registry` belongs to one app (no module-level state). Speculative decoding reports accepted drafts per
event in `lumo_spec_accepted_drafts` (observed once per event after each request).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _labels(names: Sequence[str], values: Sequence[str], *extra: str) -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    parts += [e for e in extra if e]
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str], lock: threading.Lock) -> None:
        self.name, self.help, self.labelnames, self._lock = name, help, tuple(labelnames), lock

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self, name: str | None = None) -> list[str]:
        name = name or self.name
        return [f"# HELP {name} {self.help}", f"# TYPE {name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self, name: str | None = None, label: str = "") -> list[str]:
        """The exposition lines, under `name` with `label` added to each sample (an alias) if given."""
        rows = self._values.items() if self._values or self.labelnames else [((), 0.0)]
        name = name or self.name
        return self.header(name) + [f"{name}{_labels(self.labelnames, k, label)} {_num(v)}" for k, v in rows]


class Gauge(_Metric):
    """A value read at scrape time from `fn` (queue length, running requests)."""

    kind = "gauge"

    def __init__(self, *a, fn: Callable[[], float], **kw) -> None:
        super().__init__(*a, **kw)
        self._fn = fn

    def render(self, name: str | None = None, label: str = "") -> list[str]:
        name = name or self.name
        return self.header(name) + [f"{name}{_labels((), (), label)} {_num(self._fn())}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, *a, buckets: Iterable[float], **kw) -> None:
        super().__init__(*a, **kw)
        self.buckets = tuple(sorted(float(b) for b in buckets)) + (math.inf,)
        self._data: dict[tuple[str, ...], list[float]] = {}  # per label set: bucket counts..., sum

    def observe(self, value: float, count: int = 1, **labels: str) -> None:
        """`count` observations of `value` at once (a speculative event emits several tokens together)."""
        key = self._key(labels)
        with self._lock:
            row = self._data.setdefault(key, [0.0] * (len(self.buckets) + 1))
            for i, b in enumerate(self.buckets):
                if value <= b:
                    row[i] += count
            row[-1] += value * count

    def count(self, **labels: str) -> float:
        row = self._data.get(self._key(labels))
        return row[-2] if row else 0.0

    def render(self, name: str | None = None, label: str = "") -> list[str]:
        name = name or self.name
        lines = self.header(name)
        rows = (
            self._data.items() if self._data or self.labelnames else [((), [0.0] * (len(self.buckets) + 1))]
        )
        for key, row in rows:
            for b, c in zip(self.buckets, row[:-1], strict=True):
                le = 'le="' + _num(b) + '"'
                lines.append(f"{name}_bucket{_labels(self.labelnames, key, label, le)} {_num(c)}")
            lab = _labels(self.labelnames, key, label)
            lines.append(f"{name}_sum{lab} {_num(row[-1])}")
            lines.append(f"{name}_count{lab} {_num(row[-2])}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}
        self._aliases: list[tuple[_Metric, str, str]] = []  # (metric, name, label): `alias`

    def _add(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help, labelnames, self._lock))

    def gauge(self, name: str, help: str, fn: Callable[[], float]) -> Gauge:
        return self._add(Gauge(name, help, (), self._lock, fn=fn))

    def histogram(
        self, name: str, help: str, buckets: Iterable[float] = LATENCY_BUCKETS, labelnames: Sequence[str] = ()
    ) -> Histogram:
        return self._add(Histogram(name, help, labelnames, self._lock, buckets=buckets))

    def alias(self, source: str, name: str, label: str) -> None:
        """Expose metric `source` again as `name`, each sample with `label` (`key="value"`) added."""
        self._aliases.append((self._metrics[source], name, label))

    def render(self) -> str:
        with self._lock:
            lines = [line for m in self._metrics.values() for line in m.render()]
            lines += [line for m, name, label in self._aliases for line in m.render(name, label)]
        return "\n".join(lines) + "\n"


# vLLM's names for lumo's metrics, for dashboards and autoscalers built on vLLM's /metrics (with vLLM's
# `model_name` label): its prefix-cache counters count tokens, as lumo's prompt and cached token counters do
VLLM_NAMES = (
    ("lumo_num_requests_running", "vllm:num_requests_running"),
    ("lumo_num_requests_waiting", "vllm:num_requests_waiting"),
    ("lumo_prompt_tokens_total", "vllm:prompt_tokens_total"),
    ("lumo_generation_tokens_total", "vllm:generation_tokens_total"),
    ("lumo_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    ("lumo_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
    ("lumo_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
    ("lumo_queue_wait_seconds", "vllm:request_queue_time_seconds"),
    ("lumo_prompt_tokens_total", "vllm:prefix_cache_queries_total"),
    ("lumo_prompt_tokens_cached_total", "vllm:prefix_cache_hits_total"),
)


def add_vllm_names(registry: Registry, model_name: str) -> None:
    """vLLM's names (VLLM_NAMES) for the registered metrics, labelled with the model."""
    label = f'model_name="{_escape(model_name)}"'
    for source, name in VLLM_NAMES:
        registry.alias(source, name, label)


class ServerMetrics:
    """The server's own metrics, on a fresh registry."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.counter(
            "lumo_requests_total", "HTTP requests by endpoint and status", ("endpoint", "status")
        )
        self.prompt_tokens = r.counter("lumo_prompt_tokens_total", "prompt tokens of generation requests")
        self.prompt_tokens_cached = r.counter(
            "lumo_prompt_tokens_cached_total", "prompt tokens taken from the prefix cache, not prefilled"
        )
        self.generation_tokens = r.counter("lumo_generation_tokens_total", "generated tokens")
        self.ttft = r.histogram(
            "lumo_time_to_first_token_seconds", "arrival to first token, queueing included"
        )
        self.itl = r.histogram("lumo_inter_token_latency_seconds", "time per generated token after the first")
        self.e2e = r.histogram("lumo_request_latency_seconds", "arrival to last token of generation requests")
        self.queue_wait = r.histogram("lumo_queue_wait_seconds", "arrival to start of generation")
        self.spec_plain_steps = r.counter(
            "lumo_spec_plain_steps_total", "tokens decoded plainly while speculation did not pay (adaptive)"
        )
        self.spec_accepted = r.histogram(
            "lumo_spec_accepted_drafts", "accepted draft tokens per speculative event", buckets=range(33)
        )
        self.cancelled = r.counter(
            "lumo_requests_cancelled_total",
            "requests whose client went away (generations stopped, waiting ones dropped)",
        )
