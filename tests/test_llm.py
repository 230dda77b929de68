"""The Python API on the CPU: argument checking and the greedy limit of small temperatures."""

from __future__ import annotations

import pytest
import torch

from lumo.engine.llm import LLM
from lumo.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_hidden_layers=4)
    return LLM(ckpt, device="cpu", spec="off", max_model_len=64)


def test_tiny_temperatures_are_greedy(llm):
    # logits / 1e-40 overflow float32: such temperatures sample greedily instead of emitting garbage
    greedy = llm.generate("hello", max_tokens=8, temperature=0).token_ids
    for t in (1e-40, 1e-6):
        assert llm.generate("hello", max_tokens=8, temperature=t, seed=3).token_ids == greedy


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_tokens=2.5), "max_tokens must be an integer"),
        (dict(max_tokens=True), "max_tokens must be an integer"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(temperature=1e300), r"temperature must be at most 3.4\d*e\+38"),  # inf as f32: NaN logits
        (dict(top_k=1.5), "top_k must be an integer"),
        (dict(seed=0.5), "seed must be an integer"),
        (dict(seed=2**64), "seed must lie in"),
        (dict(stop=5), "stop must be a string or a list of strings"),
        (dict(stop=[b"x"]), "stop must be a string or a list of strings"),
        (dict(min_p=-0.1), "min_p must lie in"),
        (dict(presence_penalty=2.5), "presence_penalty must lie in"),
        (dict(frequency_penalty=float("nan")), "finite frequency_penalty"),
        (dict(repetition_penalty=11), "repetition_penalty must lie in"),
        (dict(logit_bias={10**6: 1.0}), "outside the vocabulary"),
        (dict(logit_bias={-1: 1.0}), "outside the vocabulary"),
        (dict(logit_bias={"5": 1.0}), "logit_bias token id must be an integer"),
        (dict(logit_bias={5: float("inf")}), r"must lie in \[-100, 100\]"),
        (dict(logit_bias={5: 100.5}), r"must lie in \[-100, 100\]"),
        (dict(logit_bias={5: "x"}), "must be a number"),
        (dict(logit_bias=[5]), "must map token ids"),
        (dict(ignore_eos=1), "ignore_eos must be true or false"),
        (dict(min_tokens=5), r"min_tokens must lie in \[0, max_tokens = 4\]"),
        (dict(min_tokens=-1), "min_tokens must lie in"),
    ],
    ids=[
        "max-tokens-float",
        "max-tokens-bool",
        "temperature-str",
        "temperature-past-float32",
        "top-k-float",
        "seed-float",
        "seed-over-int64",
        "stop-int",
        "stop-bytes",
        "min-p-negative",
        "presence-2.5",
        "frequency-nan",
        "repetition-11",
        "bias-id-large",
        "bias-id-negative",
        "bias-id-str",
        "bias-inf",
        "bias-100.5",
        "bias-str",
        "bias-list",
        "ignore-eos-int",
        "min-tokens-over-max",
        "min-tokens-negative",
    ],
)
def test_bad_arguments_are_value_errors(llm, kwargs, words):
    with pytest.raises(ValueError, match=words):
        llm.generate("hello", **{"max_tokens": 4, **kwargs})


@pytest.mark.parametrize("prompt", [["hi", "there"], [1.9, 2.0], [True], None, 7])
def test_bad_prompts_are_value_errors(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(prompt, max_tokens=2)


def test_warm_up_is_nothing_on_the_torch_backend(llm):
    """warm_up compiles and captures for the kernels (tests/test_llm_gpu.py); the torch backend has
    neither, so it does nothing and the next generation is unchanged."""
    want = llm.generate("import os", max_tokens=6, temperature=0).token_ids
    assert llm.warm_up() == 0.0
    assert llm.generate("import os", max_tokens=6, temperature=0).token_ids == want


@pytest.mark.parametrize("context", [2, 3, 6, 12, 16, 300, 4096])
def test_warm_up_request_fits_any_context(context, monkeypatch):
    """The kernels' warm-up requests (their arithmetic, run here on the torch backend in their place) fit a
    context of any length >= 2 (`lumo serve --max-model-len 2` starts), and where the context allows, the
    first prompt is long enough for the chunked GDN prefill's kernels (2 x CHUNKED_MIN_TOKENS), then come
    prompts of 8, 16, 24 and 32 tokens for the sequential prefill's and each GEMV width's (where they fit).
    Before them the backend reserves its runner for the whole context (no later request grows it;
    test_gpu_spec_dryrun.py)."""
    llm = LLM(max_model_len=context, device="cpu")
    asked = []

    class Kernels:  # as if on the kernels
        def reserve(self):
            asked.append("reserve")

    def generate(prompt, max_tokens, **kw):
        asked.append((len(prompt), max_tokens))
        llm._gpu = None  # run it on the torch backend
        return LLM.generate(llm, prompt, max_tokens, **kw)

    monkeypatch.setattr(llm, "generate", generate)
    llm._gpu = Kernels()
    assert llm.warm_up() > 0
    assert asked[0] == "reserve"
    (n, new), *short = asked[1:]
    assert n >= 1 and new >= 1 and n + new <= context and (context < 261 or (n, new) == (256, 4))
    assert [s for s, _ in short] == [s for s in (8, 16, 24, 32) if s < context]
    assert all(new >= 1 and s + new <= context for s, new in short)


def test_token_id_prompts(llm):
    ids = llm.tokenizer.encode("hello")
    want = llm.generate(ids, max_tokens=4, temperature=0).token_ids
    assert llm.generate(torch.tensor(ids), max_tokens=4, temperature=0).token_ids == want
    assert llm.generate(tuple(ids), max_tokens=4, temperature=0).token_ids == want


def test_bad_max_model_len(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    with pytest.raises(ValueError, match="max_model_len must be an integer"):
        LLM(ckpt, device="cpu", max_model_len="8")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLM(ckpt, device="cpu", max_model_len=10**8)


YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}}


def test_hf_overrides_are_config_json(tmp_path):
    """hf_overrides (vLLM's --hf-overrides): the engine is the one a checkpoint whose config.json holds the
    merged values gives (bitwise: tokens and logprobs), objects merged key by key (rope_theta kept); yarn
    stretches the context to the original x factor (a context the checkpoint refuses without it); the
    fp32 reference check (`lumo check`) reads the same config."""
    import json
    import shutil

    from lumo.check import against_reference

    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4, mtp_num_hidden_layers=0)
    edited = tmp_path / "edited"
    shutil.copytree(ckpt, edited)
    config = json.loads((edited / "config.json").read_text())
    config["rope_parameters"].update(YARN["rope_parameters"])
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLM(ckpt, device="cpu", max_model_len=8192)
    over, ref = LLM(ckpt, device="cpu", hf_overrides=YARN), LLM(edited, device="cpu")
    assert over.config == ref.config and over.config.rope_scaling.rope_type == "yarn"
    assert over.max_model_len == ref.max_model_len == 8192  # the default: the whole stretched context
    plain = LLM(ckpt, device="cpu")
    ids = list(range(5, 300))
    want = ref.generate(ids, max_tokens=6, temperature=0, logprobs=2)
    got = over.generate(ids, max_tokens=6, temperature=0, logprobs=2)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert plain.generate(ids, max_tokens=6, temperature=0, logprobs=2).logprobs != want.logprobs
    assert "of the fp32 CPU model" in against_reference(over)


def test_hf_overrides_merge_and_refuse():
    from lumo.config import ConfigError, apply_overrides

    raw = {"a": 1, "rope": {"theta": 5, "type": "default"}, "text_config": {"max_position_embeddings": 8}}
    assert apply_overrides(raw, {"rope": {"type": "yarn"}, "b": [1]}) == {
        "a": 1,
        "rope": {"theta": 5, "type": "yarn"},
        "text_config": {"max_position_embeddings": 8},
        "b": [1],
    }
    assert apply_overrides(raw, {"text_config": {"max_position_embeddings": 16}})["text_config"] == {
        "max_position_embeddings": 16
    }
    with pytest.raises(ConfigError, match="a field of this checkpoint's text_config"):
        apply_overrides(raw, {"max_position_embeddings": 16})  # it would change nothing
    with pytest.raises(ConfigError, match="must be a JSON object"):
        apply_overrides(raw, [1])


def test_chat_template_override(tmp_path, monkeypatch):
    """LLM(chat_template=): the prompts a chat renders to; a bad template fails before any weight is read."""
    import lumo.engine.llm as L
    from lumo.tokenizer import TokenizerError

    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    llm = LLM(
        ckpt, device="cpu", spec="off", chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert llm.tokenizer.apply_chat_template(msgs) == "[hi][yo]"
    monkeypatch.setattr(
        L, "load_model", lambda *a, **k: pytest.fail("weights read before the template check")
    )
    with pytest.raises(TokenizerError, match="does not compile"):
        LLM(ckpt, device="cpu", chat_template="{{ }")


def test_stop_reason_says_what_ended_it(llm):
    """GenerationResult / the last StreamChunk's stop_reason (vLLM's): the stop string matched, a stop token
    id asked for, None at the end-of-sequence token or the length limit."""
    free = llm.generate([5, 17, 99], max_tokens=24, temperature=0, ignore_eos=True)
    assert free.finish_reason == "length" and free.stop_reason is None
    stop = free.text[6:9]
    r = llm.generate([5, 17, 99], max_tokens=24, temperature=0, ignore_eos=True, stop=["\x00never", stop])
    assert (r.finish_reason, r.stop_reason, r.text) == ("stop", stop, free.text[: free.text.index(stop)])
    tok = free.token_ids[3]
    r = llm.generate([5, 17, 99], max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[tok])
    assert (r.finish_reason, r.stop_reason, r.token_ids) == (
        "stop",
        tok,
        free.token_ids[: free.token_ids.index(tok)],
    )
    chunks = list(
        llm.generate_stream([5, 17, 99], max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )
    assert chunks[-1].stop_reason == stop and all(c.stop_reason is None for c in chunks[:-1])
    eos = llm.tokenizer.eos_token_ids[0]
    r = llm.generate([5, 17, 99], max_tokens=24, temperature=0, logit_bias={eos: 100.0})
    assert (r.finish_reason, r.stop_reason, r.token_ids) == ("stop", None, [])
    # the end-of-sequence id asked for as a stop token under ignore_eos: the user's stop token (vLLM's)
    kw = dict(max_tokens=24, temperature=0, logit_bias={eos: 100.0}, ignore_eos=True, stop_token_ids=[eos])
    r = llm.generate([5, 17, 99], **kw)
    assert (r.finish_reason, r.stop_reason, r.token_ids) == ("stop", eos, [])


def test_small_model_decodes_on_one_cpu_thread(tmp_path, monkeypatch):
    """A small model's decode steps run on one torch thread (OpenMP's spinning threads made the embedded
    model 16x slower on a busy CPU), the prefill and the caller's code after it on all; OMP_NUM_THREADS
    set by the user is left alone."""
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        llm = LLM(ckpt, device="cpu", spec="off")
        seen = [
            torch.get_num_threads() for _ in llm.generate_stream([5, 17, 99], max_tokens=6, ignore_eos=True)
        ]
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        stream = llm.generate_stream([5, 17, 99], max_tokens=6, ignore_eos=True)
        next(stream)
        stream.close()  # a stream closed early restores them too
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        llm = LLM(ckpt, device="cpu", spec="off")
        seen = [
            torch.get_num_threads() for _ in llm.generate_stream([5, 17, 99], max_tokens=6, ignore_eos=True)
        ]
        assert set(seen) == {2}
    finally:
        torch.set_num_threads(before)


def test_draft_quant_is_checked(tmp_path):
    """The drafter's precision: an unknown choice, or NVFP4 where no kernels drafter runs, is refused."""
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    with pytest.raises(ValueError, match="unknown draft quantisation"):
        LLM(ckpt, device="cpu", draft_quant="fp4")
    with pytest.raises(ValueError, match="kernels backend"):
        LLM(ckpt, device="cpu", draft_quant="nvfp4")
    assert LLM(ckpt, device="cpu", draft_quant="none").draft_quant == "none"


def test_generation_config_defaults_are_checked_at_load(tmp_path):
    """min_p / repetition_penalty from generation_config.json are the defaults; a value lumo cannot sample
    with is a ConfigError naming the file when the model loads, not a failure of every request."""
    import json

    from lumo.config import ConfigError

    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=2, mtp_num_hidden_layers=0)
    f = ckpt / "generation_config.json"
    cfg = json.loads(f.read_text())
    f.write_text(json.dumps({**cfg, "min_p": 0.1, "repetition_penalty": 1.2}))
    params = LLM(ckpt, device="cpu").sampling_params(seed=1)
    assert params.min_p == 0.1 and params.repetition_penalty == 1.2 and params.penalized
    f.write_text(json.dumps({**cfg, "min_p": 3}))
    with pytest.raises(ConfigError, match="generation_config.json: min_p must lie in"):
        LLM(ckpt, device="cpu")


def test_logit_bias_and_ignore_eos(llm):
    """logit_bias moves greedy decoding (a ban, a lift); an end-of-sequence token lifted to the top ends the
    request at once, unless ignore_eos: then exactly max_tokens are generated (eos tokens, no text)."""
    plain = llm.generate("hello", max_tokens=6, temperature=0).token_ids
    banned = llm.generate("hello", max_tokens=6, temperature=0, logit_bias={plain[0]: -100})
    assert banned.token_ids[0] != plain[0] and plain[0] not in banned.token_ids
    zero = llm.generate("hello", max_tokens=6, temperature=0, logit_bias={plain[0]: 0.0})
    assert zero.token_ids == plain
    eos = llm.tokenizer.eos_token_ids[0]
    stopped = llm.generate("hello", max_tokens=6, temperature=0, logit_bias={eos: 100})
    assert stopped.token_ids == [] and stopped.finish_reason == "stop"
    kept = llm.generate("hello", max_tokens=6, temperature=0, logit_bias={eos: 100}, ignore_eos=True)
    assert kept.token_ids == [eos] * 6 and kept.finish_reason == "length"
    kw = dict(max_tokens=6, temperature=0.9, seed=2, logit_bias={eos: 100}, ignore_eos=True)
    sampled = llm.generate("hello", **kw)
    assert sampled.token_ids == [eos] * 6  # +100: every sample the end token


def test_min_tokens(llm):
    """min_tokens: an end token lifted to the top cannot come before min_tokens tokens (nor a stop token id),
    then ends the request; ignore_eos leaves only the stop token ids banned."""
    eos = llm.tokenizer.eos_token_ids[0]
    kw = dict(max_tokens=8, temperature=0, logit_bias={eos: 100})
    r = llm.generate("hello", min_tokens=3, **kw)
    assert len(r.token_ids) == 3 and eos not in r.token_ids and r.finish_reason == "stop"
    seeded = llm.generate("hello", min_tokens=5, **{**kw, "temperature": 0.9, "seed": 4})
    assert len(seeded.token_ids) == 5 and seeded.finish_reason == "stop"
    free = llm.generate("hello", max_tokens=8, temperature=0).token_ids
    lifted = {eos: 100, free[1]: 50}
    stop = llm.generate("hello", max_tokens=8, temperature=0, logit_bias=lifted, stop_token_ids=[free[1]])
    assert stop.token_ids == []  # the end token first
    late = llm.generate(
        "hello", max_tokens=8, temperature=0, logit_bias=lifted, stop_token_ids=[free[1]], min_tokens=2
    )
    assert len(late.token_ids) == 2 and not {eos, free[1]} & set(late.token_ids)
    kept = llm.generate("hello", min_tokens=4, ignore_eos=True, **kw)
    assert kept.token_ids == [eos] * 8  # under ignore_eos the end token is no stop token: not banned


def test_stop_strings_wait_for_min_tokens(llm):
    """A stop string in the first min_tokens tokens' text does not end the request (vLLM's min_tokens)."""
    plain = llm.generate("hello", max_tokens=8, temperature=0, ignore_eos=True)
    stop = next(c for c in plain.text if c != "\ufffd")  # the first character the output shows
    early = llm.generate("hello", max_tokens=8, temperature=0, ignore_eos=True, stop=[stop])
    late = llm.generate("hello", max_tokens=8, temperature=0, ignore_eos=True, stop=[stop], min_tokens=6)
    assert len(early.token_ids) < 6 and len(late.token_ids) >= 6
    assert late.token_ids[: len(early.token_ids)] == early.token_ids


def test_one_generation_at_a_time(llm):
    """Generations share the caches: one started while another is unfinished (inside a stream's loop, or
    from a second thread) is a RuntimeError, never two corrupted outputs; a stream exhausted, closed or
    dropped frees the LLM."""
    import threading

    ref = llm.generate("hello", max_tokens=12, temperature=0).text
    stream = llm.generate_stream("hello", max_tokens=12, temperature=0)
    text = next(stream).text
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.generate("x", max_tokens=1, temperature=0)
    text += "".join(c.text for c in stream)  # the stream itself carried on untouched
    assert text == ref
    for close in (True, False):  # closed, or only dropped
        s = llm.generate_stream("hello", max_tokens=12, temperature=0)
        next(s)
        if close:
            s.close()
        del s
        assert llm.generate("hello", max_tokens=12, temperature=0).text == ref
    holding, release, errors = threading.Event(), threading.Event(), []

    def hold() -> None:
        s = llm.generate_stream("hello", max_tokens=12, temperature=0)
        next(s)
        holding.set()
        release.wait(10)
        s.close()

    t = threading.Thread(target=hold)
    t.start()
    holding.wait(10)
    try:
        llm.generate("x", max_tokens=1)
    except RuntimeError as e:
        errors.append(e)
    release.set()
    t.join()
    assert len(errors) == 1 and llm.generate("hello", max_tokens=12, temperature=0).text == ref


def test_numpy_scalars_are_numbers(llm):
    """numpy's floats and integers (not only the float64 / int64 subclasses of Python's) are accepted where
    numbers go, as Python's are: the same tokens; numpy's bool is not a number."""
    import numpy as np

    plain = dict(temperature=0.5, top_p=0.875, seed=1, logprobs=2, logit_bias={5: 1.0})  # float32-exact
    numpy = dict(
        temperature=np.float32(0.5), top_p=np.float32(0.875), seed=np.uint8(1), logprobs=np.int8(2),
        logit_bias={np.int16(5): np.float32(1.0)},
    )  # fmt: skip
    assert (
        llm.generate("hello", max_tokens=6, **numpy).token_ids
        == llm.generate("hello", max_tokens=6, **plain).token_ids
    )
    with pytest.raises(ValueError, match="temperature must be a number"):
        llm.generate("hello", max_tokens=2, temperature=np.bool_(True))


def test_a_tokenizer_past_the_weights_vocabulary_is_named(tmp_path):
    """A checkpoint whose config.json vocab_size (and embedding) is smaller than its tokenizer: text that
    encodes to an id past it is a TokenizerError naming the mismatch (session 47: an IndexError traceback
    from the embedding lookup), and text within it still generates."""
    import json

    from safetensors.torch import load_file, save_file

    from lumo.tokenizer import TokenizerError

    d = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=2)
    cfg = json.loads((d / "config.json").read_text())
    vocab = 280
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))
    t = load_file(d / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "mtp.embed_tokens.weight"):
        if name in t:
            t[name] = t[name][:vocab].contiguous()
    save_file(t, str(d / "model.safetensors"))
    llm = LLM(d, device="cpu")
    with pytest.raises(TokenizerError, match="past the model's vocabulary of 280 ids"):
        llm.generate("<|im_start|>user", max_tokens=2)
    assert len(llm.generate("ab", max_tokens=2, temperature=0).token_ids) == 2
