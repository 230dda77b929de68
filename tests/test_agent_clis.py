"""Real agent CLIs against `lumo serve`'s APIs on a scripted engine (lumo.server.testing.ScriptedLLM, whose
answers are tool calls in Qwen's XML form, chosen by how many tool results the prompt holds): each must
run its tools for real (files appear) and send their results back, which the next prompt renders.
- Codex CLI (`codex exec`, /v1/responses): a free-form `apply_patch` call; Codex applies the patch.
- Claude Code (`claude -p`, /v1/messages): Write, then Read of a PNG, whose image comes back in the tool
  result and must be a note, not a 400; Claude Code 2.1.197 also puts system messages among the messages.
- Qwen Code (`qwen -p`, /v1/chat/completions): write_file, then read_file of a PNG (Qwen Code itself
  answers that the model reads no images).
- opencode (`opencode run`, /v1/chat/completions through its openai-compatible provider): write, then read
  of a PNG (opencode, told the model takes no images, says so itself).
Each runs where its binary is found (LUMO_CODEX / LUMO_CLAUDE / LUMO_QWEN / LUMO_OPENCODE, else PATH; `npm
install @openai/codex @anthropic-ai/claude-code @qwen-code/qwen-code opencode-ai`); CI has none, so there
they are skipped. The OpenAI Agents SDK runs in process where `openai-agents` is installed (not in CI).
Session 44 ran them all: Codex CLI 0.171.0, Claude Code 2.1.197, Qwen Code 0.15.10, opencode 1.18.33 and
openai-agents 0.24.0."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess

import pytest

pytest.importorskip("fastapi")  # the GPU image has no fastapi/uvicorn; CI does

from lumo.server.testing import ScriptedLLM, serve_in_thread

CODEX = os.environ.get("LUMO_CODEX") or shutil.which("codex")
CLAUDE = os.environ.get("LUMO_CLAUDE") or shutil.which("claude")
QWEN = os.environ.get("LUMO_QWEN") or shutil.which("qwen")
OPENCODE = os.environ.get("LUMO_OPENCODE") or shutil.which("opencode")
# a 1x1 PNG
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="
)
DONE = "All done."


def _call(name: str, **params: str) -> str:
    """A tool call in Qwen's XML form, after some reasoning and text."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    call = f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"
    return f"<think>\nNext step.\n</think>\n\nOn it.{call}"


class _Agent(ScriptedLLM):
    """steps[i] answers a prompt holding i tool results; DONE after the last."""

    steps: tuple[str, ...] = ()

    def generate_stream(self, prompt, max_tokens=256, **kw):
        step = self.tokenizer.decode(list(prompt)).count("<tool_response>")
        self.output = self.steps[step] if step < len(self.steps) else DONE
        yield from super().generate_stream(prompt, max_tokens, **kw)


def _agent(tmp_path, *steps: str) -> _Agent:
    llm = _Agent.with_test_tokenizer(tmp_path / "tok", DONE, max_model_len=200_000)
    llm.steps = steps
    return llm


def _run(cmd: list[str], cwd, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PWD": str(cwd),
        **env,
    }  # opencode finds its project by PWD, not the working directory
    run = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def _dirs(tmp_path):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "pic.png").write_bytes(PNG)
    return work, home


PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello from lumo\n*** End Patch"


def _codex_catalog(home) -> str:
    """Codex's own model catalog (`codex debug models`) narrowed to one entry, `scripted`: a model offered
    the free-form apply_patch tool and plain tools (no code mode), as Codex's catalog describes one."""
    out = _run([CODEX, "debug", "models"], home, {"CODEX_HOME": str(home)})
    models = json.loads(out.stdout)["models"]
    free_form = [m for m in models if m.get("apply_patch_tool_type") == "freeform" and not m.get("tool_mode")]
    entry = {**(free_form or models)[0], "slug": "scripted", "tool_mode": None, "prefer_websockets": False}
    entry.update(apply_patch_tool_type="freeform", context_window=200_000, max_context_window=200_000)
    path = home / "catalog.json"
    path.write_text(json.dumps({"models": [entry]}))
    return str(path)


@pytest.mark.skipif(CODEX is None, reason="no codex binary (LUMO_CODEX or PATH)")
def test_codex_exec_applies_a_patch(tmp_path):
    work, home = _dirs(tmp_path)
    llm = _agent(tmp_path, _call("apply_patch", input=PATCH))
    with serve_in_thread(llm) as url:
        (home / "config.toml").write_text(
            f'model_catalog_json = "{_codex_catalog(home)}"\nmodel = "scripted"\nmodel_provider = "lumo"\n'
            'approval_policy = "never"\nsandbox_mode = "workspace-write"\n\n'
            f'[model_providers.lumo]\nname = "lumo"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        )
        run = _run([CODEX, "exec", "--skip-git-repo-check", "Add hello.txt"], work, {"CODEX_HOME": str(home)})
    assert (work / "hello.txt").read_text() == "hello from lumo\n" and DONE in run.stdout
    first, last = (llm.tokenizer.decode(p) for p in (llm.prompts[0], llm.prompts[-1]))
    assert "apply_patch" in first and "web_search" not in first  # shown as a function; hosted tools left out
    assert last.index("Add File: hello.txt") < last.index("<tool_response>")  # the call went back, its result


def _write_then_read(tmp_path, write: str, read: str, path: str) -> tuple:
    """A scripted agent that writes hello.txt with tool `write`, then reads pic.png with tool `read`
    (`path`: the tools' path parameter), and its work and home directories."""
    work, home = _dirs(tmp_path)
    steps = (
        _call(write, **{path: f"{work}/hello.txt", "content": "hello from lumo"}),
        _call(read, **{path: f"{work}/pic.png"}),
    )
    return _agent(tmp_path, *steps), work, home


def _wrote_and_read(run: subprocess.CompletedProcess, llm: _Agent, work) -> str:
    """The CLI wrote the file, sent both tools' results back and printed the closing text; the last
    prompt."""
    assert DONE in run.stdout and (work / "hello.txt").read_text() == "hello from lumo"
    last = llm.tokenizer.decode(llm.prompts[-1])
    assert last.count("<tool_response>") == 2
    return last


PROMPT = "Write hello.txt, then look at pic.png"


@pytest.mark.skipif(CLAUDE is None, reason="no claude binary (LUMO_CLAUDE or PATH)")
def test_claude_code_writes_a_file_and_reads_an_image(tmp_path):
    llm, work, home = _write_then_read(tmp_path, "Write", "Read", "file_path")
    with serve_in_thread(llm) as url:
        env = {"HOME": str(home), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-test"}
        env.update(DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
        args = ["--allowedTools", "Write Read", "--permission-mode", "acceptEdits"]
        run = _run([CLAUDE, "-p", PROMPT, *args], work, env)
    assert "[an image was left out: this model reads text only]" in _wrote_and_read(run, llm, work)


@pytest.mark.skipif(QWEN is None, reason="no qwen binary (LUMO_QWEN or PATH)")
def test_qwen_code_writes_a_file_and_reads_an_image(tmp_path):
    llm, work, home = _write_then_read(tmp_path, "write_file", "read_file", "file_path")
    with serve_in_thread(llm) as url:
        env = {"HOME": str(home), "OPENAI_API_KEY": "sk-test", "OPENAI_BASE_URL": url + "/v1"}
        env["OPENAI_MODEL"] = "scripted"
        run = _run([QWEN, "-p", PROMPT, "--auth-type", "openai", "--yolo"], work, env)
    _wrote_and_read(run, llm, work)


@pytest.mark.skipif(OPENCODE is None, reason="no opencode binary (LUMO_OPENCODE or PATH)")
def test_opencode_writes_a_file_and_reads_an_image(tmp_path):
    llm, work, home = _write_then_read(tmp_path, "write", "read", "filePath")
    with serve_in_thread(llm) as url:
        provider = {
            "npm": "@ai-sdk/openai-compatible",
            "name": "lumo",
            "options": {"baseURL": url + "/v1", "apiKey": "sk-test"},
            "models": {"scripted": {"name": "scripted", "tools": True}},
        }
        (work / "opencode.json").write_text(
            json.dumps({"provider": {"lumo": provider}, "model": "lumo/scripted"})
        )
        run = _run([OPENCODE, "run", PROMPT], work, {"HOME": str(home)})
    _wrote_and_read(run, llm, work)


def test_openai_agents_sdk_runs_a_tool(tmp_path):
    """The OpenAI Agents SDK (`pip install openai-agents`; skipped where it is not installed), on its
    Responses model and its chat-completions model, streamed and not: the agent calls the function tool,
    gets its result back to lumo and ends with the text."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny, 21 C in {city}"

    llm = _agent(tmp_path, _call("get_weather", city="Oslo"))

    async def run(url: str) -> list[str]:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        models = agents.OpenAIResponsesModel, agents.OpenAIChatCompletionsModel
        outputs = []
        for kind in models:
            agent = agents.Agent(
                name="w", tools=[get_weather], model=kind(model="scripted", openai_client=client)
            )
            done = await agents.Runner.run(agent, "Weather in Oslo?")
            streamed = agents.Runner.run_streamed(agent, "Weather in Oslo?")
            async for _ in streamed.stream_events():
                pass
            outputs += [done.final_output, streamed.final_output]
        # turns chained by previous_response_id: the SDK then sends only the new items (within a run with
        # auto_previous_response_id, the tool's result; the next run, its question)
        agent = agents.Agent(
            name="w", tools=[get_weather], model=models[0](model="scripted", openai_client=client)
        )
        chained = await agents.Runner.run(agent, "Weather in Oslo?", auto_previous_response_id=True)
        again = await agents.Runner.run(
            agent, "And in Bergen?", previous_response_id=chained.last_response_id
        )
        return outputs + [chained.final_output, again.final_output]

    with serve_in_thread(llm) as url:
        assert asyncio.run(run(url)) == [DONE] * 6
    prompt = llm.tokenizer.decode(llm.prompts[-1])
    assert "Weather in Oslo?" in prompt and "sunny, 21 C in Oslo" in prompt and "And in Bergen?" in prompt
