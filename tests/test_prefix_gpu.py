"""GPU: prefix caching (lumo/engine/prefix.py) on the kernels. A prompt that resumes from a snapshot of an
earlier prefill computes bitwise what it computes from position 0: the first token's logits, every GDN /
conv state, the K/V (and the MTP head's K/V and draft logits under tree speculation), then every token of
plain, tree and seeded decoding. Embedded models, BF16 and NVFP4."""

from __future__ import annotations

import functools

import pytest
import torch

from lumo.config import TreeConfig
from lumo.engine.gpu_decode import GPUBackend, GPUDecoder
from lumo.engine.gpu_spec import SpecBackend
from lumo.engine.gpu_weights import pack_weights
from lumo.engine.llm import LLM
from lumo.engine.sampling import SamplingParams
from lumo.testing import embedded_or_skip
from lumo.weights import load_model

pytestmark = pytest.mark.gpu
DEV = "cuda"
VARIANTS = ["lumo-tiny", "lumo-tiny-nvfp4"]
CHUNK = 64  # a small prefill grid: several snapshots per prompt
PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3)]


@functools.cache
def packed(variant: str):
    cfg, w = load_model(embedded_or_skip(variant), device="cpu", dtype=torch.bfloat16, progress=False)
    return cfg, pack_weights(cfg, w, DEV, mtp=True)


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def backend(variant: str, snapshots: int, spec: bool, park: int = 0, lines: int = 2):
    cfg, gw = packed(variant)
    parking = {"prefix_snapshots": snapshots, "prefix_park": park, "prefix_lines": lines}
    be = GPUBackend(cfg, gw, 1024, DEV, prefill_chunk=CHUNK, **parking)
    return SpecBackend(be, TreeConfig(), use_graph=True) if spec else be


def snapshot_of(dec, n: int) -> list[torch.Tensor]:
    """What must be equal after a prefill of n tokens: the sampled token, the first token's logits (plain)
    or the first draft step's logits (tree), the states, the K/V of the prompt (and the MTP's)."""
    e = getattr(dec, "engine", None)
    r = dec.runner if e is None else e.runner
    out = [r.tok.clone(), *r.gdn_state, *r.conv_state, *(t[:n] for t in r.kv_k + r.kv_v)]
    if e is None:
        return [*out, r.logits.clone()]
    return [*out, e.draft_logits.clone(), *(t[:n] for t in e.mtp_k + e.mtp_v)]


def decode(dec, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    out = dec.prefill(prompt)
    snap = [t.clone() for t in snapshot_of(dec, len(prompt))]
    while len(out) < n:
        out += dec.step()
    return out[:n], snap


def resumes_as_cold(warm, cold, params: SamplingParams, prompt: list[int], resume_at: int) -> None:
    """The prompt on a backend with prefix caching resumes at resume_at and computes what it computes on
    one without: the state after the prefill (snapshot_of) and 48 tokens."""
    w, c = warm.decoder(params, 600), cold.decoder(params, 600)
    got, got_state = decode(w, prompt, 48)
    want, want_state = decode(c, prompt, 48)
    assert (w.cached_tokens, c.cached_tokens) == (resume_at, 0)
    for i, (a, b) in enumerate(zip(got_state, want_state, strict=True)):
        assert torch.equal(a, b), f"tensor {i} of the state after the prefill"
    assert got == want


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "tree"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_resumed_prompt_equals_cold_bitwise(variant, spec, params):
    cfg, _ = packed(variant)
    warm, cold = backend(variant, 4, spec), backend(variant, 0, spec)
    first = rand_ids(300, cfg.vocab_size, 1)
    follow_ups = [  # (prompt, where it resumes): turn 1 left snapshots at 64, 128, 192, 256
        (first[:150] + rand_ids(90, cfg.vocab_size, 3), 128),  # parts mid-chunk; now 64, 128, 192
        (first[:128], 64),  # ends on the grid (one token must be left to prefill); now 64, 128
        (first + rand_ids(40, cfg.vocab_size, 2), 128),  # turn 1 again, longer: 192 and 256 were rewritten
    ]
    decode(warm.decoder(params, 600), first, 24)  # turn 1, decoded past its prompt
    for prompt, resume_at in follow_ups:
        resumes_as_cold(warm, cold, params, prompt, resume_at)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "tree"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("park,resume_at", [(512, 256), (150, 128)], ids=["park512", "park150"])
def test_a_side_request_leaves_the_conversation_parked(variant, spec, params, park, resume_at):
    """A conversation, an unrelated request that overwrites its positions, the conversation's next turn:
    the conversation was parked (its K/V, and the drafter's, copied aside and back) and the turn resumes
    from its snapshot at 256, bitwise a cold start; the side request's own prefix is parked in turn. With
    150 positions copied aside the side request decodes past them: the turn resumes at 128 instead."""
    cfg, _ = packed(variant)
    warm, cold = backend(variant, 4, spec, park=park), backend(variant, 0, spec)
    first, side = rand_ids(300, cfg.vocab_size, 1), rand_ids(140, cfg.vocab_size, 8)
    decode(warm.decoder(params, 600), first, 24)
    decode(warm.decoder(params, 600), side, 24)
    for prompt, at in ((first + rand_ids(40, cfg.vocab_size, 2), resume_at), (side + [5], 128)):
        resumes_as_cold(warm, cold, params, prompt, at)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "tree"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_conversation_and_a_sub_agent_both_stay_parked(variant, spec):
    """Two lines parked (a coding agent's conversation and its sub-agent's, each followed by a side
    request): both next turns resume from their own snapshots, bitwise cold starts, after swaps that
    copy each one's positions, the target's K/V and the drafter's, out and back."""
    cfg, _ = packed(variant)
    params = PARAMS[1]
    warm, cold = backend(variant, 4, spec, park=512, lines=2), backend(variant, 0, spec)
    main, sub = rand_ids(300, cfg.vocab_size, 1), rand_ids(270, cfg.vocab_size, 11)
    for i, prompt in enumerate((main, sub)):
        decode(warm.decoder(params, 600), prompt, 24)
        decode(warm.decoder(params, 600), rand_ids(100, cfg.vocab_size, 20 + i), 24)  # a side request
    for prompt in (sub + rand_ids(30, cfg.vocab_size, 2), main + rand_ids(40, cfg.vocab_size, 3)):
        resumes_as_cold(warm, cold, params, prompt, 256)
    assert (warm.backend if spec else warm).runner.prefix.swaps == 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_llm_turns_reuse_the_2048_token_grid(variant):
    """The LLM's defaults on the kernels (tree speculation, 2048-token prefill chunks, 4 snapshots): a
    conversation's third turn resumes from the snapshot at 2048 and emits a cold engine's tokens."""
    path = embedded_or_skip(variant)
    on, off = LLM(path, device="cuda"), LLM(path, device="cuda", prefix_snapshots=0)
    vocab = on.config.vocab_size
    turn = rand_ids(1900, vocab, 5)
    for i, cached in enumerate([0, 0, 2048]):  # turn 1 (1900 tokens) ends before the grid's 2048
        r = on.generate(turn, max_tokens=64, temperature=0.7, seed=i)
        ref = off.generate(turn, max_tokens=64, temperature=0.7, seed=i)
        assert r.token_ids == ref.token_ids and ref.cached_tokens == 0
        assert r.cached_tokens == cached
        turn = turn + r.token_ids + rand_ids(150, vocab, 6 + i)
    assert len(on._gpu.backend.runner.prefix.snapshots) >= 1


def test_decoder_without_prefix_cache_is_unchanged():
    """prefix_snapshots=0: no PrefixCache on the runner, prefill from position 0 every time."""
    be = backend("lumo-tiny", 0, spec=False)
    dec = be.decoder(PARAMS[0], 600)
    assert isinstance(dec, GPUDecoder) and dec.runner.prefix is None
    dec.prefill(rand_ids(200, packed("lumo-tiny")[0].vocab_size, 9))
    assert dec.cached_tokens == 0
