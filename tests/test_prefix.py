"""Prompt-prefix reuse (lumo/engine/prefix.py) on the reference decoders (CPU): a request that resumes from
a snapshot computes bitwise what the same request computes from position 0 (first token, states, K/V,
the MTP's K/V and draft logits, every later token), plus the snapshot bookkeeping itself."""

from __future__ import annotations

import random

import pytest
import torch

from lumo.config import TreeConfig
from lumo.engine import decode
from lumo.engine.decode import PlainDecoder, Slot, SpecDecoder
from lumo.engine.prefix import PrefixCache, common_prefix
from lumo.engine.sampling import SamplingParams
from lumo.testing import make_tiny_checkpoint
from lumo.weights import load_model

CHUNK = 16  # the reference prefill's chunk in these tests (decode.PREFILL_CHUNK is patched)
TREE = TreeConfig(depth=4, topk=3, budget=8, rows=16)


# ---- the bookkeeping ----------------------------------------------------------------------------


def state(x: float) -> list[torch.Tensor]:
    return [torch.full((3,), float(x)), torch.full((2, 2), float(x))]


def test_match_takes_the_longest_snapshot_inside_the_shared_prefix():
    pc = PrefixCache(chunk=4, capacity=8)
    ids = list(range(100, 114))  # 14 tokens: grid points 4, 8, 12
    pc.begin(ids, 0)
    for n in (4, 8, 12):
        pc.add(n, state(n))
    assert pc.match(ids + [1, 2]).length == 12
    assert pc.match(ids).length == 12
    assert pc.match(ids[:12]).length == 8  # at least one token is left to prefill
    assert pc.match(ids[:10] + [7, 7, 7]).length == 8  # diverges at 10
    assert pc.match(ids[:3] + [0] * 20) is None
    assert pc.match([]) is None


def test_begin_drops_the_snapshots_a_prefill_overwrites_and_counts_hits():
    pc = PrefixCache(chunk=4, capacity=8)
    a = list(range(20))
    pc.begin(a, 0)
    for n in (4, 8, 12, 16):
        pc.add(n, state(n))
    b = a[:9] + [99] * 10
    snap = pc.match(b)
    assert snap.length == 8
    pc.begin(b, snap.length)
    assert sorted(pc.snapshots) == [4, 8]  # 12 and 16 followed a[8:12], which b overwrites
    assert pc.tokens == b and pc.hits == 1 and pc.hit_tokens == 8
    assert torch.equal(pc.snapshots[8].tensors[0], torch.full((3,), 8.0))


def test_least_recently_used_goes_first_and_its_buffers_are_reused():
    pc = PrefixCache(chunk=4, capacity=2)
    ids = list(range(40))
    pc.begin(ids, 0)
    pc.add(4, state(4))
    pc.add(8, state(8))
    buffers = pc.snapshots[4].tensors
    pc.add(12, state(12))
    assert sorted(pc.snapshots) == [8, 12]
    assert pc.snapshots[12].tensors[0] is buffers[0]  # reused, not reallocated
    assert torch.equal(pc.snapshots[12].tensors[1], torch.full((2, 2), 12.0))
    assert pc.nbytes() == 2 * (3 + 4) * 4
    pc.begin(ids[:10] + [0] * 9, pc.match(ids[:10] + [0] * 9).length)  # a hit on 8 (12 is dropped)
    pc.add(12, state(-12))
    pc.add(16, state(-16))  # 8, hit before 12 was added, is now the least recently used
    assert sorted(pc.snapshots) == [12, 16]


def test_snapshots_only_on_the_grid_and_truncate():
    pc = PrefixCache(chunk=4, capacity=3)
    pc.begin(list(range(12)), 0)
    with pytest.raises(ValueError, match="grid"):
        pc.add(6, state(6))
    pc.add(4, state(4))
    pc.add(8, state(8))
    pc.truncate(5)
    assert sorted(pc.snapshots) == [4] and pc.tokens == [0, 1, 2, 3, 4]
    assert not PrefixCache(chunk=4, capacity=0).wants(8)
    with pytest.raises(ValueError):
        PrefixCache(chunk=0, capacity=1)
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1], [1, 2]) == 1


# ---- exactness on the reference decoders ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3, dtype="float32", num_hidden_layers=4)
    return load_model(d, progress=False)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(decode, "PREFILL_CHUNK", CHUNK)


def make(tiny, kind: str, params: SamplingParams, slot: Slot | None):
    cfg, w = tiny
    if kind == "plain":
        return PlainDecoder(cfg, w, params, 160, "cpu", torch.float32, slot)
    tree = TREE if kind == "tree" else TreeConfig(depth=3, topk=1, budget=3, rows=4)
    return SpecDecoder(cfg, w, params, 160, "cpu", torch.float32, tree, slot=slot)


def assert_same(a, b, n: int) -> None:
    """Caches and (speculative) draft inputs of two decoders after a prefill of n prompt tokens."""
    ca, cb = a.cache, b.cache
    assert ca.length == cb.length == n and a.pending == b.pending
    for x, y in zip(ca.kv_k + ca.kv_v, cb.kv_k + cb.kv_v, strict=True):
        assert torch.equal(x[:n], y[:n])
    for x, y in zip(ca.gdn_state + ca.conv_state, cb.gdn_state + cb.conv_state, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(ca.mtp_k + ca.mtp_v, cb.mtp_k + cb.mtp_v, strict=True):
        assert torch.equal(x[:n], y[:n])  # pairs 0..n-1, the last one with the pending token
    if isinstance(a, SpecDecoder):
        assert torch.equal(a.draft_logits, b.draft_logits)
        assert torch.equal(a.draft_hidden, b.draft_hidden)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


FIRST = tokens(70, 0)  # the first request: grid snapshots at 16, 32, 48, 64
FOLLOW_UPS = {
    # name: (second prompt, the position it must resume from)
    "extends": (FIRST + tokens(9, 1), 64),
    "diverges-mid-chunk": (FIRST[:41] + tokens(30, 2), 32),
    "same-prompt": (FIRST, 64),
    "ends-on-the-grid": (FIRST[:48], 32),  # 48 itself would leave no token to prefill
    "unrelated": (tokens(50, 3), 0),
}


@pytest.mark.parametrize("follow_up", list(FOLLOW_UPS))
@pytest.mark.parametrize("kind", ["plain", "tree", "chain"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_resumed_request_equals_a_cold_one_bitwise(tiny, small_chunks, kind, follow_up, temperature):
    params = SamplingParams(temperature=temperature, top_k=40, top_p=0.9, seed=7)
    second, resume_at = FOLLOW_UPS[follow_up]
    slot = Slot(prefix_snapshots=4)
    first = make(tiny, kind, params, slot)
    first.prefill(FIRST)
    for _ in range(5):  # decoding writes positions past the prompt: never part of a reusable prefix
        first.step()
    assert sorted(slot.prefix.snapshots) == [16, 32, 48, 64]

    warm, cold = make(tiny, kind, params, slot), make(tiny, kind, params, None)
    assert warm.cache is first.cache  # the slot's cache, kept
    out_w, out_c = warm.prefill(second), cold.prefill(second)
    assert warm.cached_tokens == resume_at and cold.cached_tokens == 0
    assert out_w == out_c
    assert_same(warm, cold, len(second))
    for _ in range(6):
        assert warm.step() == cold.step()
    assert warm.cache.length == cold.cache.length


@pytest.mark.parametrize("kind", ["plain", "tree", "chain"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_side_request_between_two_turns_leaves_the_conversation_cached(
    tiny, small_chunks, kind, temperature
):
    """An unrelated request between two turns of a conversation (a coding agent's side call): the
    conversation is parked (its K/V the side request overwrites copied aside, the drafter's too) and its
    next turn resumes from its longest snapshot, bitwise a cold start; without parking it starts from 0."""
    params = SamplingParams(temperature=temperature, top_k=40, top_p=0.9, seed=7)
    second = FIRST + tokens(9, 1)
    for park, resume_at in ((0, 0), (200, 64)):
        slot = Slot(prefix_snapshots=4, prefix_park=park)
        for prompt, steps in ((FIRST, 5), (tokens(20, 4), 9)):
            d = make(tiny, kind, params, slot)
            d.prefill(prompt)
            for _ in range(steps):
                d.step()
        warm, cold = make(tiny, kind, params, slot), make(tiny, kind, params, None)
        out_w, out_c = warm.prefill(second), cold.prefill(second)
        assert warm.cached_tokens == resume_at and out_w == out_c
        assert_same(warm, cold, len(second))
        for _ in range(6):
            assert warm.step() == cold.step()


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_a_branch_leaves_the_drafters_row_before_it_to_the_parked_line(tiny, small_chunks, kind):
    """A branch that resumes at 32 rewrites the drafter's pair at 31 (its hidden row with the branch's
    token at 32), which the conversation it parks shares: saved with it, so the conversation's next turn,
    swapped back in at 64, drafts from a cold start's drafter K/V (a review found row 31 left overwritten)."""
    params = SamplingParams(temperature=0.0)
    slot = Slot(prefix_snapshots=4, prefix_park=200)
    for prompt in (FIRST, FIRST[:32] + tokens(20, 9)):  # the second resumes at 32 and parks FIRST's line
        d = make(tiny, kind, params, slot)
        d.prefill(prompt)
        for _ in range(3):
            d.step()
    second = FIRST + tokens(9, 1)
    warm, cold = make(tiny, kind, params, slot), make(tiny, kind, params, None)
    assert warm.prefill(second) == cold.prefill(second) and warm.cached_tokens == 64
    assert_same(warm, cold, len(second))


def test_a_third_request_reuses_the_second_ones_snapshots(tiny, small_chunks):
    params = SamplingParams(temperature=0.0)
    slot = Slot(prefix_snapshots=2)
    turn = FIRST
    for i in range(3):  # each prompt = the previous one + an answer + a new message
        d = make(tiny, "tree", params, slot)
        out = d.prefill(turn)
        while len(out) < 8:
            out += d.step()
        assert d.cached_tokens == (0 if i == 0 else (len(turn) - 20) // CHUNK * CHUNK)
        assert len(slot.prefix.snapshots) <= 2
        cold = make(tiny, "tree", params, None)
        assert cold.prefill(turn) == out[:1]
        turn = turn + out[:8] + tokens(12, 10 + i)


def test_a_larger_cache_empties_the_prefix_cache(tiny, small_chunks):
    cfg, w = tiny
    slot = Slot(prefix_snapshots=4)
    params = SamplingParams(temperature=0.0)
    PlainDecoder(cfg, w, params, 100, "cpu", torch.float32, slot).prefill(FIRST)
    assert slot.prefix.snapshots and slot.cache.max_len == decode.MIN_CAPACITY
    big = PlainDecoder(cfg, w, params, decode.MIN_CAPACITY + 1, "cpu", torch.float32, slot)
    assert not slot.prefix.snapshots and big.cache.max_len > decode.MIN_CAPACITY
    big.prefill(FIRST)
    assert big.cached_tokens == 0


def test_llm_reports_cached_tokens_and_keeps_outputs(tmp_path):
    """The LLM's torch backend keeps one slot across requests (default chunk: 512 tokens)."""
    from lumo.engine.llm import LLM

    d = make_tiny_checkpoint(tmp_path / "m", seed=5, dtype="float32", num_hidden_layers=2)
    on, off = LLM(d, device="cpu", spec="tree"), LLM(d, device="cpu", spec="tree", prefix_snapshots=0)
    prompt = tokens(600, 4)
    r1 = on.generate(prompt, max_tokens=4, temperature=0.7, seed=3)
    again = prompt[:590] + tokens(20, 5)
    r2 = on.generate(again, max_tokens=12, temperature=0.7, seed=3)
    assert (r1.cached_tokens, r2.cached_tokens) == (0, 512)
    ref = off.generate(again, max_tokens=12, temperature=0.7, seed=3)
    assert ref.cached_tokens == 0 and r2.token_ids == ref.token_ids
    # an unrelated request in between parks the conversation (LLM's default prefix_park), and not with 0;
    # two conversations and a side request after each: both parked with the default two lines, with one
    # only the second (the line parked last stays)
    other = tokens(700, 7)
    for kw, cached in (({}, (512, 512)), ({"prefix_park": 0}, (0, 0)), ({"prefix_lines": 1}, (0, 512))):
        llm = on if not kw else LLM(d, device="cpu", spec="tree", **kw)
        for p in (prompt, other):
            llm.generate(p, max_tokens=4, temperature=0.7, seed=3)
            llm.generate(tokens(40, 6), max_tokens=8)
        r3 = llm.generate(again, max_tokens=12, temperature=0.7, seed=3)
        assert r3.cached_tokens == cached[0] and r3.token_ids == ref.token_ids, kw
        r4 = llm.generate(other[:650], max_tokens=4, temperature=0.7, seed=3)
        assert r4.cached_tokens == cached[1], kw
    with pytest.raises(ValueError, match="prefix_snapshots"):
        LLM(d, device="cpu", prefix_snapshots=-1)
    with pytest.raises(ValueError, match="prefix_park"):
        LLM(d, device="cpu", prefix_park=-1)
    with pytest.raises(ValueError, match="prefix_lines"):
        LLM(d, device="cpu", prefix_lines=-1)


# ---- parked lines (a prefix moved out of the way of a request that would overwrite it) --------------


class Slot1:
    """A slot emulated for the bookkeeping: position p holds a hash of the tokens up to p (as K/V depend
    on the tokens <= p), the state after n positions a hash of the first n; a request's decoding writes its
    outputs' positions and `ahead` more (a speculative tree's slots) with junk."""

    def __init__(
        self, max_len: int, chunk: int = 4, capacity: int = 3, park: int = 40, window: int = 6, lines: int = 1
    ):
        self.pc = PrefixCache(chunk, capacity, park=park, window=window, lines=lines)
        self.kv = torch.full((max_len,), -1, dtype=torch.int64)
        self.state = torch.zeros(1, dtype=torch.int64)
        self.written = None

    @staticmethod
    def h(ids) -> int:
        return hash(tuple(ids)) & ((1 << 62) - 1)

    def request(self, ids: list[int], new: int = 3, ahead: int = 2, rng=None) -> int:
        start = self.pc.resume(ids, [self.state], positions=[self.kv], written=self.written)
        # what the slot holds for the resumed prefix is exactly the prompt's: positions and state
        want = [self.h(ids[: p + 1]) for p in range(start)]
        assert self.kv[:start].tolist() == want, (ids, start)
        assert start == 0 or int(self.state) == self.h(ids[:start])
        for p in range(start, len(ids)):
            self.kv[p] = self.h(ids[: p + 1])
            if self.pc.wants(p + 1):
                self.pc.add(p + 1, [torch.tensor([self.h(ids[: p + 1])])])
        end = min(len(self.kv), len(ids) + new + ahead)
        junk = torch.randint(0, 1 << 40, (end - len(ids),), generator=rng)
        self.kv[len(ids) : end] = junk  # decoded tokens' K/V and tree slots: never reused
        self.written = end
        return start


def test_a_side_request_parks_the_conversation_and_it_resumes_after():
    """Claude Code's pattern: a long conversation, a short unrelated request, the conversation's next turn.
    Without parking the side request overwrites the conversation's positions and its next turn prefills
    from 0; with it the turn resumes from its longest snapshot (the bookkeeping: the slot's positions and
    state equal the prompt's, checked in Slot1.request)."""
    conv = list(range(100, 140))  # 40 tokens: snapshots at 32, 36, 40 (capacity 3)
    side = list(range(500, 507))
    for park, want in ((0, 0), (40, 40)):
        s = Slot1(64, park=park)
        assert s.request(conv) == 0
        assert s.request(side) == 0
        assert s.request(conv + [1, 2, 3]) == want, park
        assert s.request(side + [9]) == (4 if park else 0)  # the side line was parked in turn (snapshot 4)
        assert s.request(conv + [1, 2, 3, 4, 5]) == (40 if park else 0)
    assert s.pc.swaps == 3


def test_parking_keeps_the_newer_line_and_respects_its_cap():
    long_, mid, short = list(range(100, 150)), list(range(300, 330)), list(range(600, 610))
    s = Slot1(80, park=64)
    s.request(long_)
    s.request(mid)  # long_ parked
    s.request(short)  # mid parked, the newer line: long_'s dropped although its prefix is longer
    assert [p.tokens for p in s.pc.lines] == [mid]
    assert s.request(mid + [7]) == 28
    assert s.request(long_ + [7]) == 0
    # two lines: both kept, most recently used first
    s = Slot1(80, park=64, lines=2)
    for ids in (long_, mid, short):
        s.request(ids)
    assert [p.tokens for p in s.pc.lines] == [mid, long_]
    assert s.request(long_ + [7]) == 48 and s.request(mid + [7]) == 28 and s.request(short + [7]) == 8
    # a cap smaller than the positions to copy aside: nothing parked, the next turn starts from 0
    s = Slot1(80, park=2)
    s.request(long_)
    s.request(short)
    assert s.pc.lines == [] and s.request(long_ + [7]) == 0


def test_a_request_decoding_past_the_saved_window_cuts_the_parked_line_back():
    """The positions past a prompt copied aside are a window (what its decoding will likely write); a
    request that writes further overwrites the parked line's positions there, and its snapshots past the
    window are dropped at the next resume rather than restored over overwritten positions."""
    conv, side = list(range(100, 140)), list(range(500, 505))
    for new, want in ((3, 40), (20, 0)):
        s = Slot1(64, window=6)
        s.request(conv)
        s.request(side, new=new)  # [0, 11) copied aside; it writes [0, 10) or [0, 27)
        assert s.request(conv + [1]) == want


def test_a_conversation_and_a_sub_agent_both_survive_side_requests():
    """Claude Code with a sub-agent: the main conversation waits while a sub-agent's conversation (a system
    prompt of its own) runs turn after turn, each turn followed by a side request (a command check), then
    the main conversation goes on. With two lines parked both conversations resume from their longest
    snapshots every time; with one the sub-agent's line, parked after the main one's, takes its place:
    every sub-agent turn resumes and the main conversation starts again from 0."""
    main, check = list(range(100, 160)), list(range(600, 606))
    for lines in (2, 1):
        s = Slot1(128, park=80, window=8, lines=lines)
        sub = list(range(300, 330))
        s.request(main)
        got = []
        for turn in range(3):
            sub = sub + [700 + turn] * 5
            got.append(s.request(sub))
            s.request(check + [turn])
            sub = sub + [800 + turn] * 4  # the sub-agent's answer, prefilled again in its next turn
        assert got == [0, 32, 44], (lines, got)
        assert s.request(main + [1, 2]) == (60 if lines == 2 else 0)


@pytest.mark.parametrize("came_back", [True, False], ids=["after-two-turns", "after-its-first-turn"])
def test_a_main_conversation_outlives_side_requests_that_leave_lines(came_back):
    """The sub-agent scenario with side requests of a chunk or more, each different (a summarised web page,
    another agent's check): each parks a line of its own, and the sub-agent's, parked last, always gets a
    place. The main conversation keeps the other: after two turns because it came back before it was
    parked (with the newest line alone kept, session 47's first fix, a review found the second side
    request pushed it out); after its first turn (an agent that starts a sub-agent at once) because it is
    longer than the side requests (session 48: under session 47's rule, lines that came back and then the
    more recently parked, they pushed it out: tests/test_prefix_gpu.py on the H100)."""
    main = list(range(100, 160))
    s = Slot1(160, park=96, window=8, lines=2)
    if came_back:
        s.request(main[:40])
    s.request(main)  # after main[:40]: the turn resumes the slot's line, the conversation came back
    sub = list(range(300, 330))
    got = []
    for turn in range(3):
        sub = sub + [700 + turn] * 5
        got.append(s.request(sub))
        s.request([900 + 20 * turn + i for i in range(12)])  # a side request of its own, with a snapshot
        sub = sub + [800 + turn] * 4
    assert got == [0, 32, 44], got
    assert s.request(main + [1, 2]) == 60


def test_long_prompts_that_never_return_do_not_erase_a_conversation():
    """Two long one-off prompts, then a conversation with a side request between its turns: the newest line
    and then those that came back are kept before the longest, so the conversation's turns resume after
    each side request (until session 47 the two longest lines were kept for good and every side request
    erased the conversation's). The one-offs keep only the place the conversation does not need: the
    newer of the two (they are as long) until a third line is parked beside the conversation."""
    one_offs = [list(range(100, 160)), list(range(200, 260))]
    conv, side = list(range(300, 330)), list(range(600, 606))
    s = Slot1(128, park=96, window=8, lines=2)
    for ids in one_offs:
        s.request(ids)
    got = []
    for turn in range(3):
        conv = conv + [700 + turn] * 3
        got.append(s.request(conv))
        s.request(side + [turn])
    assert got == [0, 32, 36], got
    assert [p.tokens for p in s.pc.lines] == [conv, one_offs[1]]
    assert s.request(one_offs[0] + [1]) == 0  # the older one-off went first
    assert [p.tokens for p in s.pc.lines][1] == conv  # the side request's line took the newest place
    assert s.request(one_offs[1] + [1]) == 0  # and the other one-off's went


@pytest.mark.parametrize("seed", range(40))
def test_random_requests_keep_the_slot_consistent(seed):
    """Random conversations, branches, side requests, decode lengths, caps and windows: whatever resume
    returns, the slot then holds exactly the prompt's positions and state up to it (Slot1.request asserts
    it), and the parked line never keeps more than its cap aside."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    park, lines, capacity = rng.choice([0, 8, 24, 96]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 5])
    s = Slot1(96, chunk=4, capacity=capacity, park=park, window=rng.choice([0, 3, 10]), lines=lines)
    bases = [[rng.randrange(50) for _ in range(60)] for _ in range(3)]
    hits = 0
    for _ in range(60):
        base = rng.choice(bases)
        n = rng.randrange(1, 60)
        ids = base[:n]
        if rng.random() < 0.3:
            ids = ids + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        hits += s.request(ids[:80], new=rng.randrange(0, 12), ahead=rng.randrange(0, 4), rng=gen)
        assert len(s.pc.lines) <= lines
        for p in s.pc.lines:
            assert p.hi - p.lo <= park and (p.hi == p.lo or p.saved[0].shape[0] == min(park, 96))
            assert 0 < len(p.snapshots) <= capacity and min(p.snapshots) > p.lo
    assert hits > 0


def test_the_slots_snapshots_shared_with_the_parked_line_stay_its_own():
    """A branch of a conversation (resumed at 24 from the conversation's own snapshots) parks the
    conversation past 24; an unrelated request then overwrites the shared positions too: the snapshot at
    24, shared until then, moves to the parked line, and a later prompt of the conversation that diverges
    before 28 still resumes from it."""
    conv = list(range(100, 140))  # snapshots 24 .. 40 (capacity 5)
    s = Slot1(64, capacity=5)
    s.request(conv)
    assert s.request(conv[:26] + list(range(300, 310))) == 24
    assert s.pc.lines[0].lo == 23  # (the drafter's row 23 is rewritten from 24 on: saved too)
    s.request(list(range(500, 510)))
    assert s.pc.lines[0].lo == 0 and 24 in s.pc.lines[0].snapshots
    assert s.request(conv[:27] + [9]) == 24


def test_common_prefix_against_a_plain_scan():
    """common_prefix compares 4096-token blocks first: the same lengths as a token-by-token scan, at the
    block boundaries too, with lists and tuples."""
    rng = random.Random(1)

    def scan(a, b):
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)

    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.choice([0, 1, 4095, 4096, 4097, 9000]))]
        cut = rng.choice([0, len(a), 4096, 4095, 8192, rng.randrange(len(a) + 1)])
        b = a[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 5000))]
        a, b = (a, tuple(b)) if rng.random() < 0.5 else (b, a)
        assert common_prefix(a, b) == scan(a, b)
