"""Logprobs on the GPU kernels: tree / chain speculation (events, and adaptive plain steps between them)
give plain decoding's logprobs bitwise; the numbers are the fp32 CPU model's within bf16 error."""

from __future__ import annotations

import pytest
import torch

from lumo import model as M
from lumo.engine.llm import LLM
from lumo.testing import ScriptedAdaptive, embedded_or_skip
from lumo.weights import load_model

pytestmark = pytest.mark.gpu

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "with open(filename) as f:",
    "raise ValueError(",
]
SAMPLING = [dict(temperature=0), dict(temperature=0.8, top_p=0.95, top_k=40, seed=7)]


@pytest.mark.parametrize("variant", ["lumo-tiny", "lumo-tiny-nvfp4"])
def test_speculation_gives_plain_logprobs_bitwise(variant):
    path = str(embedded_or_skip(variant))
    plain = LLM(path, device="cuda", spec="off")
    tree = LLM(path, device="cuda")  # graphs, adaptive: the scripted policy below forces plain steps
    chain = LLM(path, device="cuda", spec="chain")
    assert tree.backend == "kernels" and tree.spec == "tree"
    tree._gpu.policy = ScriptedAdaptive([True, False, True, True, False, False])
    events = plain_steps = 0
    for prompt in PROMPTS:
        for kw in SAMPLING:
            want = plain.generate(prompt, max_tokens=48, logprobs=5, **kw)
            assert len(want.logprobs) == len(want.token_ids)
            for spec in (tree, chain):
                got = spec.generate(prompt, max_tokens=48, logprobs=5, **kw)
                assert got.token_ids == want.token_ids, prompt
                assert got.logprobs == want.logprobs, (prompt, kw)  # floats compared exactly
            stats = tree.last_decoder.stats
            events, plain_steps = events + stats.events, plain_steps + stats.plain_steps
    assert events and plain_steps


def test_gpu_logprobs_close_to_cpu_fp32():
    path = embedded_or_skip()
    gpu = LLM(path, device="cuda")
    cfg, w = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    worst = []
    for prompt in PROMPTS:
        r = gpu.generate(prompt, max_tokens=32, temperature=0, logprobs=0)
        ids = torch.tensor([r.prompt_token_ids + r.token_ids[:-1]])
        logits, _ = M.forward(cfg, w, ids)
        ref = torch.log_softmax(logits[0, len(r.prompt_token_ids) - 1 :].double(), dim=-1)
        diff = [abs(t.logprob - float(ref[i, t.token])) for i, t in enumerate(r.logprobs)]
        worst.append(max(diff))
        assert sorted(diff)[len(diff) // 2] < 0.05, prompt
    print(f"largest |GPU - CPU fp32| logprob per prompt: {[f'{x:.3f}' for x in worst]}")
    assert max(worst) < 0.3


def test_prompt_logprobs_on_the_kernels():
    """A 2500-token prompt (two prefill chunks, ten lm_head blocks) scored by plain and tree decoders alike
    (the same prefill rows), near the fp32 CPU model, and from position 0 although its prefix is cached."""
    path = embedded_or_skip()
    plain, tree = LLM(path, device="cuda", spec="off"), LLM(path, device="cuda")
    ids = torch.randint(0, 3000, (2500,), generator=torch.Generator().manual_seed(3)).tolist()
    tree.generate(ids[:2300], max_tokens=2)  # caches the first 2048 positions
    got = tree.generate(ids, max_tokens=2, temperature=0, prompt_logprobs=2)
    assert got.cached_tokens == 0 and got.prompt_logprobs[0] is None
    assert [t.token for t in got.prompt_logprobs[1:]] == ids[1:]
    want = plain.generate(ids, max_tokens=2, temperature=0, prompt_logprobs=2)
    assert got.prompt_logprobs == want.prompt_logprobs
    assert tree.generate(ids, max_tokens=2, temperature=0).cached_tokens == 2048  # the cache was rebuilt
    cfg, w = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    logits, _ = M.forward(cfg, w, torch.tensor([ids]))
    ref = torch.log_softmax(logits[0].double(), dim=-1)
    diff = torch.tensor(
        [abs(t.logprob - float(ref[i, t.token])) for i, t in enumerate(want.prompt_logprobs[1:])]
    )
    print(f"prompt logprobs |GPU - CPU fp32|: median {diff.median():.4f}, max {diff.max():.4f}")
    assert diff.median() < 0.05 and diff.max() < 0.5


# ------------------------------------------------------------------------------------------------
# The kernels (lumo/kernels/logprobs.py) against plain fp32 torch.


def _rows(t: int, v: int, dtype: torch.dtype, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # few distinct values: many equal logits, the top-k order decided by the index
        x = torch.randint(-4, 4, (t, v), generator=gen).float()
    else:
        x = torch.randn(t, v, generator=gen) * 4
        if kind == "masked":  # -inf entries (banned tokens); the middle entry stays finite
            x[torch.rand(t, v, generator=gen) < 0.3] = float("-inf")
            x[:, v // 2] = 1.0
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [3, 1000, 8193, 50001, 248320])
@pytest.mark.parametrize("kind", ["randn", "ties", "masked"])
def test_row_logprobs_against_fp32_torch(dtype, v, kind):
    from lumo.kernels.logprobs import row_logprobs, row_logprobs_ref

    gen = torch.Generator().manual_seed(v * 7 + len(kind))
    for t in (1, 5, 33):
        rows = _rows(t, v, dtype, kind, gen)
        tokens = torch.randint(0, v, (t,), generator=gen).cuda()
        if kind == "masked":  # score finite tokens (a -inf token's logprob is -inf either way)
            tokens = rows.float().argmax(dim=-1)
        for k in sorted({0, 1, 3, min(5, v), min(20, v)}):
            got, ref = row_logprobs(rows, tokens, k), row_logprobs_ref(rows, tokens, k)
            assert got.shape == (t, 1 + 2 * k)
            assert torch.equal(got[:, 1 + k :], ref[:, 1 + k :]), (t, k)  # the same ids in the same order
            g, r = got[:, : 1 + k], ref[:, : 1 + k]
            finite = r.isfinite()  # -inf for masked entries, on both sides
            assert torch.equal(g.isfinite(), finite) and torch.equal(g[~finite], r[~finite]), (t, k)
            err = (g[finite] - r[finite]).abs().max().item()
            assert err / (r[finite].abs().max().item() + 1.0) < 1e-5, (t, k, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_logprobs_batch_invariant(dtype):
    """A row's numbers alone equal its numbers among others, bitwise (speculative == plain logprobs)."""
    from lumo.kernels.logprobs import LogprobsWorkspace, row_logprobs

    gen = torch.Generator().manual_seed(3)
    V = 248320
    wide = _rows(29, V + 13, dtype, "randn", gen)
    rows = wide[:, :V].contiguous()
    tokens = torch.randint(0, V, (29,), generator=gen).cuda()
    ws = LogprobsWorkspace.new(32, V, "cuda")  # one workspace through every call: its counters reset
    for k in (0, 5, 20):
        together = row_logprobs(rows, tokens, k)
        assert torch.equal(row_logprobs(wide[:, :V], tokens, k, workspace=ws), together)  # strided rows
        for i in (0, 7, 28):
            alone = row_logprobs(rows[i : i + 1], tokens[i : i + 1], k, workspace=ws)
            assert torch.equal(alone[0], together[i]), (k, i)
        part = row_logprobs(rows[3:11], tokens[3:11], k, workspace=ws)
        assert torch.equal(part, together[3:11])
        assert torch.equal(row_logprobs(rows, tokens, k, workspace=ws), together)
    assert not ws.counter.any()


def test_row_logprobs_rejects_bad_arguments():
    from lumo.kernels.logprobs import row_logprobs

    rows = torch.zeros(2, 10, device="cuda")
    tok = torch.zeros(2, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="k must be"):
        row_logprobs(rows, tok, 11)
    with pytest.raises(ValueError, match="tokens must be"):
        row_logprobs(rows, tok.int(), 1)
    with pytest.raises(ValueError, match="unit stride"):
        row_logprobs(rows.t(), tok[:1].repeat(10), 1)
