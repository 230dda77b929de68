"""GPU: tree speculative decoding on the kernels (lumo/engine/gpu_spec.py) against plain decoding on the same
kernels (GPUDecoder / GPURunner). The kernels are batch invariant, so the comparisons are bitwise: tokens
(greedy and seeded sampling), the logits of every accepted node, and the committed GDN / conv / KV state.
Also a chi-square test of the emitted tokens' distribution, chain mode, and graph replay == eager."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from lumo.config import TreeConfig
from lumo.corpus import split_documents, stdlib_documents
from lumo.engine.draft_vocab import draft_vocab_ids
from lumo.engine.gpu_decode import GPUDecoder
from lumo.engine.gpu_spec import GPUSpecDecoder, GPUSpecEngine
from lumo.engine.gpu_weights import config_27b, pack_weights, random_model_weights
from lumo.engine.llm import embedded_model_path
from lumo.engine.runner import GPURunner
from lumo.engine.sampling import SamplingParams
from lumo.engine.tree import chain_config
from lumo.testing import ScriptedAdaptive
from lumo.tokenizer import Tokenizer
from lumo.weights import load_model

pytestmark = pytest.mark.gpu
DEV = "cuda"
VARIANTS = ["lumo-tiny", "lumo-tiny-nvfp4"]
CAPACITY = 1024  # prompt (<= 300) + 256 tokens + tree slots
GREEDY = SamplingParams(temperature=0.0)


DRAFTER_NVFP4 = "+nvfp4-drafter"  # a variant suffix: the drafter in NVFP4 (gpu_weights.draft_quant)


@functools.cache
def packed(variant: str):
    """(cfg, GPU weights with the MTP head, model dir)."""
    name = variant.removesuffix(DRAFTER_NVFP4)
    path = embedded_model_path().parent / name
    if not (path / "config.json").exists():
        pytest.skip(f"{name} is not in lumo/assets")
    cfg, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    return cfg, pack_weights(cfg, w, DEV, mtp=True, draft_nvfp4=variant.endswith(DRAFTER_NVFP4)), path


@functools.cache
def prompts(variant: str, n: int = 50) -> tuple[tuple[int, ...], ...]:
    """n prompts of 16..295 tokens, drawn deterministically from the held-out stdlib files (the model never
    trained on them); synthesized code snippets if the held-out set runs short."""
    tok = Tokenizer.from_dir(embedded_model_path().parent / variant.removesuffix(DRAFTER_NVFP4))
    out: list[tuple[int, ...]] = []
    for doc in split_documents(stdlib_documents())[2]:
        ids = tok.encode(doc.text)
        for start in (0, len(ids) // 2):
            length = 16 + (37 * len(out)) % 280
            if start + length <= len(ids) and len(out) < n:
                out.append(tuple(ids[start : start + length]))
    i = 0
    while len(out) < n:
        text = f"def f{i}(items, n={i}):\n    total = 0\n    for x in items[:n]:\n        total += x * {i}\n"
        out.append(tuple(tok.encode(text)))
        i += 1
    return tuple(out)


@functools.cache
def runners(variant: str) -> tuple[GPURunner, GPURunner]:
    cfg, gw, _ = packed(variant)
    return GPURunner(cfg, gw, CAPACITY), GPURunner(cfg, gw, CAPACITY)


@functools.cache
def engine(variant: str, tree: TreeConfig, which: int = 1) -> GPUSpecEngine:
    return GPUSpecEngine(runners(variant)[which], tree)


def plain_tokens(variant: str, prompt, n: int, params: SamplingParams = GREEDY, logits: dict | None = None):
    """n tokens of GPUDecoder (eager: bitwise the graph, tests/test_runner_gpu.py). logits (optional)
    receives {position of the forwarded token: f32 logits}, the prefill's last row at len(prompt) - 1."""
    r = runners(variant)[0]
    dec = GPUDecoder(r, params, use_graph=False)
    out = dec.prefill(list(prompt))
    if logits is not None:
        logits[len(prompt) - 1] = r.logits[0].clone()
    while len(out) < n:
        pos = r.length
        out += dec.step()
        if logits is not None:
            logits[pos] = r.logits[0].clone()
    return out[:n]


def spec_tokens(dec: GPUSpecDecoder, prompt, n: int, check=None) -> list[int]:
    out = dec.prefill(list(prompt))
    while len(out) < n:
        L = dec.engine.runner.length
        out += dec.step()
        if check is not None:
            check(L)
    return out[:n]


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), -1)


@pytest.mark.parametrize("variant", VARIANTS + ["lumo-tiny" + DRAFTER_NVFP4])
def test_greedy_tree_equals_plain(variant):
    if variant.endswith(DRAFTER_NVFP4):  # the drafter's head and MTP linears are NVFP4 copies
        mtp = packed(variant)[1].mtp
        assert all(p.packed is not None for lin in (mtp.draft_head, mtp.fc) for p in lin.parts)
    dec = GPUSpecDecoder(engine(variant, TreeConfig()), GREEDY)
    accepted = []
    for i, p in enumerate(prompts(variant)):
        want = plain_tokens(variant, p, 256)
        got = spec_tokens(dec, p, 256)
        assert got == want, f"prompt {i} ({len(p)} tokens): first difference at token {first_diff(got, want)}"
        accepted += dec.stats.accepted
    mean = sum(accepted) / len(accepted)
    print(f"{variant}: {len(accepted)} events, {mean:.2f} accepted drafts per event")
    assert mean > 0.3, "the MTP drafts are almost never accepted: the draft path is broken"


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_tree_with_a_draft_vocabulary_equals_plain(variant):
    """A draft vocabulary (the drafter's lm_head over 1024 of the 3072 tokens): still plain decoding's
    tokens, bitwise; every drafted candidate is a vocabulary token."""
    cfg, _, path = packed(variant)
    _, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    ids = draft_vocab_ids(1024, cfg.vocab_size, Tokenizer.from_dir(path).added_token_ids())
    gw = pack_weights(cfg, w, DEV, mtp=True, draft_ids=ids)
    assert gw.mtp.draft_head.n == 1024
    dec = GPUSpecDecoder(GPUSpecEngine(GPURunner(cfg, gw, CAPACITY), TreeConfig()), GREEDY, use_graph=True)
    allowed, accepted = set(ids), []

    def check(_):
        assert set(dec.engine.cand.flatten().tolist()) <= allowed

    for i, p in enumerate(prompts(variant, 12)):
        want = plain_tokens(variant, p, 128)
        got = spec_tokens(dec, p, 128, check)
        assert got == want, f"prompt {i} ({len(p)} tokens): first difference at token {first_diff(got, want)}"
        accepted += dec.stats.accepted
    mean = sum(accepted) / len(accepted)
    print(f"{variant}, draft vocabulary 1024: {len(accepted)} events, {mean:.2f} accepted drafts per event")
    assert mean > 0.3


@pytest.mark.parametrize("variant", VARIANTS)
def test_accepted_logits_and_committed_state_bitwise(variant):
    e = engine(variant, TreeConfig())
    dec = GPUSpecDecoder(e, GREEDY)
    rp, rs = runners(variant)
    for i, p in enumerate(prompts(variant)[:8]):
        spec_logits: dict[int, torch.Tensor] = {}

        def record(L: int, spec_logits: dict = spec_logits) -> None:
            acc = e.accepted.tolist()
            n = int(e.result[0])
            for j, node in enumerate(acc[:n]):
                spec_logits[L + j] = e.logits[node].clone()

        got = spec_tokens(dec, p, 160, check=record)
        committed = rs.length
        plain_logits: dict[int, torch.Tensor] = {}
        want = plain_tokens(variant, p, committed - len(p) + 1, logits=plain_logits)
        assert got[: len(want)] == want[: len(got)], f"prompt {i}: tokens differ"
        assert rp.length == committed
        for pos, lg in spec_logits.items():
            assert torch.equal(lg, plain_logits[pos]), f"prompt {i}: logits at position {pos} differ"
        for a, b in zip(rs.gdn_state + rs.conv_state, rp.gdn_state + rp.conv_state, strict=True):
            assert torch.equal(a, b), f"prompt {i}: GDN / conv state differs after {committed} positions"
        for a, b in zip(rs.kv_k + rs.kv_v, rp.kv_k + rp.kv_v, strict=True):
            assert torch.equal(a[:committed], b[:committed]), f"prompt {i}: K/V differ"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=12345),
    ],
    ids=["t1", "t0.8-k40-p0.95"],
)
def test_seeded_sampling_tree_equals_plain(variant, params):
    dec = GPUSpecDecoder(engine(variant, TreeConfig()), params)
    for i, p in enumerate(prompts(variant)[:20]):
        want = plain_tokens(variant, p, 128, params)
        got = spec_tokens(dec, p, 128)
        assert got == want, f"prompt {i}: first difference at token {first_diff(got, want)}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_chain_equals_plain(variant):
    dec = GPUSpecDecoder(engine(variant, chain_config(TreeConfig().depth)), GREEDY)
    for i, p in enumerate(prompts(variant)[:12]):
        want = plain_tokens(variant, p, 192)
        got = spec_tokens(dec, p, 192)
        assert got == want, f"prompt {i}: first difference at token {first_diff(got, want)}"
        assert all(0 <= a <= TreeConfig().depth for a in dec.stats.accepted)


@pytest.mark.parametrize("variant", VARIANTS)
def test_graph_replay_equals_eager(variant):
    cfg, gw, _ = packed(variant)
    tree = TreeConfig()
    eager = GPUSpecDecoder(engine(variant, tree), GREEDY)
    graphed_engine = GPUSpecEngine(GPURunner(cfg, gw, CAPACITY), tree)
    graphed = GPUSpecDecoder(graphed_engine, GREEDY, use_graph=True)
    for i, p in enumerate(prompts(variant)[:10]):
        got_e = spec_tokens(eager, p, 128)
        got_g = spec_tokens(graphed, p, 128)
        assert graphed_engine.graphs is not None
        assert got_g == got_e, f"prompt {i}: first difference at token {first_diff(got_g, got_e)}"
        assert eager.stats.accepted == graphed.stats.accepted
        assert torch.equal(eager.engine.logits, graphed_engine.logits)
        r1, r2 = eager.engine.runner, graphed_engine.runner
        for a, b in zip(r1.gdn_state + r1.conv_state, r2.gdn_state + r2.conv_state, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "dense_head,draft_nvfp4",
    [(False, False), (True, False), (True, True)],
    ids=["nvfp4", "bf16-head", "nvfp4-drafter"],
)
def test_27b_shaped_tree_equals_plain(dense_head, draft_nvfp4):
    """The 27B kernel specializations (nv=48, dk=dv=128, d=256, G=6, H=5120) through whole events: random
    NVFP4 weights with a random MTP head, 4 layers, a small vocabulary; tokens and state bitwise. With the
    lm_head and MTP head in BF16 as ModelOpt ships them (large enough for bf16_gemv, not the one-warp kernel:
    the plain step's and the verify's lm_head, the drafter), and with the drafter's NVFP4 copies of them."""
    check_27b_shaped(dense_head, draft_nvfp4, 77)


def test_27b_shaped_tree_equals_plain_after_a_long_prompt():
    """The same after 4099 prompt tokens: 32 chunks below the length, so the verify's attention runs
    attn_tree_chunk's walking CTAs (shared-memory K / V, ldmatrix P.V; from 17 chunks at this shape on an
    H200) through whole events, against plain decoding's attn_decode_chunk_pipe."""
    check_27b_shaped(False, False, 4099)


def check_27b_shaped(dense_head: bool, draft_nvfp4: bool, prompt_len: int) -> None:
    cfg = config_27b(4, vocab_size=4096)
    w = random_model_weights(cfg, DEV, nvfp4=True, seed=3, mtp=True, dense_head=dense_head)
    gw = pack_weights(cfg, w, DEV, mtp=True, draft_nvfp4=draft_nvfp4)
    del w
    rp, rs = GPURunner(cfg, gw, prompt_len + 179), GPURunner(cfg, gw, prompt_len + 179)
    prompt = torch.randint(0, 4096, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    dec = GPUSpecDecoder(rs, GREEDY, TreeConfig())
    got = dec.prefill(prompt)
    while len(got) < 24:
        got += dec.step()
    plain = GPUDecoder(rp, GREEDY, use_graph=False)
    want = plain.prefill(prompt)
    while rp.length < rs.length:
        want += plain.step()
    assert got[: len(want)] == want
    for a, b in zip(rs.gdn_state + rs.conv_state, rp.gdn_state + rp.conv_state, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(rs.kv_k + rs.kv_v, rp.kv_k + rp.kv_v, strict=True):
        assert torch.equal(a[: rs.length], b[: rs.length])


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_first_two_tokens_follow_the_target_distribution():
    """Over many seeds, the pair (first token, first token emitted by a tree event) is distributed as
    p(t1) p(t2 | t1) of the target (temperature 1): lossless sampling. Cells with expected count < 8 are
    pooled; a prompt with a peaked but not deterministic first token keeps the table small."""
    variant = VARIANTS[0]
    rp = runners(variant)[0]
    # The prompt: the first whose first-token distribution has top probability in [0.4, 0.9].
    prompt = None
    for p in prompts(variant):
        rp.reset()
        top = torch.softmax(rp.prefill(list(p)), -1).max().item()
        if 0.4 <= top <= 0.9:
            prompt = list(p)
            break
    assert prompt is not None, "no prompt with a peaked first-token distribution"
    n = len(prompt)
    rp.reset()
    p1 = torch.softmax(rp.prefill(prompt).double(), -1).cpu()  # [V]
    t1s = [t for t in torch.argsort(p1, descending=True).tolist()[:6] if p1[t] > 0.01]
    expected: dict[tuple[int, int], float] = {}
    for t1 in t1s:
        rp.reset()
        rp.prefill(prompt)
        rp.seek(n, t1)
        rp.decode_step(use_graph=False)
        p2 = torch.softmax(rp.logits[0].double(), -1).cpu()
        for t2 in torch.argsort(p2, descending=True).tolist()[:20]:
            expected[(t1, t2)] = float(p1[t1] * p2[t2])
    N = 4000
    dec = GPUSpecDecoder(engine(variant, TreeConfig()), GREEDY)
    counts: dict[tuple[int, int], int] = {}
    for seed in range(N):
        dec.params = SamplingParams(temperature=1.0, seed=seed)
        t1 = dec.prefill(prompt)[0]
        t2 = dec.step()[0]
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    cells = [c for c, p in expected.items() if p * N >= 8]
    assert len(cells) >= 3, "the distribution is too peaked for a meaningful test"
    obs = [counts.get(c, 0) for c in cells]
    exp = [expected[c] * N for c in cells]
    if N - sum(exp) >= 1:  # everything else, pooled (dropped when it carries almost no mass)
        obs.append(N - sum(obs))
        exp.append(N - sum(exp))
    stat = sum((o - x) ** 2 / x for o, x in zip(obs, exp, strict=True))
    df = len(obs) - 1
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} over {df} dof (critical {chi2_critical(df):.1f})"


@pytest.mark.parametrize(
    "params", [GREEDY, SamplingParams(temperature=0.8, top_k=50, seed=11)], ids=["greedy", "seeded"]
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_plain_steps_between_events_equal_plain(variant, params):
    """Adaptive speculation's plain steps (GPUSpecEngine.plain_step, its own CUDA graph) mixed with events:
    plain decoding's tokens, and the MTP's K/V (fed a row per plain step) bitwise those of tree decoding
    without plain steps over their common committed positions."""
    cfg, gw, _ = packed(variant)
    eng = GPUSpecEngine(GPURunner(cfg, gw, CAPACITY), TreeConfig())
    pattern = [True, False, False, True, True, False, True, False, False, False]
    mixed = GPUSpecDecoder(eng, params, use_graph=True, adaptive=ScriptedAdaptive(pattern))
    only = GPUSpecDecoder(engine(variant, TreeConfig()), params)
    accepted = []
    for i, p in enumerate(prompts(variant)[:12]):
        want = plain_tokens(variant, p, 192, params)
        got = spec_tokens(mixed, p, 192)
        assert eng.graphs is not None and "plain" in eng.graphs
        assert got == want, f"prompt {i}: first difference at token {first_diff(got, want)}"
        assert mixed.stats.plain_steps > 0
        accepted += mixed.stats.accepted
        spec_tokens(only, p, 192)
        n = min(eng.runner.length, only.engine.runner.length) - 1
        for a, b in zip(eng.mtp_k + eng.mtp_v, only.engine.mtp_k + only.engine.mtp_v, strict=True):
            assert torch.equal(a[:n], b[:n]), f"prompt {i}: the MTP's K/V differ"
    if params.greedy:
        assert sum(accepted) / len(accepted) > 0.3, "drafts after plain steps are rarely accepted"


# A logit bias on the embedded model's frequent tokens of these prompts ('0' banned, '\n' lowered, ' the'
# lifted): it changes 7 of the 12 greedy outputs on the CPU model.
BIAS = ((15, -100.0), (198, -3.0), (339, 5.0))
PENALIZED = [
    SamplingParams(temperature=0.0, presence_penalty=1.5, repetition_penalty=1.1),
    SamplingParams(temperature=0.8, seed=21, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.5),
    SamplingParams(temperature=0.0, logit_bias=BIAS),
    SamplingParams(temperature=0.7, top_k=20, seed=8, presence_penalty=1.0, logit_bias=BIAS),
]


@pytest.mark.parametrize("params", PENALIZED, ids=["greedy", "seeded", "greedy-biased", "seeded-biased"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_penalized_tree_equals_plain(variant, params):
    """Penalties and min-p (Qwen's recommended presence_penalty 1.5), a logit bias: events (whose verify rows
    add their path's drafted tokens to the committed histogram, the drafter proposing under the same bias
    and penalties) and adaptive plain steps, from CUDA graphs, give plain decoding's tokens; the histogram
    counts every emitted token once."""
    cfg, gw, _ = packed(variant)
    eng = GPUSpecEngine(GPURunner(cfg, gw, CAPACITY), TreeConfig())
    pattern = [True, True, True, False, True, True, False, True, True, True]
    dec = GPUSpecDecoder(eng, params, use_graph=True, adaptive=ScriptedAdaptive(pattern))
    plain = dataclasses.replace(
        params, presence_penalty=0.0, repetition_penalty=1.0, frequency_penalty=0.0, logit_bias=()
    )
    accepted, changed = [], 0
    for i, p in enumerate(prompts(variant)[:12]):
        want = plain_tokens(variant, p, 160, params)
        changed += want != plain_tokens(variant, p, 160, plain)
        got = spec_tokens(dec, p, 160)
        assert eng.graphs is not None
        assert got == want, f"prompt {i}: first difference at token {first_diff(got, want)}"
        accepted += dec.stats.accepted
        emitted = eng.runner.length - len(p) + 1
        assert int(eng.runner.counts.sum()) == emitted
    assert changed >= (5 if params.logit_bias else 6), "the penalties / the bias should change most outputs"
    banned = {i for i, v in params.logit_bias if v <= -100}
    assert not banned & set(eng.cand.flatten().tolist())  # the drafter proposes under the bias
    if params.greedy:
        assert sum(accepted) / len(accepted) > 0.3, "penalised drafts are rarely accepted"


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=6)],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_min_tokens_tree_equals_plain(variant, params):
    """min_tokens: the end token lifted to the top (+50) is banned below each prompt's 20th new token;
    verify rows on either side of that position, from CUDA graphs with adaptive plain steps mixed in, give
    plain decoding's tokens: none of the stop tokens before the 20th, the lifted one at it (greedy)."""
    cfg, gw, _ = packed(variant)
    eos = (3065, 3067)
    eng = GPUSpecEngine(GPURunner(cfg, gw, CAPACITY), TreeConfig())
    pattern = [True, True, False, True]
    for i, p in enumerate(prompts(variant)[:8]):
        ban = dataclasses.replace(params, logit_bias=((3067, 50.0),), stop_ids=eos, ban_until=len(p) + 20)
        dec = GPUSpecDecoder(eng, ban, use_graph=True, adaptive=ScriptedAdaptive(pattern))
        want = plain_tokens(variant, p, 32, ban)
        got = spec_tokens(dec, p, 32)
        assert got[: len(want)] == want[: len(got)], (
            f"prompt {i}: first difference at {first_diff(got, want)}"
        )
        assert not set(want[:20]) & set(eos) and (want[20] == 3067 or not params.greedy)


def _constrained(dec, constraint, prompt, n: int, eos) -> list[int]:
    dec.constraint = constraint
    out = dec.prefill(list(prompt))
    while len(out) < n and not set(out) & eos:
        out += dec.step()
    return out


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40, seed=6)],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_structured_output_tree_equals_plain(variant, params):
    """A JSON schema (lumo.engine.grammar): the verify rows masked by apply_token_mask with the host's
    per-path masks between the draft and verify graphs, adaptive plain steps masked through the runner,
    on CUDA graphs, give plain decoding's tokens (eager GPUDecoder under the same grammar). The draft
    under the grammar from its graphs (GPUSpecEngine.grammar_graphs) proposes what its eager pieces do:
    the same accepted drafts per event."""
    from lumo.engine.grammar import GrammarCompiler, StructuredOutputs

    cfg, gw, path = packed(variant)
    tok = Tokenizer.from_dir(path)
    compiler = GrammarCompiler(tok.to_json(), cfg.vocab_size, tok.eos_token_ids)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "lines": {"type": "integer"}},
        "required": ["name", "lines"],
    }
    so = StructuredOutputs(json=schema)
    eos = set(tok.eos_token_ids)
    eng = GPUSpecEngine(GPURunner(cfg, gw, CAPACITY), TreeConfig())
    eager_eng = GPUSpecEngine(GPURunner(cfg, gw, CAPACITY), TreeConfig())
    masked_rows = 0
    for i, p in enumerate(prompts(variant)[:10]):
        plain = GPUDecoder(runners(variant)[0], params, use_graph=False)
        spec = GPUSpecDecoder(eng, params, use_graph=True, adaptive=ScriptedAdaptive([True, True, False]))
        eager = GPUSpecDecoder(eager_eng, params, adaptive=ScriptedAdaptive([True, True, False]))
        want = _constrained(plain, compiler.constraint(so), p, 64, eos)
        got = _constrained(spec, compiler.constraint(so), p, len(want), eos)
        assert eng.grammar_graphs is not None
        masked_rows += int(eng.token_masks_on.sum())
        assert got[: len(want)] == want, f"prompt {i}: first difference at {first_diff(got, want)}"
        assert _constrained(eager, compiler.constraint(so), p, len(want), eos) == got
        assert eager.stats.accepted == spec.stats.accepted, "the graphed draft proposed other tokens"
        text = tok.decode([t for t in want if t not in eos])
        assert text.lstrip().startswith("{"), text  # up to two blanks may come first
    assert masked_rows > 10
    # the next request without a grammar, on the same engine and graphs: no mask left behind
    p = prompts(variant)[11]
    spec = GPUSpecDecoder(eng, params, use_graph=True, adaptive=ScriptedAdaptive([True, True, False]))
    got = spec_tokens(spec, p, 48)
    assert got == plain_tokens(variant, p, 48, params)[:48] and not eng.token_masks_on.any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_structured_output_with_a_draft_vocabulary_equals_plain(variant):
    """A JSON schema with a draft vocabulary (whose columns are not token ids): the drafter unconstrained
    from the draft graph, the verify rows masked between the grammar's verify graphs; plain's tokens."""
    from lumo.engine.grammar import GrammarCompiler, StructuredOutputs

    cfg, _, path = packed(variant)
    _, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    tok = Tokenizer.from_dir(path)
    ids = draft_vocab_ids(1024, cfg.vocab_size, tok.added_token_ids())
    gw = pack_weights(cfg, w, DEV, mtp=True, draft_ids=ids)
    compiler = GrammarCompiler(tok.to_json(), cfg.vocab_size, tok.eos_token_ids)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    so = StructuredOutputs(json=schema)
    eos = set(tok.eos_token_ids)
    eng = GPUSpecEngine(GPURunner(cfg, gw, CAPACITY), TreeConfig())
    masked_rows = 0
    for i, p in enumerate(prompts(variant)[:5]):
        plain = GPUDecoder(runners(variant)[0], GREEDY, use_graph=False)
        spec = GPUSpecDecoder(eng, GREEDY, use_graph=True, adaptive=ScriptedAdaptive([True, True, False]))
        want = _constrained(plain, compiler.constraint(so), p, 48, eos)
        got = _constrained(spec, compiler.constraint(so), p, len(want), eos)
        assert eng.grammar_graphs is not None and "select0" not in eng.grammar_graphs
        assert got[: len(want)] == want, f"prompt {i}: first difference at {first_diff(got, want)}"
        masked_rows += int(eng.token_masks_on.sum())
    assert masked_rows > 0
