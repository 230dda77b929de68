"""Anthropic's Claude Code (the real client, `claude -p`) against lumo's /v1/messages on a scripted engine:
its answers call Write (a file appears), then Read on a PNG (Claude Code returns the image in the tool's
result, which lumo must take as a note, not refuse), then close with text. Runs where a `claude` binary is
found (LUMO_CLAUDE, else PATH; `npm install @anthropic-ai/claude-code`); CI has none, so there it is
skipped. Session 44 ran it with Claude Code 2.1.197, which puts system messages among the messages (lumo
refused every one of its requests until then)."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

from lumo.server.testing import ScriptedLLM, serve_in_thread

CLAUDE = os.environ.get("LUMO_CLAUDE") or shutil.which("claude")
pytestmark = pytest.mark.skipif(CLAUDE is None, reason="no claude binary (LUMO_CLAUDE or PATH)")

# a 1x1 PNG
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="
)
DONE = "All done: hello.txt is written."


def _call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    call = f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"
    return f"<think>\nNext step.\n</think>\n\nOn it.{call}"


class _Agent(ScriptedLLM):
    """Write, then Read, then text: the step is the number of tool results in the prompt."""

    work = ""

    def generate_stream(self, prompt, max_tokens=256, **kw):
        step = self.tokenizer.decode(list(prompt)).count("<tool_response>")
        self.output = (
            [
                _call("Write", file_path=f"{self.work}/hello.txt", content="hello from lumo"),
                _call("Read", file_path=f"{self.work}/pic.png"),
            ][step]
            if step < 2
            else DONE
        )
        yield from super().generate_stream(prompt, max_tokens, **kw)


def test_claude_code_writes_a_file_and_reads_an_image_through_lumo(tmp_path):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "pic.png").write_bytes(PNG)
    llm = _Agent.with_test_tokenizer(tmp_path / "tok", DONE, max_model_len=200_000)
    llm.work = str(work)
    with serve_in_thread(llm) as url:
        env = {
            **os.environ,
            "HOME": str(home),
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": "sk-test",
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        run = subprocess.run(
            [CLAUDE, "-p", "Write hello.txt, then look at pic.png", "--allowedTools", "Write Read"]
            + ["--permission-mode", "acceptEdits"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert DONE in run.stdout and (work / "hello.txt").read_text() == "hello from lumo"
    last = llm.tokenizer.decode(llm.prompts[-1])
    assert last.count("<tool_response>") == 2
    assert "[an image was left out: this model reads text only]" in last
