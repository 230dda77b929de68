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

A parked prefix: one slot holds one prefix, and a prompt that shares little of it overwrites it. A coding
agent's short side requests (Claude Code's title and command checks, with system prompts of their own)
would so erase the conversation's cache between two of its turns, and every turn would prefill the whole
conversation again. So a prefix about to be overwritten (a *line*: its tokens and the snapshots past the
point the new request starts from) is parked: the K/V positions the new request may write are copied
aside first (`saved`, positions [lo, hi)), and a later prompt that resumes further in the parked line
than in the slot's swaps the two back (the saved positions copied into the slot, the slot's own copied
aside). One line is parked at a time, the one with the longer cached prefix; `park` caps the positions
copied aside (0: no parking). The slot's positions the parked line still needs beyond `hi` are checked
against what the requests since wrote (`written`, the high-water mark the slot passes to `resume`): a line
whose positions were overwritten keeps only its snapshots below them. Parked positions and states are
bit copies, so a prefill resumed from a parked line computes a cold start's bits, like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import DEFAULT_PREFIX_PARK

# Positions past a prompt copied aside for a parked line when a request starts inside it: what its decoding
# (and a speculative tree's slots) may write before the next request; a request that writes further cuts the
# parked line back (PrefixCache.resume's `written`).
PARK_WINDOW = 4096
PARK_POSITIONS = DEFAULT_PREFIX_PARK  # the default cap on the positions a parked line keeps aside


@dataclass
class Snapshot:
    length: int  # positions [0, length) of the slot are the prefix this state follows
    tensors: list[torch.Tensor]  # copies, in the order the slot's `prefix_state()` lists them
    used: int = 0  # tick of the latest add or hit (least recently used goes first)


@dataclass
class Parked:
    """A prefix moved out of the slot's way. Its positions p < lo hold the same tokens as the slot's (the
    slot's values are its values), [lo, hi) are in `saved`, and [hi, useful) are still the slot's, unwritten
    since it was parked (resume checks that against `written`)."""

    tokens: list[int]  # the token ids at its positions
    snapshots: dict[int, Snapshot]  # its own, every one longer than lo (the slot's up to lo are shared)
    lo: int
    hi: int
    saved: list[torch.Tensor]  # per position cache of the slot: its values at [lo, hi)

    @property
    def useful(self) -> int:
        """Positions worth keeping: up to its longest snapshot (beyond it no state follows them)."""
        return max(self.snapshots, default=0)


class PrefixCache:
    """Which tokens a slot's K/V positions hold, and state snapshots on the prefill grid.

    The slot calls `resume(ids, state, owner)` before a prefill (its state restored, the position to
    prefill from returned), `add(length, state)` after every chunk that ends on the grid (`wants`), and
    `truncate(n)` before anything else writes its positions n.. (a warm-up, a seek). With `park` > 0 and
    the slot's position caches passed to `resume`, a prefix the next prefill would overwrite is parked
    (module docstring), at most `park` of its positions copied aside (`window` past a prompt for what its
    decoding writes)."""

    def __init__(self, chunk: int, capacity: int, park: int = 0, window: int = PARK_WINDOW):
        if chunk < 1 or capacity < 0 or park < 0:
            raise ValueError(f"need chunk >= 1, capacity >= 0 and park >= 0, got {chunk}, {capacity}, {park}")
        self.chunk, self.capacity, self.park, self.window = chunk, capacity, park, window
        self.tokens: list[int] = []  # token ids at positions [0, len) as the latest prefill wrote them
        self.snapshots: dict[int, Snapshot] = {}  # by length
        self.parked: Parked | None = None
        self.swaps = 0  # requests that resumed from the parked line
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
        self.parked = None

    def claim(self, owner: object | None) -> None:
        """The next prefill is `owner`'s (compared by identity): if another one's prefills made the cache,
        it is emptied."""
        if owner is not self.owner:
            self.clear()
            self.owner = owner

    def nbytes(self) -> int:
        snaps = [*self.snapshots.values(), *(self.parked.snapshots.values() if self.parked else ())]
        ts = [t for s in snaps for t in s.tensors] + (self.parked.saved if self.parked else [])
        return sum(t.numel() * t.element_size() for t in ts)

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
        positions: Sequence[torch.Tensor] | None = None,
        written: int | None = None,
    ) -> int:
        """Before a prefill of `ids` by `owner` (`claim`): copy into `state` (the slot's state tensors, in
        the order its snapshots hold them) the snapshot after the longest cached prefix of ids, record ids
        as the slot's tokens (`begin`), and return the position the prefill starts at (0: nothing cached,
        `state` untouched). reuse=False: prefill from 0 (every prompt position's output is wanted); the
        cache is rebuilt by that prefill.
        positions: the slot's position caches ([max_len, ...] each: the K/V, the drafter's K/V), which a
        parked line is copied out of and back into (None: nothing is parked). written: the slot's positions
        [0, written) may have been written since the previous resume (its request's length and what its
        decoding writes past it; None: any)."""
        self.claim(owner)
        parking = positions is not None and self.park > 0
        if not parking:
            self.parked = None
        elif self.parked is not None:
            self._check_written(written)
            if reuse and self.parked is not None:
                live, parked = self.match(ids), self._parked_match(ids)
                if parked is not None and (live is None or parked.length > live.length):
                    self._swap(ids, parked.length, positions)
        snap = self.match(ids) if reuse else None
        start = 0 if snap is None else snap.length
        if parking:
            self._protect(ids, start, positions)
        if snap is not None:
            for dst, src in zip(state, snap.tensors, strict=True):
                dst.copy_(src)
        self.begin(ids, start)
        return start

    def truncate(self, n: int) -> None:
        """Positions n.. are about to be overwritten by something other than a resumed prefill: forget
        their tokens and the snapshots past n, and the parked line (whose positions were not copied aside)."""
        self.parked = None
        self._truncate_live(n)

    def _truncate_live(self, n: int) -> None:
        del self.tokens[n:]
        for length in [k for k in self.snapshots if k > n]:
            del self.snapshots[length]

    # ---- the parked line ----
    def _parked_match(self, ids: Sequence[int]) -> Snapshot | None:
        """As `match`, in the parked line: its own snapshots and the slot's up to its `lo` (shared)."""
        p = self.parked
        n = common_prefix(p.tokens, ids)
        shared = [s for s in self.snapshots.values() if s.length <= p.lo]
        best = None
        for s in [*p.snapshots.values(), *shared]:
            if s.length <= n and s.length < len(ids) and (best is None or s.length > best.length):
                best = s
        return best

    def _check_written(self, written: int | None) -> None:
        """The requests since the previous resume wrote positions below `written`: the parked line's
        snapshots that need slot positions past its saved ones that may have been written are dropped."""
        if written is None or written > self.parked.hi:
            self.parked = _cut(self.parked, self.parked.hi)

    def _swap(self, ids: Sequence[int], start: int, positions: Sequence[torch.Tensor]) -> None:
        """The parked line resumes further than the slot's (at `start`): its saved positions go back into
        the slot, and the slot's line is parked in its place (its positions that this restore and the
        request writes copied aside first, as far as `park` allows)."""
        p = self.parked
        lo = p.lo  # (start > p.lo: the slot's own match is at least as long as a shared snapshot)
        useful = max(self.snapshots, default=0)
        hi = min(useful, lo + self.park, max(p.hi, len(ids) + self.window))
        own = {n: s for n, s in self.snapshots.items() if n > lo}
        line = None
        if own and hi > lo:
            # hi >= p.hi or no snapshot past hi (p.hi - p.lo <= park): the restore below writes only
            # positions copied aside here; the prompt may write further
            saved = [t[lo:hi].clone() for t in positions]
            line = Parked(self.tokens, own, lo, hi, saved)
            if len(ids) > hi:
                line = _cut(line, hi)
        for t, s in zip(positions, p.saved, strict=True):
            t[p.lo : p.hi].copy_(s)
        self.tokens = list(p.tokens)
        self.snapshots = {n: s for n, s in self.snapshots.items() if n <= lo} | p.snapshots
        self.parked = line
        self.swaps += 1

    def _protect(self, ids: Sequence[int], start: int, positions: Sequence[torch.Tensor]) -> None:
        """The request about to prefill ids from `start` writes the slot's positions start..: a line of
        snapshots past start is parked (if it is longer than the parked one), and the parked line's
        positions the request may write are copied aside (a window past the prompt for its decoding)."""
        own = {n: s for n, s in self.snapshots.items() if n > start}
        if own and (self.parked is None or max(own) > self.parked.useful):
            hi = min(max(own), start + self.park, len(ids) + self.window)
            # Snapshots past hi need the slot's positions there: lost where this prompt reaches past hi
            # (where only its decoding may write there: checked at the next resume)
            if len(ids) <= hi or min(own) <= hi:
                saved = [t[start:hi].clone() for t in positions]
                line = Parked(list(self.tokens), own, start, hi, saved)
                self.parked = line if len(ids) <= hi else _cut(line, hi)
                for n in own:
                    del self.snapshots[n]
                return
        p = self.parked
        if p is None or start >= p.useful:
            return
        lo = min(p.lo, start)
        hi = max(p.hi, min(p.useful, len(ids) + self.window, lo + self.park))
        if p.hi - lo > self.park:  # the positions it needs from lo on do not fit the cap
            self.parked = None
            return
        if (lo, hi) != (p.lo, p.hi):
            pairs = zip(positions, p.saved, strict=True)
            p.saved = [torch.cat([t[lo : p.lo], s, t[p.hi : hi]]) for t, s in pairs]
            # the slot's snapshots in (lo, p.lo] are the parked line's too; the request overwrites them
            for n in [n for n in self.snapshots if lo < n <= p.lo]:
                p.snapshots[n] = self.snapshots.pop(n)
            p.lo, p.hi = lo, hi
        if len(ids) > p.hi:
            self.parked = _cut(p, p.hi)

    def begin(self, ids: Sequence[int], start: int) -> None:
        """A prefill of `ids` resumes at position `start` (0, or a snapshot's length from `match`). The
        tokens are recorded now: a snapshot at s is only added once the prefill has written [0, s), so a
        prefill that fails midway leaves the cache consistent."""
        self._truncate_live(start)
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


def _cut(line: Parked, bound: int) -> Parked | None:
    """The parked line with only its snapshots <= bound (the slot's positions past bound may have been
    overwritten); None if none is left."""
    line.snapshots = {n: s for n, s in line.snapshots.items() if n <= bound}
    return line if line.snapshots else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix. Blocks compared as lists first (C speed: a 262k-token
    conversation in ~1 ms instead of ~7), then the first differing block token by token."""
    n, i = min(len(a), len(b)), 0
    while i < n and list(a[i : i + 4096]) == list(b[i : min(i + 4096, n)]):
        i += 4096
    for j in range(i, min(i + 4096, n)):
        if a[j] != b[j]:
            return j
    return n
