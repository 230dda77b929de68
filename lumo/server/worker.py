"""The one thread that runs the engine, and the bounded FIFO queue in front of it.

The LLM is not thread-safe, so exactly one worker thread calls it, one request at a time: tokens of
different requests never mix. Requests wait in FIFO order; when `max_queue` are already waiting the next
one is refused (503). A request is admitted once (`admit`: a place held for it, a stream's before its
stream starts), and its jobs (choices, a batch's prompts, one at a time) are then queued whatever the
queue's length. Each job hands its chunks to the event loop through its own asyncio queue. A job
whose client went away is cancelled: if still waiting it leaves the queue (its place is free at once), if
running its generator is closed after the current token, which frees the engine for the next request.
At shutdown (`stop`) every job ends with a 503.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.grammar import GrammarError
from ..engine.llm import PromptTooLongError
from .errors import APIError
from .metrics import ServerMetrics

log = logging.getLogger("lumo.server")
_DONE = object()  # end-of-job marker on a job's output queue


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry later")


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]  # LLM.generate_stream's keyword arguments (protocol._Common.sampling)
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_arrival: float = field(default_factory=time.perf_counter)
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache (set before the first chunk)
    started: bool = False  # the engine took it from the queue
    scores_only: bool = False  # a completions request with max_tokens 0: its one token is not an output

    @property
    def wants_logprobs(self) -> bool:
        """The chunks carry their tokens' logprobs (sampling["logprobs"] is not None)."""
        return self.sampling.get("logprobs") is not None

    def cancel(self) -> None:
        self.cancelled.set()

    def _post(self, item: Any) -> None:
        # called from the worker thread; the loop may already be closed at shutdown
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:
            self.cancel()

    async def events(self):
        """The job's StreamChunks in order; an engine error is raised here, in the request's handler."""
        while True:
            item = await self.out.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Ticket:
    """An admitted request (EngineWorker.admit): a place in the queue held until its first job takes it
    (or the ticket is released or dropped: a stream whose client left before it started)."""

    def __init__(self, worker: EngineWorker) -> None:
        self._worker, self.held = worker, True

    def release(self) -> None:
        with self._worker._cond:
            if self.held:
                self.held = False
                self._worker._held -= 1

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit the worker may be half torn down
            pass


class EngineWorker:
    def __init__(self, llm: Any, metrics: ServerMetrics, max_queue: int = 64) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.llm, self.metrics, self.max_queue = llm, metrics, max_queue
        self._cond = threading.Condition()  # reentrant: a ticket may be dropped while it is held
        self._held = 0  # places held by tickets whose first job is not queued yet
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- called from the event loop ----
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="lumo-engine", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """End every job with a 503 (a waiting one's request gets the JSON error, a running stream an error
        event): called when the server's shutdown begins, so requests answer before their connections
        close. wait: join the engine thread (it stops after the running job's current token)."""
        with self._cond:
            if not self._stopping:
                self._stopping = True
                for job in [*self._waiting, *([self._running] if self._running else [])]:
                    job.cancel()
                    job._post(_shutting_down())
                self._cond.notify_all()
        if wait and self._thread is not None:
            self._thread.join(timeout=10)

    def admit(self) -> Ticket:
        """Admit a request: a 503 if max_queue requests are waiting (or hold their place) already."""
        with self._cond:
            if self._stopping:
                raise _shutting_down()
            dropped = self._drop_cancelled()
            full = len(self._waiting) + self._held >= self.max_queue
            if not full:
                self._held += 1
        # Metrics are never touched under _cond: rendering them holds their lock while a gauge takes _cond
        self.metrics.cancelled.inc(dropped)
        if full:
            raise APIError(503, f"server busy: {self.max_queue} requests already waiting; retry later")
        return Ticket(self)

    def submit(self, job: Job, ticket: Ticket) -> Job:
        """Queue one of an admitted request's jobs: the first takes the place its ticket held, the later
        ones (one at a time per request) go past a full queue, so a request is never refused half done."""
        with self._cond:
            ticket.release()
            if self._stopping:  # a request admitted before shutdown began: its later jobs end at once
                job._post(_shutting_down())
                job._post(_DONE)
                return job
            self._waiting.append(job)
            self._cond.notify()
        return job

    def queue_length(self) -> int:
        """The jobs waiting whose clients are still there (a gauge: read while the metrics are rendered,
        under their lock, so it only counts; admit drops the others)."""
        with self._cond:
            return sum(1 for job in self._waiting if not job.cancelled.is_set())

    def _drop_cancelled(self) -> int:
        """Forget the waiting jobs whose clients left (under _cond): their places are free at once.
        Returns how many."""
        gone = [job for job in self._waiting if job.cancelled.is_set()]
        if gone:
            for job in gone:
                job._post(_DONE)
            self._waiting = collections.deque(j for j in self._waiting if not j.cancelled.is_set())
        return len(gone)

    def running(self) -> int:
        return int(self._running is not None)

    def withdraw(self) -> None:
        """Drop the waiting jobs that were cancelled now (their events end at once), not when the next
        request is admitted or the engine reaches them."""
        with self._cond:
            dropped = self._drop_cancelled()
        self.metrics.cancelled.inc(dropped)

    # ---- the worker thread ----
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    for waiting in self._waiting:  # stop() gave each its 503 (submit queues none after)
                        waiting._post(_DONE)
                    self._waiting.clear()
                    return
                job = self._waiting.popleft()
                skip = job.cancelled.is_set()
                if skip:
                    job._post(_DONE)
                else:
                    self._running, job.started = job, True
            if skip:  # counted outside _cond (admit says why)
                self.metrics.cancelled.inc()
                continue
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        m = self.metrics
        t_start = time.perf_counter()
        m.queue_wait.observe(t_start - job.t_arrival)
        m.prompt_tokens.inc(len(job.prompt_ids))
        gen = None
        try:
            gen = self.llm.generate_stream(job.prompt_ids, max_tokens=job.max_tokens, **job.sampling)
            t_prev, prefilled = None, False
            while not job.cancelled.is_set():
                chunk = next(gen, None)
                if chunk is None:
                    break
                now = time.perf_counter()
                if not prefilled:  # the first chunk: the decoder knows what its prefill reused
                    prefilled = True
                    decoder = getattr(self.llm, "last_decoder", None)
                    job.cached_tokens = int(getattr(decoder, "cached_tokens", 0))
                    m.prompt_tokens_cached.inc(job.cached_tokens)
                n = len(chunk.token_ids)
                if n:
                    if t_prev is None:
                        m.ttft.observe(now - job.t_arrival)
                        if n > 1:
                            m.itl.observe(0.0, count=n - 1)
                    else:
                        m.itl.observe((now - t_prev) / n, count=n)
                    t_prev = now
                # an end token that ended the output counts as generated (vLLM's counter and usage)
                if not job.scores_only:
                    m.generation_tokens.inc(n + (getattr(chunk, "end_token", None) is not None))
                job._post(chunk)
                if chunk.finish_reason is not None:
                    break
            stats = getattr(getattr(self.llm, "last_decoder", None), "stats", None)
            for accepted in stats.accepted if stats is not None else ():
                m.spec_accepted.observe(accepted)
            if stats is not None and getattr(stats, "plain_steps", 0):
                m.spec_plain_steps.inc(stats.plain_steps)
            if job.cancelled.is_set():
                if not self._stopping:  # a client's disconnect, not the shutdown
                    m.cancelled.inc()
            else:
                m.e2e.observe(time.perf_counter() - job.t_arrival)
        except ValueError as exc:  # the request's fault (a grammar that fails while generating): a 400
            expected = isinstance(exc, GrammarError | PromptTooLongError)
            log.warning("request failed: %s", exc, exc_info=not expected)
            job._post(exc)
        except Exception as exc:  # the engine failed on this request: report it there, keep serving
            log.exception("generation failed")
            job._post(exc)
        finally:
            if gen is not None:
                gen.close()  # stops a cancelled generation now and releases its caches
            job._post(_DONE)
