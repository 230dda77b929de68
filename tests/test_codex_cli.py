"""OpenAI's Codex CLI (the real client, `codex exec`) against lumo's /v1/responses on a scripted engine:
its first turn answers with an apply_patch call in Qwen's XML form, a turn whose prompt holds the tool's
result answers with text. Codex must apply the patch (the file appears) and send the call and its output
back, which lumo renders into the next prompt. Runs where a `codex` binary is found (LUMO_CODEX, else
PATH; `npm install @openai/codex`); CI has none, so there it is skipped. Session 44 ran it with Codex CLI
0.171.0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

from lumo.server.testing import ScriptedLLM, serve_in_thread

CODEX = os.environ.get("LUMO_CODEX") or shutil.which("codex")
pytestmark = pytest.mark.skipif(CODEX is None, reason="no codex binary (LUMO_CODEX or PATH)")

PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello from lumo\n*** End Patch"
CALL = (
    "<think>\nA new file: a patch.\n</think>\n\nAdding it.<tool_call>\n<function=apply_patch>\n"
    f"<parameter=input>\n{PATCH}\n</parameter>\n</function>\n</tool_call>"
)
DONE = "All done: hello.txt is added."


class _Agent(ScriptedLLM):
    """The patch call, or the closing text once a tool's result is in the prompt."""

    def generate_stream(self, prompt, max_tokens=256, **kw):
        self.output = DONE if "<tool_response>" in self.tokenizer.decode(list(prompt)) else CALL
        yield from super().generate_stream(prompt, max_tokens, **kw)


def _catalog(home: str) -> str:
    """Codex's own model catalog (`codex debug models`) with one entry more, `scripted`: a model offered
    the free-form apply_patch tool and plain tools (no code mode), as Codex's catalog describes one."""
    out = subprocess.run(
        [CODEX, "debug", "models"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CODEX_HOME": home},
    )
    models = json.loads(out.stdout)["models"]
    base = next(
        (m for m in models if m.get("apply_patch_tool_type") == "freeform" and not m.get("tool_mode")),
        models[0],
    )
    entry = {**base, "slug": "scripted", "tool_mode": None, "prefer_websockets": False}
    entry.update(apply_patch_tool_type="freeform", context_window=200_000, max_context_window=200_000)
    path = os.path.join(home, "catalog.json")
    with open(path, "w") as f:
        json.dump({"models": [entry]}, f)
    return path


def test_codex_exec_applies_a_patch_through_lumo(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    llm = _Agent.with_test_tokenizer(tmp_path / "tok", CALL, max_model_len=200_000)
    with serve_in_thread(llm) as url:
        catalog = _catalog(str(home))
        (home / "config.toml").write_text(
            f'model_catalog_json = "{catalog}"\nmodel = "scripted"\nmodel_provider = "lumo"\n'
            'approval_policy = "never"\nsandbox_mode = "workspace-write"\n\n'
            f'[model_providers.lumo]\nname = "lumo"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        )
        run = subprocess.run(
            [CODEX, "exec", "--skip-git-repo-check", "Add hello.txt saying hello"],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "CODEX_HOME": str(home)},
            stdin=subprocess.DEVNULL,
        )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (work / "hello.txt").read_text() == "hello from lumo\n"
    assert DONE in run.stdout
    first, last = (llm.tokenizer.decode(p) for p in (llm.prompts[0], llm.prompts[-1]))
    assert "apply_patch" in first and "web_search" not in first  # shown as a function; hosted tools left out
    assert PATCH.replace("\n", "\\n") in last or PATCH in last  # the call went back, then its result
    assert last.index("hello.txt") < last.index("<tool_response>")
