"""The command line as a user runs it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lumo.engine.llm import embedded_model_path
from lumo.testing import make_tiny_checkpoint
from lumo.tokenizer import Tokenizer


def lumo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lumo.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_python_dash_m_lumo_is_the_lumo_command():
    """`python -m lumo` (no console script on PATH, e.g. PYTHONPATH=. on a GPU machine) runs the same CLI,
    its exit codes included."""
    r = subprocess.run([sys.executable, "-m", "lumo", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "generate" in r.stdout and "serve" in r.stdout, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "lumo", "generate", "--model", "/no/such/dir", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.skipif(not (embedded_model_path() / "config.json").exists(), reason="no embedded model")
def test_generate_with_the_embedded_model():
    r = lumo("generate", "--prompt", "def fibonacci(n):", "--max-tokens", "32", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 10
    summary = r.stderr.strip().splitlines()[-1]
    assert "32 tokens" in summary and "tokens/s" in summary and "lumo-tiny" in summary


@pytest.mark.skipif(not (embedded_model_path() / "config.json").exists(), reason="no embedded model")
def test_generate_structured(tmp_path):
    """--json-schema (inline and @FILE) and --choice: the output follows them, plain and speculative alike."""
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    (tmp_path / "s.json").write_text(schema)
    base = [
        "generate",
        "--prompt",
        "Some JSON:",
        "--max-tokens",
        "24",
        "--temperature",
        "0",
        "--device",
        "cpu",
    ]
    a = lumo(*base, "--json-schema", schema)
    b = lumo(*base, "--json-schema", f"@{tmp_path / 's.json'}", "--spec", "tree")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and a.stdout.lstrip().startswith('{"n":')  # JSON may start after 2 blanks
    if "(stop)" in a.stderr:
        assert list(json.loads(a.stdout)) == ["n"]
    c = lumo("generate", "--prompt", "Pick:", "--choice", "red", "--choice", "blue", "--device", "cpu")
    assert c.returncode == 0 and c.stdout.strip() in ("red", "blue"), c.stderr


def test_generate_chat_stop_and_spec(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    base = ["generate", "--model", str(ckpt), "--max-tokens", "12", "--temperature", "0", "--device", "cpu"]
    plain = lumo(*base, "--prompt", "hello")
    chain = lumo(*base, "--prompt", "hello", "--spec", "chain", "--spec-depth", "3")
    assert plain.returncode == 0 and chain.returncode == 0, plain.stderr + chain.stderr
    assert chain.stdout == plain.stdout  # speculation never changes greedy output
    assert lumo(*base, "--prompt", "hi", "--chat").returncode == 0
    flags = ["--prefix-snapshots", "0", "--no-adaptive-spec"]  # accepted (adaptive: the kernels only)
    other = lumo(*base, "--prompt", "hello", "--spec", "chain", "--spec-depth", "3", *flags)
    assert other.returncode == 0 and other.stdout == plain.stdout, other.stderr
    # an end-of-sequence token lifted to the top: nothing generated, or 12 of them with --ignore-eos
    eos = str(Tokenizer.from_dir(ckpt).eos_token_ids[0])
    ended = lumo(*base, "--prompt", "hello", "--logit-bias", f"{eos}=100", "--logit-bias", "3=-5")
    assert ended.returncode == 0 and "0 tokens (stop)" in ended.stderr, ended.stderr
    kept = lumo(*base, "--prompt", "hello", "--logit-bias", f"{eos}=100", "--ignore-eos")
    assert kept.returncode == 0 and "12 tokens (length)" in kept.stderr, kept.stderr
    late = lumo(*base, "--prompt", "hello", "--logit-bias", f"{eos}=100", "--min-tokens", "5")
    assert late.returncode == 0 and "5 tokens (stop)" in late.stderr, late.stderr
    stopped = lumo(
        *base, "--prompt", "hello", "--stop-token-id", eos, "--logit-bias", f"{eos}=100", "--ignore-eos"
    )
    assert stopped.returncode == 0 and "0 tokens (stop)" in stopped.stderr, stopped.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["generate", "--model", "/no/such/dir", "--prompt", "x"], "does not exist"),
        (["generate", "--model", "", "--prompt", "x"], "model path is empty"),
        (["generate", "--model", "{bad}", "--prompt", "x", "--device", "cpu"], "bad"),
        (["quantize", "/no/such/dir", "/tmp/lumo-out-never"], "/no/such/dir"),
        (["generate", "--prompt", "x", "--device", "cpu", "--draft-quant", "nvfp4"], "kernels backend"),
        (["generate", "--prompt", "x", "--device", "cpu", "--prefix-snapshots", "-1"], "prefix_snapshots"),
        (["generate", "--prompt", "x", "--device", "cpu", "--prefix-park", "-1"], "prefix_park"),
        (["generate", "--prompt", "x", "--device", "cpu", "--prefix-lines", "-1"], "prefix_lines"),
        (["generate", "--prompt", "x", "--chat-template", "/no/such.jinja"], "no such file"),
        (["generate", "--prompt", "x", "--chat-template", "{% if %}"], "does not compile"),
        (["serve", "--api-key", " "], "API key is empty"),
        (["serve", "--max-queue", "0"], "--max-queue must be at least 1"),
    ],
)
def test_user_errors_are_one_line_exit_2(args, words):
    r = lumo(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert words in r.stderr


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    r = lumo("generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu")
    assert r.returncode == 2 and "unsupported architecture" in r.stderr and "llama" in r.stderr


@pytest.mark.parametrize("size", [0, 1000, None], ids=["empty", "header-cut", "body-cut"])
def test_corrupt_weights_file(tmp_path, size):
    """A truncated or empty model.safetensors is a user error (one line, exit 2) for generate and serve."""
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2 if size is None else size])
    generate = ["generate", "--model", str(ckpt), "--prompt", "x", "--device", "cpu"]
    for args in (generate, ["serve", str(ckpt)]):
        r = lumo(*args)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert "model.safetensors" in r.stderr


def test_serve_on_a_busy_port(tmp_path):
    import socket

    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        r = lumo("serve", str(ckpt), "--device", "cpu", "--port", port)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "cannot listen on 127.0.0.1:" + port in r.stderr and "serving" not in r.stdout


def test_prompt_longer_than_context(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4)
    r = lumo(
        "generate",
        "--model",
        str(ckpt),
        "--prompt",
        "word " * 200,
        "--max-model-len",
        "16",
        "--device",
        "cpu",
    )
    assert r.returncode == 2 and "context" in r.stderr and "Traceback" not in r.stderr


def test_quantize_round_trip(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "src", num_hidden_layers=4)
    r = lumo("quantize", str(src), str(tmp_path / "dst"))
    assert r.returncode == 0, r.stderr
    assert "q_proj" in r.stdout  # the per-class error report
    g = lumo(
        "generate", "--model", str(tmp_path / "dst"), "--prompt", "hi", "--max-tokens", "4", "--device", "cpu"
    )
    assert g.returncode == 0, g.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--temperature", "nan"], "finite temperature"),
        (["--temperature", "1e39"], "temperature must be at most"),
        (["--min-p", "2"], "min_p must lie in [0, 1]"),
        (["--presence-penalty", "3"], "presence_penalty must lie in [-2, 2]"),
        (["--repetition-penalty", "0"], "repetition_penalty must lie in (0, 10]"),
        (["--max-model-len", "0"], "max_model_len"),
        (["--max-model-len", "99999999"], "exceeds the model's context"),
        (["--spec", "tree"], "MTP head"),
        (["--logit-bias", "13"], "TOKEN_ID=VALUE"),
        (["--logit-bias", "99999999=1"], "outside the vocabulary"),
        (["--min-tokens", "300"], "min_tokens must lie in"),
        (["--stop-token-id", "-3"], "stop_token_ids [-3] lie outside"),
        (["--regex", "(("], "invalid structured output"),
        (["--json-schema", "{no"], "not JSON"),
        (["--grammar", "@/no/such/file"], "cannot read /no/such/file"),
        (["--json-object", "--min-tokens", "2"], "cannot be combined"),
        (["--regex", "a", "--choice", "b"], "not allowed with argument"),
        (["--hf-overrides", "{no"], "--hf-overrides: not JSON"),
        (["--hf-overrides", "[1]"], "must be a JSON object"),
        (
            ["--hf-overrides", '{"rope_parameters": {"rope_type": "llama3"}}'],
            "rope_type 'llama3' is not supported",
        ),
        (["--hf-overrides", '{"num_experts": 8}'], "mixture-of-experts"),
    ],
)
def test_bad_settings_fail_at_start(tmp_path, args, words):
    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4, mtp_num_hidden_layers=0)
    r = lumo("generate", "--model", str(ckpt), "--prompt", "x", "--device", "cpu", *args)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


def test_hf_overrides_stretch_the_context(tmp_path):
    """--hf-overrides with yarn rope parameters: a context past max_position_embeddings is served."""
    import json

    ckpt = make_tiny_checkpoint(tmp_path / "m", num_hidden_layers=4, mtp_num_hidden_layers=0)
    yarn = {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}}
    args = ("generate", "--model", str(ckpt), "--prompt", "x", "--device", "cpu", "--max-tokens", "2")
    r = lumo(*args, "--max-model-len", "8192", "--hf-overrides", json.dumps(yarn))
    assert r.returncode == 0 and "2 tokens" in r.stderr, r.stderr
    assert "exceeds the model's context" in lumo(*args, "--max-model-len", "8192").stderr


def test_version():
    r = lumo("--version")
    assert r.returncode == 0 and r.stdout.strip().startswith("lumo ") and r.stdout.split()[1][0].isdigit()


@pytest.mark.parametrize(
    "args, words",
    [
        (["serve", "--port", "70000"], "outside 1..65535"),
        (["serve", "--port", "8000.5"], "not a whole number"),
        (["serve", "--max-queue", "abc"], "invalid int value"),
        (["generate"], "--prompt"),
        ([], "command"),
    ],
)
def test_argument_errors_are_one_line(args, words):
    """argparse's own errors too: one line naming the problem and --help, exit code 2, no usage dump."""
    r = lumo(*args)
    assert r.returncode == 2 and words in r.stderr and "--help" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("origins, words", [("http://localhost:3000/", "not an origin"), (",", "no origin")])
def test_serve_rejects_bad_origins(origins, words):
    """A browser's Origin is scheme://host[:port], compared as a string: a path could never match."""
    r = lumo("serve", "--allowed-origins", origins)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr
