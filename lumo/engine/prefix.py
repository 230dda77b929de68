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

Parked lines: one slot holds one prefix, and a prompt that shares little of it overwrites it. A coding
agent's short side requests (Claude Code's title and command checks, with system prompts of their own) and
its sub-agents' conversations would so erase the main conversation's cache between two of its turns, and
every turn would prefill the whole conversation again. So a prefix about to be overwritten (a *line*: its
tokens and the snapshots past the point the new request starts from) is parked: before anything writes
the slot's positions [a, b) (a prefill and a window past the prompt for its decoding, or a parked line
copied back), every parked line copies aside the ones of them it still takes from the slot (`saved`: its
values at [lo, hi)). A later prompt that resumes further in a parked line than in the slot's swaps it in:
its saved positions are copied back and the slot's line is parked in its turn. Up to `lines` lines are
parked: the newest, then those that came back, then the longest (`_park`); `park` caps the
positions each keeps aside (0: no parking). A parked line's positions past `hi` are still the slot's,
checked against what the requests since wrote (`written`, the high-water mark the slot passes to
`resume`): a line whose positions were overwritten keeps only its snapshots below them. Parked positions
and states are bit copies, so a prefill resumed from a parked line computes a cold start's bits, like any
other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..config import DEFAULT_PREFIX_LINES, DEFAULT_PREFIX_PARK

# Positions past a prompt guarded for the parked lines when a request starts inside them: what its decoding
# (and a speculative tree's slots) may write before the next request; a request that writes further cuts
# them back (PrefixCache.resume's `written`).
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
    # requests that resumed this line (in the slot, or swapped back in) before it was parked: a line that
    # came back is kept before one that never did, and those by length (PrefixCache._park)
    uses: int = 0
    # Per position cache of the slot, its values at [lo, hi) in a ring of `park` rows (position p at row
    # p % park: a run grows either way in place); empty until something is saved
    saved: list[torch.Tensor] = field(default_factory=list)

    @property
    def useful(self) -> int:
        """Positions worth keeping: up to its longest snapshot (beyond it no state follows them)."""
        return max(self.snapshots, default=0)

    def save(self, positions: Sequence[torch.Tensor], a: int, b: int, rows: int) -> None:
        """Copy the slot's positions [a, b) into the ring (`rows` of it, made by the first save)."""
        if not self.saved:
            self.saved = [t.new_empty((min(rows, len(t)), *t.shape[1:])) for t in positions]
        for dst, src in zip(self.saved, positions, strict=True):
            for s, e, r in _ring(a, b, len(dst)):
                dst[r : r + e - s].copy_(src[s:e])

    def restore(self, positions: Sequence[torch.Tensor]) -> None:
        """Copy the saved positions [lo, hi) back into the slot's."""
        if self.hi == self.lo:
            return
        for dst, src in zip(positions, self.saved, strict=True):
            for s, e, r in _ring(self.lo, self.hi, len(src)):
                dst[s:e].copy_(src[r : r + e - s])


class PrefixCache:
    """Which tokens a slot's K/V positions hold, and state snapshots on the prefill grid.

    The slot calls `resume(ids, state, owner)` before a prefill (its state restored, the position to
    prefill from returned), `add(length, state)` after every chunk that ends on the grid (`wants`), and
    `truncate(n)` before anything else writes its positions n.. (a warm-up, a seek). With `park` > 0,
    `lines` > 0 and the slot's position caches passed to `resume`, a prefix the next prefill would
    overwrite is parked (module docstring): up to `lines` of them, each with at most `park` positions
    copied aside (`window` past a prompt for what its decoding writes)."""

    def __init__(
        self,
        chunk: int,
        capacity: int,
        park: int = 0,
        window: int = PARK_WINDOW,
        lines: int = DEFAULT_PREFIX_LINES,
    ):
        if chunk < 1 or capacity < 0 or park < 0 or lines < 0:
            raise ValueError(
                f"need chunk >= 1 and capacity, park, lines >= 0, got {chunk}, {capacity}, {park}, {lines}"
            )
        self.chunk, self.capacity, self.park, self.window = chunk, capacity, park, window
        self.max_lines = lines if park else 0
        self.tokens: list[int] = []  # token ids at positions [0, len) as the latest prefill wrote them
        self.snapshots: dict[int, Snapshot] = {}  # by length
        self.lines: list[Parked] = []  # parked, the newest first (`_park`)
        self.swaps = 0  # requests that resumed from a parked line
        self._uses = 0  # requests that resumed the slot's own line (Parked.uses once it is parked)
        self._guarded = 0  # the latest request's writes past this were not guarded for the parked lines
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
        self.lines = []
        self._uses = 0

    def claim(self, owner: object | None) -> None:
        """The next prefill is `owner`'s (compared by identity): if another one's prefills made the cache,
        it is emptied."""
        if owner is not self.owner:
            self.clear()
            self.owner = owner

    def nbytes(self) -> int:
        """Bytes of the snapshots and the parked lines' saved positions (a snapshot shared by two lines
        once)."""
        snaps = {id(s): s for d in (self.snapshots, *(p.snapshots for p in self.lines)) for s in d.values()}
        ts = [t for s in snaps.values() for t in s.tensors] + [t for p in self.lines for t in p.saved]
        return sum(t.numel() * t.element_size() for t in ts)

    def match(self, ids: Sequence[int]) -> Snapshot | None:
        """The snapshot a prefill of `ids` can resume from: the longest whose positions hold ids'
        first tokens and that leaves at least one token to prefill (the first token's logits)."""
        return _longest(self.snapshots.values(), common_prefix(self.tokens, ids), len(ids))

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
        positions: the slot's position caches ([max_len, ...] each: the K/V, the drafter's K/V), which the
        parked lines are copied out of and back into (None: nothing is parked). written: the slot's
        positions [0, written) may have been written since the previous resume (its request's length and
        what its decoding writes past it; None: any)."""
        self.claim(owner)
        parking = positions is not None and self.max_lines > 0
        if not parking:
            self.lines = []
        elif self.lines:
            self._check_written(written)
            if reuse:
                self._swap_in(ids, positions)
        snap = self.match(ids) if reuse else None
        start = 0 if snap is None else snap.length
        branched = parking and self._park(start)
        # the slot's line goes on (a resume of it) unless the prompt starts afresh or leaves it here
        self._uses = self._uses + 1 if start and not branched else 0
        if parking:
            # from start - 1: a speculative prefill rewrites the drafter's pair at start - 1 (its hidden row
            # with the token at start), which the lines parked at start share
            self._guard(max(start - 1, 0), len(ids) + self.window, positions)
        if snap is not None:
            for dst, src in zip(state, snap.tensors, strict=True):
                dst.copy_(src)
        self.begin(ids, start)
        return start

    def truncate(self, n: int) -> None:
        """Positions n.. are about to be overwritten by something other than a resumed prefill: forget
        their tokens and the snapshots past n, and the parked lines (whose positions were not saved)."""
        self.lines = []
        self._truncate_live(n)

    def _truncate_live(self, n: int) -> None:
        del self.tokens[n:]
        for length in [k for k in self.snapshots if k > n]:
            del self.snapshots[length]

    # ---- the parked lines ----
    def _parked_match(self, p: Parked, ids: Sequence[int]) -> Snapshot | None:
        """As `match`, in the parked line p: its own snapshots and the slot's up to its `lo` (shared)."""
        shared = [s for s in self.snapshots.values() if s.length <= p.lo]
        return _longest([*p.snapshots.values(), *shared], common_prefix(p.tokens, ids), len(ids))

    def _check_written(self, written: int | None) -> None:
        """The latest request wrote the slot's positions below `written`, and guarded those below
        `_guarded` (`_guard`): the parked lines' snapshots past their saved positions that need positions
        it may have written unguarded are dropped."""
        if written is not None and written <= self._guarded:
            return
        bound = 0 if written is None else self._guarded
        self.lines = [p for p in self.lines if _cut(p, max(p.hi, bound)) is not None]

    def _swap_in(self, ids: Sequence[int], positions: Sequence[torch.Tensor]) -> None:
        """A parked line that resumes ids further than the slot's goes back into the slot: the slot's line
        is parked (`_park` from the swapped line's lo, where they part), its saved positions are copied
        back over the slot's (guarded for the other lines first), and its snapshots become the slot's."""
        live = self.match(ids)
        best, best_len = None, 0 if live is None else live.length
        for p in self.lines:
            s = self._parked_match(p, ids)
            if s is not None and s.length > best_len:
                best, best_len = p, s.length
        if best is None:
            return
        self.lines.remove(best)
        p = best
        # (p.lo < best_len: were the slot's shared snapshot longest, the slot's own match would be as long)
        self._park(p.lo)
        self._guard(p.lo, p.hi, positions)
        p.restore(positions)
        self.tokens = list(p.tokens)
        self.snapshots = {n: s for n, s in self.snapshots.items() if n <= p.lo} | p.snapshots
        self._uses = p.uses  # (resume counts this request on top)
        self.swaps += 1

    def _park(self, start: int) -> bool:
        """The slot's positions start.. are about to be written: its snapshots past start become a parked
        line (nothing saved yet: `_guard` copies what it needs aside); True if there were any. The lines
        kept, `max_lines` of them: the newest; then those that came back (a request resumed them before
        they were parked), the more recently parked first; then those that never did, the longest first
        (the newer among equals). Each rule answers a way an earlier one lost a coding agent's
        conversation: longest first alone (until session 47) kept two long prompts that never came back for
        good, and every side request erased the conversation; most recently parked alone lost a main
        conversation that had come back to a sub-agent and two side requests of a chunk or more; came back
        and then most recent (session 47) lost a main conversation parked after its first turn (an agent
        that starts a sub-agent at once) to the sub-agent's side requests (session 48, on the H100). The
        price: a long prompt that never comes back keeps a place until lines that came back fill them, and
        a new conversation's first turn followed by two side requests loses to an older, longer such
        prompt (session 48's review). By length and age the two cases look alike (an older, longer line
        against a newer, shorter one), so no order of them keeps both; the longer is kept: its prefill is
        the dearer to repeat."""
        own = {n: s for n, s in self.snapshots.items() if n > start}  # (the slot drops them in `begin`)
        if not own:
            return False
        line = Parked(list(self.tokens), own, start, start, uses=self._uses)
        rank = sorted(self.lines, key=lambda p: (0, 0) if p.uses else (1, -p.useful))  # stable: newer first
        self.lines = [line, *rank][: self.max_lines]
        return True

    def _guard(self, a: int, b: int, positions: Sequence[torch.Tensor]) -> None:
        """The slot's positions [a, b) are about to be written: each parked line copies aside those of them
        it takes from the slot (below its lo, where it shares the slot's snapshots too, and from its hi up to
        its longest snapshot), its saved positions staying one run [lo, hi) of at most `park`. A line
        that cannot keep the positions below a is dropped; one whose saved run cannot reach b is cut back to
        its snapshots inside it."""
        self._guarded = b
        kept = []
        for p in self.lines:
            below = a < p.lo  # positions it shares with the slot are written
            above = max(a, p.hi) < min(b, p.useful)  # positions past its saved run are written
            if below or above:
                lo = a if below else p.lo
                if p.hi - lo > self.park:  # the positions it needs from lo on do not fit the cap
                    continue
                want = min(b, p.useful) if above else p.hi
                hi = min(max(p.hi, want), lo + self.park)
                p.save(positions, lo, p.lo, self.park)
                p.save(positions, p.hi, hi, self.park)
                # the slot's snapshots in (lo, p.lo] are the parked line's too; the write overwrites them
                shared = {n: s for n, s in self.snapshots.items() if lo < n <= p.lo}
                p.snapshots = dict(sorted((p.snapshots | shared).items())[-self.capacity :])
                p.lo, p.hi = lo, hi
                if hi < want and _cut(p, max(hi, a)) is None:  # positions [hi, want) are lost
                    continue
            kept.append(p)
        self.lines = kept

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
        least recently used snapshot's buffers are reused for it (unless a parked line shares them)."""
        if not self.wants(length):
            raise ValueError(f"a snapshot at {length} is not on the grid of {self.chunk}-token chunks")
        old = self.snapshots.pop(length, None)
        if old is None and len(self.snapshots) >= self.capacity:
            old = self.snapshots.pop(min(self.snapshots.values(), key=lambda s: s.used).length)
        if old is not None and not any(s is old for p in self.lines for s in p.snapshots.values()):
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


def _ring(lo: int, hi: int, rows: int):
    """Positions [lo, hi) (at most `rows` of them) as runs (start, end, ring row of start) of a ring."""
    while lo < hi:
        r = lo % rows
        end = min(hi, lo + rows - r)
        yield lo, end, r
        lo = end


def _longest(snapshots, n: int, limit: int) -> Snapshot | None:
    """The longest snapshot within the first n positions that leaves at least one of `limit` to prefill."""
    best = None
    for s in snapshots:
        if s.length <= n and s.length < limit and (best is None or s.length > best.length):
            best = s
    return best


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
