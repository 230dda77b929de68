"""sample_tokens (GPU) == the CPU sampler on bitwise-equal logits; the noise is bit-exact.

The first test runs on the CPU: it proves the double-based Gumbel formula is rounding-safe for every one of
the 2^23 possible uniforms, which is what makes GPU == CPU hold for all (seed, position), not just most.
"""

from __future__ import annotations

import pytest
import torch

from lumo.engine.sampling import SamplingParams
from lumo.kernels.sampling import (
    NCAND,
    Penalties,
    gumbel_of_uniform,
    sample_noise,
    sample_tokens,
    sample_tokens_ref,
    sample_workspace,
    uniform_noise_ref,
)

DEV = "cuda"
ALL_U = (torch.arange(1 << 23).float() + 0.5) * (1.0 / (1 << 23))  # every uniform the hash can produce


def _min_margin_ulps(yd: torch.Tensor) -> float:
    """Smallest distance (in double ulps) from the double values yd to an fp32 rounding boundary."""
    yf = yd.float()
    inf = torch.tensor(float("inf"))
    mids = [(yf.double() + torch.nextafter(yf, s * inf).double()) / 2 for s in (1, -1)]
    dist = torch.minimum((yd - mids[0]).abs(), (yd - mids[1]).abs())
    ulp = (torch.nextafter(yd, torch.tensor(float("inf"), dtype=torch.float64)) - yd).abs()
    nz = yd != 0
    return (dist[nz] / ulp[nz]).min().item()


def test_noise_formula_is_rounding_safe():
    assert ALL_U.max() < 1 and ALL_U.min() > 0
    assert torch.equal(ALL_U.double(), (torch.arange(1 << 23).double() + 0.5) / (1 << 23))  # exact
    e = -torch.log(ALL_U.double())
    assert _min_margin_ulps(e) > 8
    assert _min_margin_ulps(-torch.log(e.float().double())) > 8


@pytest.mark.gpu
def test_noise_bitwise_exhaustive():
    u, g = sample_noise(0, 0, 1 << 23, raw=True)
    assert torch.equal(u.cpu(), ALL_U)
    assert torch.equal(g.cpu(), gumbel_of_uniform(ALL_U))


@pytest.mark.gpu
@pytest.mark.parametrize("seed,position", [(0, 0), (7, 100), (2**40 + 3, 123456), (-5, 2**33 + 9)])
def test_noise_hash_matches(seed, position):
    from lumo.engine.sampling import uniform_noise

    u, _ = sample_noise(seed, position, 248320)
    assert torch.equal(u.cpu(), uniform_noise_ref(seed, position, 248320))
    # The engine's CPU sampler must draw the same uniforms (lumo/engine/sampling.py uses the same formula).
    assert torch.equal(uniform_noise_ref(seed, position, 1000), uniform_noise(seed, position, 1000))


def _filtered_sorted_probs(x: torch.Tensor, temp: float, top_k: int) -> torch.Tensor:
    x = x / temp
    if 0 < top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
    return torch.softmax(torch.sort(x, descending=True).values, dim=-1)


def _safe_top_p(x: torch.Tensor, temp: float, top_k: int, gen: torch.Generator) -> float:
    """A top_p in the middle of a gap of the CPU's exclusive cumulative mass: the kept set cannot depend
    on summation order (the GPU's softmax sums differ in the last bits)."""
    probs = _filtered_sorted_probs(x, temp, top_k)
    before = torch.cumsum(probs.double(), 0) - probs.double()
    limit = min(NCAND - 1, (top_k if top_k > 0 else NCAND) - 1)
    ok = [j for j in range(1, limit) if probs[j] > 1e-4]
    if not ok:
        return float(torch.tensor(probs[0].item() / 2, dtype=torch.float32))
    j = ok[int(torch.randint(0, len(ok), (1,), generator=gen))]
    return float(torch.tensor((before[j] + before[j + 1]).item() / 2, dtype=torch.float32))


def make_rows(T: int, V: int, seed: int, bf16: bool = False):
    """f32 logits (bf16 values when bf16: the engine's lm_head output, widened) and per-row params."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=gen) * 3
    if bf16:
        logits = logits.to(torch.bfloat16).float()
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a greedy tie: lowest index wins
    temps, ks, ps = [], [], []
    modes = ["greedy", "plain", "topk", "topp", "topk_topp", "k1"]
    for t in range(T):
        mode = modes[t % len(modes)] if t else "greedy"
        temp = float(torch.tensor(0.3 + 1.2 * torch.rand(1, generator=gen).item(), dtype=torch.float32))
        k = int(torch.randint(2, NCAND + 1, (1,), generator=gen)) if "topk" in mode else 0
        if mode == "greedy":
            temp = 0.0
        if mode == "k1":
            k = 1
        p = _safe_top_p(logits[t], temp, k, gen) if "topp" in mode else 1.0
        temps.append(temp)
        ks.append(k)
        ps.append(p)
    seeds = torch.randint(-(2**62), 2**62, (T,), generator=gen)
    positions = torch.randint(0, 2**20, (T,), generator=gen)
    return (
        logits,
        torch.tensor(temps, dtype=torch.float32),
        torch.tensor(ks, dtype=torch.int32),
        torch.tensor(ps, dtype=torch.float32),
        seeds,
        positions,
    )


def to_dev(rows):
    return tuple(x.to(DEV).contiguous() for x in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("T,V", [(1, 1000), (13, 9973), (32, 50001), (8, 248320)], ids=lambda v: str(v))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokens_match_cpu_sampler(T, V, seed):
    rows = make_rows(T, V, seed * 1000 + T)
    got = sample_tokens(*to_dev(rows), out=torch.full((T,), -1, dtype=torch.int32, device=DEV))
    assert torch.equal(got.cpu(), sample_tokens_ref(*rows))


@pytest.mark.gpu
@pytest.mark.parametrize("T,V", [(1, 1000), (13, 9973), (32, 248320)], ids=lambda v: str(v))
def test_bf16_logits_read_as_their_f32_values(T, V):
    """bf16 logits (LOGITS_BF16 build) give the tokens of the same values in f32 and the CPU sampler's."""
    rows = make_rows(T, V, 77 + T, bf16=True)
    dev = to_dev(rows)
    got = sample_tokens(dev[0].to(torch.bfloat16), *dev[1:])
    assert torch.equal(got, sample_tokens(*dev))
    assert torch.equal(got.cpu(), sample_tokens_ref(*rows))


@pytest.mark.gpu
def test_many_positions_plain_and_filtered():
    # One row of logits, many (seed, position) pairs: a strong check of the noise path.
    V, T = 32003, 32
    base = make_rows(1, V, 9)[0][0]
    for mode in ("plain", "topk", "topp"):
        gen = torch.Generator().manual_seed(len(mode))
        logits = base.expand(T, V).contiguous()
        temp = torch.full((T,), 0.8, dtype=torch.float32)
        k = torch.full((T,), 40 if mode == "topk" else 0, dtype=torch.int32)
        p = torch.full((T,), _safe_top_p(base, 0.8, 0, gen) if mode == "topp" else 1.0, dtype=torch.float32)
        seeds = torch.randint(0, 2**31, (T,), generator=gen)
        positions = torch.arange(T) * 7919 + 3
        rows = (logits, temp, k, p, seeds, positions)
        got = sample_tokens(*to_dev(rows))
        ref = sample_tokens_ref(*rows)
        assert torch.equal(got.cpu(), ref), mode
        if mode == "plain":
            assert len(set(ref.tolist())) > 1  # the noise actually varies the draw


@pytest.mark.gpu
def test_rows_independent_of_batch():
    rows = to_dev(make_rows(32, 20011, 5))
    full = sample_tokens(*rows)
    for lo, hi in [(0, 1), (4, 5), (7, 20), (31, 32)]:
        sub = sample_tokens(*(x[lo:hi].contiguous() for x in rows))
        assert torch.equal(sub, full[lo:hi])


@pytest.mark.gpu
def test_graph_replay():
    T, V = 6, 12345
    rows = to_dev(make_rows(T, V, 3))
    ws = sample_workspace(T, V, DEV)
    out = torch.empty(T, dtype=torch.int32, device=DEV)
    sample_tokens(*rows, out=out, workspace=ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_tokens(*rows, out=out, workspace=ws)
    for step in range(3):
        rows[5].add_(1)  # next position
        rows[0].copy_(torch.randn(T, V, generator=torch.Generator().manual_seed(step)).to(DEV) * 3)
        out.fill_(-1)
        graph.replay()
        assert torch.equal(out, sample_tokens(*rows))


@pytest.mark.gpu
@pytest.mark.parametrize("T,V", [(1, 1000), (13, 9973), (32, 248320)], ids=lambda v: str(v))
def test_penalties_and_min_p_match_cpu_sampler(T, V):
    """Penalties (a committed histogram, the prompt, each row's path tokens), min-p and the logit bias: the
    CPU sampler's tokens; the sampled tokens added to count_out. Rows cycle through off / penalised / min-p /
    both, some of them biased, in the greedy, plain and top-k modes (top-p only where nothing else is on: its
    safe thresholds are computed on the raw logits)."""
    logits, temps, ks, ps, seeds, positions = make_rows(T, V, 500 + T)
    gen = torch.Generator().manual_seed(T)
    R, E = 32, 11
    best = logits.argmax(1)
    node_tokens = torch.randint(0, V, (R,), generator=gen, dtype=torch.int32)
    node_tokens[: min(R, T)] = best[: min(R, T)].int()  # path tokens that hit the rows' best tokens
    path = torch.full((T, E), -1, dtype=torch.int32)
    counts = torch.zeros(V, dtype=torch.int32)
    hot = torch.randint(0, V, (V // 20,), generator=gen)
    counts.index_add_(0, hot, torch.randint(1, 4, hot.shape, generator=gen, dtype=torch.int32))
    counts[best[1::4]] += 2  # committed history on some rows' best tokens
    prompt = (torch.rand(V, generator=gen) < 0.05).to(torch.uint8)
    prompt[best[2::4]] = 1
    pen = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * T)
    if T > 1:
        temps[1] = 0.0
        second = logits[1].topk(2).values[1]
        logits[1, best[1]] = second + 1.0
    thr = torch.full((T,), -float("inf"))
    for t in range(T):
        kind = t % 4  # 0 off, 1 penalised, 2 min-p, 3 both
        n = int(torch.randint(0, E + 1, (1,), generator=gen))
        path[t, :n] = torch.randint(0, R, (n,), generator=gen, dtype=torch.int32)
        if kind in (1, 3):
            rep = 0.5 + torch.rand(1, generator=gen).item()
            freq, pres = (torch.rand(2, generator=gen) * 4 - 2).tolist()
            pen[t] = torch.tensor([rep, freq, pres, 0.0])
        if t == 1:
            pen[t] = torch.tensor([1.0, 0.0, 2.0, 0.0])
        if kind in (2, 3):
            thr[t] = SamplingParams(min_p=0.01 + 0.5 * torch.rand(1, generator=gen).item()).min_p_threshold
        if kind:
            ps[t] = 1.0
        if kind and t % 8 >= 4:  # the logit bias too (not with top-p: its thresholds are the raw rows')
            pen[t, 3] = 1.0
    bias = torch.zeros(V)
    biased = torch.randint(0, V, (V // 50,), generator=gen)
    bias[biased] = ((torch.rand(biased.shape, generator=gen) * 200 - 100) * 8).round() / 8
    bias[best[4::8]] = -100.0  # the best tokens of biased rows banned or pushed
    bias[best[5::8]] = 3.0
    penalties = Penalties(pen, counts, prompt, path, node_tokens, bias)
    dev = Penalties(*(x.to(DEV) for x in (pen, counts, prompt, path, node_tokens, bias)))
    count_out = torch.zeros(V, dtype=torch.int32, device=DEV)
    rows = (logits, temps, ks, ps, seeds, positions)
    got = sample_tokens(*to_dev(rows), min_p=thr.to(DEV), penalties=dev, count_out=count_out)
    want = sample_tokens_ref(*rows, min_p=thr, penalties=penalties)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(count_out.cpu(), torch.bincount(want.long(), minlength=V).int())
    if T > 1:  # row 1: greedy, its best token generated before and 1 above the next: presence 2 moves it
        assert float(temps[1]) == 0.0 and int(counts[best[1]]) > 0 and float(pen[1, 2]) == 2.0
        assert int(want[1]) != int(best[1])


@pytest.mark.gpu
@pytest.mark.parametrize("V", [9973, 248320, 300001], ids=lambda v: f"V{v}")  # 300001: 37 lists, sorts
@pytest.mark.parametrize("k", [2, 20, 64, 65], ids=lambda k: f"k{k}")  # 65: the sorting path
def test_small_top_k_with_ties_matches_cpu_sampler(V, k):
    """Top-k rows with k <= 64 take their candidates by warp merges (sampling.cu, KFAST): on logits on a
    coarse grid (many tokens share the k-th value, all kept by top-k), with and without top-p, greedy
    k = 1 aside, the CPU sampler's tokens; bf16 logits too."""
    gen = torch.Generator().manual_seed(V + k)
    T = 8
    logits = (torch.randn(T, V, generator=gen) * 2).round() / 2  # values on a grid of 0.5: ties
    for bf16 in (False, True):
        x = logits.to(torch.bfloat16).float() if bf16 else logits
        temps = torch.full((T,), 0.7)
        ks = torch.full((T,), k, dtype=torch.int32)
        ps = torch.tensor([1.0 if t % 2 else _safe_top_p(x[t], 0.7, k, gen) for t in range(T)])
        seeds = torch.randint(0, 2**40, (T,), generator=gen)
        positions = torch.randint(0, 2**20, (T,), generator=gen)
        ties = [int((x[t] / 0.7 == torch.topk(x[t] / 0.7, k).values[-1]).sum()) for t in range(T)]
        assert max(ties) > 1 and max(ties) < NCAND  # ties at the k-th value, fewer than the cap
        rows = (x, temps, ks, ps, seeds, positions)
        logits_in = x.to(torch.bfloat16) if bf16 else x
        got = sample_tokens(logits_in.to(DEV), *to_dev(rows[1:]))
        assert torch.equal(got.cpu(), sample_tokens_ref(*rows)), f"bf16={bf16}"


@pytest.mark.gpu
@pytest.mark.parametrize("k", [20, 65], ids=lambda k: f"k{k}")
def test_signed_zero_ties_at_the_k_th_value(k):
    """-0 and +0 are one value (a penalty can give an exact +0): with the k-th value 0, top-k keeps every
    token at +-0, and top-p orders them by index, as the CPU sampler does."""
    gen = torch.Generator().manual_seed(k)
    T, V = 4, 20011
    logits = -1 - torch.rand(T, V, generator=gen) * 4
    logits[:, : k - 1] = 1 + torch.rand(T, k - 1, generator=gen) * 4
    zeros = torch.randperm(V - k, generator=gen)[:40] + k
    logits[:, zeros[::2]] = 0.0
    logits[:, zeros[1::2]] = -0.0
    temps = torch.full((T,), 0.9)
    ks = torch.full((T,), k, dtype=torch.int32)
    ps = torch.tensor([1.0, 1.0, 0.999999, 0.999999])
    rows = (logits, temps, ks, ps, torch.arange(T) + 5, torch.arange(T) + 100)
    got = sample_tokens(*to_dev(rows))
    assert torch.equal(got.cpu(), sample_tokens_ref(*rows))


@pytest.mark.gpu
@pytest.mark.parametrize("V", [3001, 248320], ids=lambda v: f"V{v}")
def test_logit_bias_matches_cpu_sampler(V):
    """OpenAI's logit_bias, added to the raw logits before everything else, in every sampling mode (greedy,
    plain, top-k, top-k + top-p, top-p, min-p, with the penalties, top-k 1), f32 and bf16 logits: the CPU
    sampler's tokens. The rows' best tokens are banned (-100) and each row has a token of its own just
    below its best lifted by +4, so every biased row's token differs from its unbiased one (checked on the
    CPU reference); a row with the flag off ignores the vector."""
    gen = torch.Generator().manual_seed(V)
    T = 9
    logits = torch.randn(T, V, generator=gen) * 3
    best = logits.argmax(1)
    lifted = torch.randperm(V, generator=gen)[:T]
    logits[torch.arange(T), lifted] = logits.max(1).values - 1.0  # each row's own, 1 below its best
    bias = torch.zeros(V)
    nz = torch.randint(0, V, (40,), generator=gen)
    bias[nz] = torch.randn(40, generator=gen)
    bias[best], bias[lifted] = -100.0, 4.0
    # rows: greedy, greedy unbiased, plain, top-k 20, top-k 20 + top-p 0.9, top-p, min-p, penalised, top-k 1
    temps = torch.tensor([0.0, 0.0, 0.8, 0.8, 0.8, 0.8, 0.8, 0.7, 0.9])
    ks = torch.tensor([0, 0, 0, 20, 20, 0, 0, 20, 1], dtype=torch.int32)
    ps = torch.ones(T)
    thr = torch.full((T,), -float("inf"))
    thr[6] = SamplingParams(min_p=0.05).min_p_threshold
    pen = torch.tensor([[1.0, 0.0, 0.0, 1.0]] * T)
    pen[1, 3] = 0.0
    pen[7] = torch.tensor([1.2, 0.3, 1.5, 1.0])
    counts = torch.zeros(V, dtype=torch.int32)
    counts[torch.randint(0, V, (V // 10,), generator=gen)] = 2
    prompt = (torch.rand(V, generator=gen) < 0.05).to(torch.uint8)
    penalties = Penalties(pen, counts, prompt, bias=bias)
    dev = Penalties(pen.to(DEV), counts.to(DEV), prompt.to(DEV), bias=bias.to(DEV))
    off = Penalties(pen * torch.tensor([1.0, 1.0, 1.0, 0.0]), counts, prompt, bias=bias)  # no row biased
    seeds, positions = torch.arange(T) + 11, torch.arange(T) + 4000
    for bf16 in (False, True):
        x = logits.to(torch.bfloat16).float() if bf16 else logits
        # top-p thresholds in gaps of the biased rows' cumulative mass (summation order cannot matter)
        ps[4] = _safe_top_p(x[4] + bias, 0.8, 20, gen)
        ps[5] = _safe_top_p(x[5] + bias, 0.8, 0, gen)
        rows = (x, temps, ks, ps, seeds, positions)
        logits_in = (x.to(torch.bfloat16) if bf16 else x).to(DEV)
        got = sample_tokens(logits_in, *to_dev(rows[1:]), min_p=thr.to(DEV), penalties=dev)
        want = sample_tokens_ref(*rows, min_p=thr, penalties=penalties)
        assert torch.equal(got.cpu(), want), f"bf16={bf16}"
        unbiased = sample_tokens_ref(*rows, min_p=thr, penalties=off)
        changed = (want != unbiased).tolist()
        assert changed == [t != 1 for t in range(T)], changed  # the bias moved every flagged row
        assert not set(want.tolist()) & set(best.tolist()) - {int(best[1])}  # banned (row 1: unbiased)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [3001, 248320], ids=lambda v: f"V{v}")
def test_min_tokens_ban_matches_cpu_sampler(V):
    """min_tokens: a row sampling a position below its ban_until sets the stop tokens' logits to -inf before
    the bias and the penalties; at or above it they are sampled as usual. The stop tokens are every row's
    best, so banned rows must pick another, unbanned greedy rows pick theirs; the CPU sampler's tokens."""
    gen = torch.Generator().manual_seed(V + 1)
    T = 8
    logits = torch.randn(T, V, generator=gen) * 3
    best = logits.argmax(1)
    stop_mask = torch.zeros(V, dtype=torch.uint8)
    stop_mask[best] = 1
    positions = torch.tensor([10, 11, 19, 19, 20, 21, 20, 5])
    ban_until = torch.full((T,), 20)
    ban_until[7] = 0  # a row whose request has no ban left
    temps = torch.tensor([0.0, 0.8, 0.8, 0.0, 0.0, 0.8, 0.7, 0.0])
    ks = torch.tensor([0, 0, 20, 0, 0, 20, 0, 0], dtype=torch.int32)
    ps = torch.ones(T)
    pen = torch.tensor([[1.0, 0.0, 0.0, 1.0]] * T)  # the bias flag too: the ban comes first
    pen[3] = torch.tensor([1.3, 0.2, 0.5, 1.0])
    bias = torch.zeros(V)
    bias[best[:4]] = 5.0  # lifted stop tokens stay banned
    counts = torch.zeros(V, dtype=torch.int32)
    prompt = torch.zeros(V, dtype=torch.uint8)
    ban = dict(bias=bias, stop_mask=stop_mask, ban_until=ban_until)
    penalties = Penalties(pen, counts, prompt, **ban)
    dev = Penalties(*(x.to(DEV) for x in (pen, counts, prompt)), **{k: v.to(DEV) for k, v in ban.items()})
    rows = (logits, temps, ks, ps, torch.arange(T) + 7, positions)
    got = sample_tokens(logits.to(DEV), *to_dev(rows[1:]), penalties=dev)
    want = sample_tokens_ref(*rows, penalties=penalties)
    assert torch.equal(got.cpu(), want)
    banned = (positions < ban_until).tolist()
    assert banned == [True, True, True, True, False, False, False, False]
    assert all(not stop_mask[int(want[t])] for t in range(T) if banned[t])
    assert [int(want[t]) == int(best[t]) for t in (4, 7)] == [True, True]  # greedy, no ban: the best


@pytest.mark.gpu
@pytest.mark.parametrize("T,V", [(1, 1), (1, 31), (3, 33), (32, 1000), (7, 3072), (32, 248320), (2, 248_077)])
def test_apply_token_mask_matches_reference(T, V):
    """apply_token_mask (token_mask.cu) == its torch reference bitwise on fresh random logits and bits:
    the masked rows' refused tokens -inf and nothing else touched, rows with `on` unset unchanged; then a
    masked row samples only allowed tokens (greedy and seeded)."""
    from lumo.engine.grammar import unpack_bitmask
    from lumo.kernels.token_mask import apply_token_mask, apply_token_mask_ref

    gen = torch.Generator().manual_seed(T * 100_003 + V)
    W = -(-V // 32)
    logits = torch.randn(T, V, generator=gen).to(torch.bfloat16)
    bits = torch.randint(-(2**31), 2**31, (T, W), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[:, 0] |= 1  # every row allows some token (token 0 at least)
    on = (torch.arange(T) % 3 != 1).to(torch.int32)  # rows 1, 4, ... not masked
    want = apply_token_mask_ref(logits.clone(), bits, on)
    got = apply_token_mask(logits.to(DEV), bits.to(DEV), on.to(DEV)).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for t in range(T):
        refused = ~unpack_bitmask(bits[t], V) if on[t] else torch.zeros(V, dtype=torch.bool)
        assert torch.isneginf(got[t][refused]).all() and torch.equal(got[t][~refused], logits[t][~refused])
    # the sampler over masked rows: an allowed token in every masked row
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=4)):
        ws = sample_workspace(T, V, DEV)
        rows = got.to(DEV)
        temp = torch.full((T,), params.temperature, device=DEV)
        k, p = torch.zeros(T, dtype=torch.int32, device=DEV), torch.ones(T, device=DEV)
        seed, pos = torch.full((T,), params.seed, dtype=torch.int64, device=DEV), torch.arange(T, device=DEV)
        out = torch.zeros(T, dtype=torch.int32, device=DEV)
        tok = sample_tokens(rows, temp, k, p, seed, pos, out=out, workspace=ws).cpu()
        for t in range(T):
            if on[t]:
                assert unpack_bitmask(bits[t], V)[int(tok[t])], (t, int(tok[t]))
