"""`lumo check` and `lumo bench` on the CPU (the GPU runs are in tests/test_llm_gpu.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lumo import check
from lumo.benchmark import bench_prompts, describe, format_table, run_bench, sampling_for
from lumo.engine.llm import LLM, embedded_model_path
from lumo.engine.sampling import SamplingParams
from lumo.testing import make_tiny_checkpoint
from lumo.tokenizer import Tokenizer


def lumo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lumo.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_check_a_tiny_checkpoint_with_speculation(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    r = lumo("check", str(ckpt), "--device", "cpu", "--spec", "tree", "--skip-kernels", "--tokens", "6")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = dict(
        line.split("] ", 1)[1].split(": ", 1) for line in r.stdout.splitlines() if line.startswith("[")
    )
    assert "15 requests" in lines["exactness"] and "identical to plain decoding" in lines["exactness"]
    assert "of the fp32 CPU model" in lines["reference"]
    assert "4 layers" in lines["model"] and "speculation tree" in lines["model"]
    assert r.stdout.strip().splitlines()[-1] == "lumo check: 5 ok, 0 failed, 1 skipped"
    # a context shorter than the reference's 64-token prompt shortens the prompt, not the check
    short = lumo(
        "check", str(ckpt), "--device", "cpu", "--spec", "off", "--skip-kernels", "--max-model-len", "40"
    )
    assert short.returncode == 0 and "lumo check: 4 ok, 0 failed, 2 skipped" in short.stdout, short.stdout
    # one shorter than the generation's prompt too (it failed with "the prompt has 8 tokens" until session 48)
    tiny = lumo("check", str(ckpt), "--device", "cpu", "--spec", "off", "--skip-kernels", "--max-model-len=4")
    assert tiny.returncode == 0, tiny.stdout
    assert "[  ok] generation: 2 tokens" in tiny.stdout, tiny.stdout
    assert tiny.stdout.strip().splitlines()[-1] == "lumo check: 3 ok, 0 failed, 3 skipped", tiny.stdout


def test_check_reports_a_checkpoint_that_does_not_load(tmp_path):
    """A broken checkpoint is a failed check (exit 1) that names the problem; the later checks are skipped.
    A path that does not exist is a user error (exit 2, one line)."""
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    r = lumo("check", str(ckpt), "--device", "cpu", "--skip-kernels")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    assert "[FAIL] model:" in r.stdout and "model.safetensors" in r.stdout
    assert "[skip] generation: the model did not load" in r.stdout
    missing = lumo("check", str(tmp_path / "nothing"), "--skip-kernels")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_check_compiles_kernels_and_reports_a_failed_build(monkeypatch):
    """The kernel check compiles each source's builds for the arch asked (one small source here: CI compiles
    every source in tests/test_kernels_compile.py); NVRTC refusing an arch is a FAIL, not a crash."""
    from lumo.kernels import compile as kc

    one = [p for p in kc.kernel_sources() if p.name == "logprobs.cu"]
    monkeypatch.setattr(kc, "kernel_sources", lambda: one)
    assert "3 builds of 1 sources for sm_121a" in check.compile_kernels(["sm_121a"])
    rep = check.Report(out=lambda s: None)
    rep.run("kernels", lambda: check.compile_kernels(["sm_7"]))
    assert rep.failed == 1 and "builds failed" in rep.results[0][2]


@pytest.mark.skipif(not (embedded_model_path() / "config.json").exists(), reason="no embedded model")
def test_check_the_embedded_model_default_run():
    out = []
    args = SimpleNamespace(skip_kernels=True, arch=None, tokens=8, reference=None)
    assert check.run_check(args, lambda: LLM(device="cpu"), out.append) == 0
    assert out[-1] == "lumo check: 4 ok, 0 failed, 2 skipped"  # no GPU: speculation off (auto)
    assert any(line.startswith("[  ok] reference") for line in out)


def test_bench_prompts_are_distinct_real_text():
    tok = Tokenizer.from_dir(embedded_model_path())
    warm, prompts = bench_prompts(tok, [50, 300], 3)
    assert len(warm) == 300 and [len(p) for p in prompts[300]] == [300] * 3  # the warm-up: the longest
    starts = [tuple(p[:20]) for n in (50, 300) for p in prompts[n]] + [tuple(warm[:20])]
    assert len(set(starts)) == len(starts)  # no two prompts share a prefix
    assert "def " in tok.decode(prompts[300][0]) or "import" in tok.decode(prompts[300][0])


def test_bench_times_plain_and_speculative_rows(tmp_path):
    llm = LLM(make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4), device="cpu", spec="chain")
    rows = run_bench(llm, [20, 40], gen=5, repeats=2)
    assert [(r.mode, r.prompt_tokens) for r in rows] == [
        ("plain", 20),
        ("plain", 40),
        ("chain", 20),
        ("chain", 40),
    ]
    assert all(r.prefill_ms > 0 and r.decode_tok_s > 0 and r.gen_tokens == 5 for r in rows)
    assert rows[0].accepted is None and rows[2].events > 0 and rows[2].accepted is not None
    table = format_table(rows)
    assert "x plain" in table and table.count("\n") == 5
    with pytest.raises(ValueError, match="context"):
        run_bench(llm, [llm.max_model_len], gen=5, repeats=1)
    with pytest.raises(ValueError, match="no 'tree' decoder"):
        llm.decoder(SamplingParams(), 64, spec="tree")


def test_bench_sampling_is_what_was_asked(tmp_path):
    """lumo bench samples with the temperature and only the settings given (not the generation_config's
    defaults), described in the header; the rows run with them (a penalised chain row: events)."""
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=2)
    f = ckpt / "generation_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "top_k": 20, "repetition_penalty": 1.3}))
    llm = LLM(ckpt, device="cpu", spec="chain")
    assert describe(sampling_for(llm)) == "greedy"  # the generation_config's settings are not used
    params = sampling_for(llm, 0.7, top_k=20, presence_penalty=1.5)
    assert describe(params) == "temperature 0.7, top-k 20, presence 1.5" and params.repetition_penalty == 1.0
    rows = run_bench(llm, [20], gen=5, repeats=1, params=params)
    assert [r.mode for r in rows] == ["plain", "chain"] and rows[1].events > 0
    with pytest.raises(ValueError, match="min_p"):
        sampling_for(llm, 0.7, min_p=2.0)


@pytest.mark.skipif(not (embedded_model_path() / "config.json").exists(), reason="no embedded model")
def test_bench_command_writes_its_table_and_json(tmp_path):
    dst = tmp_path / "b.json"
    sampling = ["--temperature", "0.7", "--top-k", "20", "--presence-penalty", "1.5"]
    r = lumo("bench", "--device", "cpu", "--prompt-tokens", "32", "--gen-tokens", "8", "--repeats", "1",
             "--json", str(dst), *sampling)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "| plain | 32 |" in r.stdout and "lumo-tiny on CPU" in r.stdout
    assert "temperature 0.7, top-k 20, presence 1.5" in r.stdout
    out = json.loads(dst.read_text())
    assert out["sampling"]["presence_penalty"] == 1.5 and out["sampling"]["top_k"] == 20
    rows = out["rows"]
    assert rows[0]["mode"] == "plain" and rows[0]["gen_tokens"] == 8
    bad = lumo("bench", "--device", "cpu", "--prompt-tokens", "100000")
    assert bad.returncode == 2 and "context" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, words",
    [
        (["bench", "--gen-tokens", "1"], "--gen-tokens"),
        (["bench", "--repeats", "0"], "--repeats"),
        (["bench", "--presence-penalty", "5"], "presence_penalty"),
        (["bench", "--json", "/no/such/dir/out.json"], "cannot write a file there"),  # before the run
        (["check", "--arch", "hopper"], "--arch"),
        (["check", "--tokens", "1"], "--tokens"),
    ],
)
def test_bad_settings_are_user_errors(args, words):
    r = lumo(*args, "--device", "cpu")
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not (embedded_model_path() / "config.json").exists(), reason="no embedded model")
def test_reset_adaptive_gives_a_fresh_policy():
    """lumo bench starts each timed request with a fresh adaptive policy (no backoff carried over)."""
    from lumo.engine.adaptive import AdaptiveSpec

    llm = LLM(device="cpu")
    llm.reset_adaptive()  # the torch backend has no policy: nothing to do
    llm._gpu = SimpleNamespace(policy=AdaptiveSpec())
    llm._gpu.policy.next_backoff = 1024
    llm.reset_adaptive()
    assert llm._gpu.policy.next_backoff == AdaptiveSpec().next_backoff
