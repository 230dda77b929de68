"""Prompt-prefix reuse across requests, exact: a cache hit computes the bits a cache miss computes.

A sequence slot keeps its K/V cache between requests, so a new prompt that starts with tokens the slot
has already prefilled only needs the rest. Positions are cheap to reuse (K/V of position p depend on
tokens <= p only), but the recurrent GDN and conv states exist only at the slot's current end, so the
prefill keeps copies of them, *snapshots*, at chunk boundaries: a new prompt resumes from the latest
snapshot inside the prefix it shares with the slot.

Exactness: prefill runs in chunks on a fixed grid of absolute positions (0, chunk, 2 chunk, ...) and
snapshots are taken only on that grid, at the end of a full chunk. A resumed prefill therefore runs the
same chunks, with the same rows, from bitwise the same state and K/V as a prefill from position 0; the
first token's logits, the states and every later token equal those of a cold start (tested bitwise).
Only prefill writes the positions a snapshot covers: decoded tokens (computed by the decode kernels,
whose bits differ from prefill's) are never reused, so the generated answer of one turn is prefilled
again in the next; at most chunk - 1 tokens of the shared prefix are, too.

Snapshots are kept least-recently-used first out, `capacity` of them (0 turns reuse off). A snapshot is
the GDN states (f32), the conv states and the final-norm hidden row of its last position (the MTP
head's input for the next chunk's first pair): ~154 MB for a 27B model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Snapshot:
    length: int  # positions [0, length) of the slot are the prefix this state follows
    tensors: list[torch.Tensor]  # copies, in the order the slot's `prefix_state()` lists them
    used: int = 0  # tick of the latest add or hit (least recently used goes first)


class PrefixCache:
    """Which tokens a slot's K/V positions hold, and state snapshots on the prefill grid.

    The slot calls `resume(ids, state, owner)` before a prefill (its state restored, the position to
    prefill from returned), `add(length, state)` after every chunk that ends on the grid (`wants`), and
    `truncate(n)` before anything else writes its positions n.. (a warm-up, a seek)."""

    def __init__(self, chunk: int, capacity: int):
        if chunk < 1 or capacity < 0:
            raise ValueError(f"need chunk >= 1 and capacity >= 0, got {chunk}, {capacity}")
        self.chunk, self.capacity = chunk, capacity
        self.tokens: list[int] = []  # token ids at positions [0, len) as the latest prefill wrote them
        self.snapshots: dict[int, Snapshot] = {}  # by length
        self._tick = 0
        # Whoever prefilled keeps caches of its own beside the slot's (a speculative engine: the MTP head's
        # K/V); a prefill by another owner starts the cache afresh (`claim`). A token the owner holds, not
        # the owner: the slot must not keep its engine alive (a reference cycle would leave an old engine's
        # CUDA graphs to the garbage collector, which may destroy them during a later capture).
        self.owner: object | None = None
        self.hits = 0  # requests that resumed from a snapshot
        self.hit_tokens = 0  # prompt tokens not prefilled again, over all requests

    def clear(self) -> None:
        self.tokens = []
        self.snapshots.clear()

    def claim(self, owner: object | None) -> None:
        """The next prefill is `owner`'s (compared by identity): if another one's prefills made the cache,
        it is emptied."""
        if owner is not self.owner:
            self.clear()
            self.owner = owner

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.snapshots.values() for t in s.tensors)

    def match(self, ids: Sequence[int]) -> Snapshot | None:
        """The snapshot a prefill of `ids` can resume from: the longest whose positions hold ids'
        first tokens and that leaves at least one token to prefill (the first token's logits)."""
        n = common_prefix(self.tokens, ids)
        best = None
        for s in self.snapshots.values():
            if s.length <= n and s.length < len(ids) and (best is None or s.length > best.length):
                best = s
        return best

    def resume(
        self,
        ids: Sequence[int],
        state: Sequence[torch.Tensor],
        owner: object | None = None,
        reuse: bool = True,
    ) -> int:
        """Before a prefill of `ids` by `owner` (`claim`): copy into `state` (the slot's state tensors, in
        the order its snapshots hold them) the snapshot after the longest cached prefix of ids, record ids
        as the slot's tokens (`begin`), and return the position the prefill starts at (0: nothing cached,
        `state` untouched). reuse=False: prefill from 0 (every prompt position's output is wanted); the
        cache is rebuilt by that prefill."""
        self.claim(owner)
        snap = self.match(ids) if reuse else None
        start = 0 if snap is None else snap.length
        if snap is not None:
            for dst, src in zip(state, snap.tensors, strict=True):
                dst.copy_(src)
        self.begin(ids, start)
        return start

    def truncate(self, n: int) -> None:
        """Positions n.. are about to be overwritten: forget their tokens and the snapshots past n."""
        del self.tokens[n:]
        for length in [k for k in self.snapshots if k > n]:
            del self.snapshots[length]

    def begin(self, ids: Sequence[int], start: int) -> None:
        """A prefill of `ids` resumes at position `start` (0, or a snapshot's length from `match`). The
        tokens are recorded now: a snapshot at s is only added once the prefill has written [0, s), so a
        prefill that fails midway leaves the cache consistent."""
        self.truncate(start)
        self.tokens = list(ids)
        if start:
            self.hits += 1
            self.hit_tokens += start
            self._touch(self.snapshots[start])

    def wants(self, length: int) -> bool:
        return self.capacity > 0 and length > 0 and length % self.chunk == 0

    def add(self, length: int, tensors: Sequence[torch.Tensor]) -> None:
        """Keep a copy of `tensors` (the slot's state after positions [0, length)); at capacity the
        least recently used snapshot's buffers are reused for it."""
        if not self.wants(length):
            raise ValueError(f"a snapshot at {length} is not on the grid of {self.chunk}-token chunks")
        old = self.snapshots.pop(length, None)
        if old is None and len(self.snapshots) >= self.capacity:
            old = self.snapshots.pop(min(self.snapshots.values(), key=lambda s: s.used).length)
        if old is not None:  # one slot's state: the same shapes every time
            for dst, src in zip(old.tensors, tensors, strict=True):
                dst.copy_(src)
            copies = old.tensors
        else:
            copies = [t.clone() for t in tensors]
        self.snapshots[length] = self._touch(Snapshot(length, copies))

    def _touch(self, s: Snapshot) -> Snapshot:
        self._tick += 1
        s.used = self._tick
        return s


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
