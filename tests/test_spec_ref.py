"""The reference speculative event (CPU): exactness against plain decoding, bit for bit."""

from __future__ import annotations

import pytest
import torch

from lumo.config import TreeConfig
from lumo.engine.decode import PlainDecoder, SpecDecoder
from lumo.engine.sampling import SamplingParams, TokenHistory
from lumo.testing import make_tiny_checkpoint
from lumo.weights import load_model

TREE = TreeConfig(depth=4, topk=3, budget=8, rows=16)
PROMPT = [5, 17, 99, 3, 42, 7, 64, 21, 8]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=1, dtype="float32", num_hidden_layers=4)
    return load_model(d, progress=False)


def run(decoder, n_tokens: int) -> list[int]:
    out = decoder.prefill(PROMPT)
    while len(out) < n_tokens:
        out += decoder.step()
    return out[:n_tokens]


def assert_same_state(a, b):
    assert a.length == b.length
    L = a.length
    for x, y in zip(a.kv_k + a.kv_v, b.kv_k + b.kv_v, strict=True):
        assert torch.equal(x[:L], y[:L])
    for x, y in zip(a.gdn_state + a.conv_state, b.gdn_state + b.conv_state, strict=True):
        assert torch.equal(x, y)


class OracleSpec(SpecDecoder):
    """Drafts from a known continuation: the spine is right for `right` tokens then wrong; the sibling at
    the first wrong depth carries the right token when `sibling` is set. Exercises every acceptance case."""

    def __init__(self, *a, truth: list[int], right: int, sibling: bool, **kw):
        super().__init__(*a, **kw)
        self.truth, self.right, self.sibling, self.emitted = truth, right, sibling, 1

    def _draft(self) -> list[int]:
        t = self.tree
        nxt = self.truth[self.emitted :] + [0] * 64
        tokens = [0] * t.rows
        tokens[0] = self.pending
        for i in range(1, t.n_nodes):
            d, r = int(t.depth[i]), int(t.rank[i])
            good = nxt[d - 1]
            if r == 0:
                tokens[i] = good if d <= self.right else (good + 1) % 256
            else:  # siblings: right only at the first wrong spine depth
                tokens[i] = (
                    good if (self.sibling and d == self.right + 1 and r == 1) else (good + 2 + r) % 256
                )
        return tokens

    def step(self):
        out = super().step()
        self.emitted += len(out)
        return out


def decoders(tiny, params, max_len=96):
    cfg, w = tiny
    plain = PlainDecoder(cfg, w, params, max_len, "cpu", torch.float32)
    return cfg, w, plain


@pytest.mark.parametrize("tree", [TREE, TreeConfig(depth=3, topk=1, budget=3, rows=4)], ids=["tree", "chain"])
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_spec_equals_plain(tiny, tree, temperature):
    params = SamplingParams(temperature=temperature, top_k=50, top_p=0.95, seed=1234)
    cfg, w, plain = decoders(tiny, params)
    want = run(plain, 24)
    spec = SpecDecoder(cfg, w, params, 96, "cpu", torch.float32, tree)
    assert run(spec, 24) == want


@pytest.mark.parametrize("right, sibling", [(0, False), (2, False), (1, True), (4, False), (0, True)])
def test_every_acceptance_case_is_exact(tiny, right, sibling):
    params = SamplingParams(temperature=0.0)
    cfg, w, plain = decoders(tiny, params)
    truth = run(plain, 40)
    spec = OracleSpec(
        cfg, w, params, 96, "cpu", torch.float32, TREE, truth=truth, right=right, sibling=sibling
    )
    out = run(spec, 16)
    assert out == truth[:16]
    expected = min(right + (1 if sibling else 0), TREE.depth)
    assert spec.stats.accepted[:3] == [expected] * 3
    # the committed state equals plain decoding's at the same length, bitwise
    p2 = PlainDecoder(cfg, w, params, 96, "cpu", torch.float32)
    run(p2, spec.cache.length - len(PROMPT) + 1)
    assert_same_state(spec.cache, p2.cache)


PENALIZED = [
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, seed=7, min_p=0.02, presence_penalty=-1.0, repetition_penalty=0.8),
    SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias=((0, 4.0), (7, 4.0), (35, 4.0))),
]


@pytest.mark.parametrize("params", PENALIZED, ids=["greedy", "sampled", "greedy-biased"])
@pytest.mark.parametrize("right, sibling", [(4, False), (1, True)])
def test_penalties_are_exact_under_speculation(tiny, params, right, sibling):
    """A verify node's penalties see the drafted tokens on its path: with drafts from the true (penalised)
    continuation, accepted deep into the tree, tree decoding still equals plain decoding."""
    cfg, w, plain = decoders(tiny, params)
    truth = run(plain, 40)
    unpenalized = run(decoders(tiny, SamplingParams(temperature=params.temperature, seed=params.seed))[2], 40)
    assert truth != unpenalized  # the penalties change the output
    oracle = dict(truth=truth, right=right, sibling=sibling)
    spec = OracleSpec(cfg, w, params, 96, "cpu", torch.float32, TREE, **oracle)
    assert run(spec, 24) == truth[:24]
    assert spec.stats.accepted[0] == min(right + sibling, TREE.depth)
    assert int(spec.history.counts.sum()) == spec.cache.length - len(PROMPT) + 1  # every emitted token


def test_a_nodes_choice_counts_its_path(tiny):
    """SpecDecoder._choice: a node's penalties count the drafted tokens on its path below the root (and
    nothing else of the tree), on top of the committed history."""
    cfg, w = tiny
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    spec = SpecDecoder(cfg, w, params, 96, "cpu", torch.float32, TREE)
    spec.prefill(PROMPT)
    spec.history = TokenHistory(cfg.vocab_size, [5])  # committed: nothing generated, token 5 in the prompt
    spec.history.add([20])
    t = spec.tree
    node = next(i for i in range(t.n_nodes) if int(t.depth[i]) == 2 and int(t.rank[i]) > 0)  # a sibling
    logits = torch.zeros(cfg.vocab_size)
    tokens = [7] * t.rows
    tokens[1], tokens[2], tokens[node] = 11, 12, 13  # its path: spine node 1, then itself
    logits[[11, 12, 13]] = torch.tensor([3.0, 2.9, 2.8])
    logits[20] = 4.0  # generated before: 2.0 after the penalty
    # the sibling's path is 11 (spine node 1) and 13 (itself): 12 (spine node 2) wins with 2.9
    assert spec._choice(logits, 50, node, tokens) == 12
    assert spec._choice(logits, 50, 2, tokens) == 13  # spine node 2: 11 and 12 on its path, 13 not
    assert spec._choice(logits, 50, 0, tokens) == 11  # the root: only the committed history


EMBEDDED_PROMPTS = [
    "def fibonacci(n):",
    "import os\n\nclass Config:\n    def __init__(self",
    "for i in range(10):",
]


@pytest.mark.parametrize("spec", ["tree", "chain"])
def test_embedded_model_spec_equals_plain(spec):
    """On the embedded model (whose MTP head really predicts): greedy tree/chain == greedy plain."""
    from lumo.engine.llm import LLM, embedded_model_path

    if not (embedded_model_path() / "config.json").exists():
        pytest.skip("the embedded model is not in lumo/assets (run bench/train_tiny.py)")
    plain = LLM(device="cpu", spec="off")
    fast = LLM(device="cpu", spec=spec)
    accepted = []
    for prompt in EMBEDDED_PROMPTS:
        want = plain.generate(prompt, max_tokens=40, temperature=0).token_ids
        assert fast.generate(prompt, max_tokens=40, temperature=0).token_ids == want
        accepted += fast.last_decoder.stats.accepted
    # the trained MTP head drafts tokens the target accepts (random weights accept ~0)
    assert sum(accepted) / len(accepted) > 0.5


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0, presence_penalty=1.5, repetition_penalty=1.1),
        dict(temperature=0.8, seed=3, min_p=0.05, frequency_penalty=0.7),
        dict(temperature=0, logit_bias={446: -100, 650: 1.5, 2232: -5, 13: 2}),
        dict(temperature=0.7, top_k=20, seed=4, logit_bias={259: -100, 548: 3}, presence_penalty=0.5),
    ],
    ids=["greedy", "sampled", "greedy-biased", "sampled-biased"],
)
def test_embedded_model_penalized_tree_equals_plain(kw):
    from lumo.engine.llm import LLM, embedded_model_path

    if not (embedded_model_path() / "config.json").exists():
        pytest.skip("the embedded model is not in lumo/assets (run bench/train_tiny.py)")
    plain, fast = LLM(device="cpu", spec="off"), LLM(device="cpu", spec="tree")
    changed = "logit_bias" not in kw
    for prompt in EMBEDDED_PROMPTS[:2]:
        want = plain.generate(prompt, max_tokens=40, **kw).token_ids
        assert fast.generate(prompt, max_tokens=40, **kw).token_ids == want
        assert sum(fast.last_decoder.stats.accepted) > 0
        banned = [i for i, v in kw.get("logit_bias", {}).items() if v <= -100]
        assert not set(banned) & set(want)
        unbiased = {k: v for k, v in kw.items() if k != "logit_bias"}
        changed = changed or plain.generate(prompt, max_tokens=40, **unbiased).token_ids != want
    assert changed  # the bias changes the output


@pytest.mark.parametrize(
    "kw", [dict(temperature=0), dict(temperature=0.8, seed=3)], ids=["greedy", "sampled"]
)
def test_embedded_model_min_tokens_tree_equals_plain(kw):
    """min_tokens under speculation: the end token lifted so far that it would end the request early is
    banned below the request's 12th token, node by node of each tree by its position (the drafter proposes
    it anyway: it does not apply the ban); tree decoding still equals plain decoding."""
    from lumo.engine.llm import LLM, embedded_model_path

    if not (embedded_model_path() / "config.json").exists():
        pytest.skip("the embedded model is not in lumo/assets (run bench/train_tiny.py)")
    plain, fast = LLM(device="cpu", spec="off"), LLM(device="cpu", spec="tree")
    kw = {**kw, "max_tokens": 40, "logit_bias": {plain.tokenizer.eos_token_ids[0]: 20.0}}
    for prompt in EMBEDDED_PROMPTS[:2]:
        assert len(plain.generate(prompt, **kw).token_ids) < 6  # the end token early
        want = plain.generate(prompt, min_tokens=12, **kw)
        assert len(want.token_ids) == 12 if kw["temperature"] == 0 else len(want.token_ids) >= 12
        assert fast.generate(prompt, min_tokens=12, **kw).token_ids == want.token_ids
        assert fast.last_decoder.stats.events > 1


def test_auto_spec_is_tree_only_on_the_kernels(tmp_path):
    """spec="auto" (the default) picks tree speculation on the kernels backend when the checkpoint has an
    MTP head; on the CPU (torch backend) it decodes plainly, and a checkpoint without MTP never fails."""
    from lumo.engine.llm import LLM
    from lumo.testing import make_tiny_checkpoint

    assert LLM(make_tiny_checkpoint(tmp_path / "mtp", num_hidden_layers=2), device="cpu").spec == "off"
    bare = make_tiny_checkpoint(tmp_path / "bare", num_hidden_layers=2, mtp_num_hidden_layers=0)
    assert LLM(bare, device="cpu").spec == "off"
    with pytest.raises(ValueError, match="MTP head"):
        LLM(bare, device="cpu", spec="tree")


def test_gpu_tree_larger_than_the_verifier_fails_at_start():
    """The GPU verifier takes <= 32 rows: a bigger tree (or chain) is a one-line start-up error."""
    from lumo.engine.llm import _check_gpu_tree
    from lumo.engine.tree import chain_config

    _check_gpu_tree(TreeConfig())
    _check_gpu_tree(chain_config(31))
    with pytest.raises(ValueError, match="at most 32 rows"):
        _check_gpu_tree(TreeConfig(depth=11, topk=4, budget=40, rows=48))
    with pytest.raises(ValueError, match="at most 32 rows"):
        _check_gpu_tree(chain_config(40))
