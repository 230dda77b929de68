"""Start `lumo serve` in a subprocess on a free loopback port, for tests and benchmarks; or the app in a
thread over a scripted engine (tests of what random-weight models never emit: tool calls, reasoning)."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def serve_subprocess(
    model: str | os.PathLike | None, *args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0
) -> Iterator[ServerProcess]:
    """`python -m lumo.cli serve [MODEL] --port P *args` with `env` added to the environment (no MODEL: the
    embedded model); yields once /health answers and stops the server after."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        cmd = [
            sys.executable,
            "-m",
            "lumo.cli",
            "serve",
            *([] if model is None else [str(model)]),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*cmd, *args], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            _wait_healthy(server, timeout_s)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(server: ServerProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"lumo serve exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"lumo serve did not become healthy in {timeout_s:.0f} s:\n{server.log()}")


@dataclass
class ScriptedChunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class ScriptedLLM:
    """Stands in for lumo.engine.llm.LLM: a real tokenizer and template, a scripted output in chunks of
    `chunk` characters (one token each); the prompts it was given in `prompts`. fail_after: raise after
    that many chunks (an engine failure mid-stream)."""

    tokenizer: Any
    output: str
    model_name: str = "scripted"
    max_model_len: int = 4096
    prompts: list[list[int]] = field(default_factory=list)
    chunk: int = 3
    fail_after: int | None = None

    @classmethod
    def with_test_tokenizer(cls, directory: str | os.PathLike, output: str, **kw: Any) -> ScriptedLLM:
        """A scripted engine with lumo.testing's small tokenizer (and its chat template) written to
        `directory`."""
        from ..testing import make_tokenizer_files
        from ..tokenizer import Tokenizer

        make_tokenizer_files(Path(directory))
        return cls(Tokenizer.from_dir(directory), output, **kw)

    def constraint(self, structured, prompt_ids):
        """LLM.constraint's check: a scripted output follows no grammar, so a structured request is a 400."""
        raise ValueError("the scripted engine serves no structured outputs")

    def generate_stream(self, prompt, max_tokens=256, **kw):
        self.prompts.append(list(prompt))
        pieces = [self.output[i : i + self.chunk] for i in range(0, len(self.output), self.chunk)]
        for i, piece in enumerate(pieces):
            if i == self.fail_after:
                raise RuntimeError("scripted failure")
            yield ScriptedChunk(piece, [7], "stop" if i == len(pieces) - 1 else None)


@contextmanager
def scripted_server(
    directory: str | os.PathLike, output: str, **kw: Any
) -> Iterator[tuple[ScriptedLLM, str]]:
    """A ScriptedLLM (lumo.testing's tokenizer written to `directory`) served in a thread: (llm, URL)."""
    llm = ScriptedLLM.with_test_tokenizer(directory, output, **kw)
    with serve_in_thread(llm) as url:
        yield llm, url


@contextmanager
def serve_in_thread(llm: Any, timeout_s: float = 20.0, **app_kw: Any) -> Iterator[str]:
    """The app over `llm` (an LLM or a ScriptedLLM; `app_kw`: create_app's) served by uvicorn in a thread;
    yields its base URL."""
    import threading

    import uvicorn

    from .app import create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(llm, **app_kw), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError("the app did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class TemplateForm:
    """The embedded model's tokenizer with its chat template said to teach the JSON or the XML tool-call
    form (`form`): what chat.forced_tool_calls reads of a tokenizer, for tests of its grammars."""

    def __init__(self, form: str):
        from ..engine.llm import embedded_model_path
        from ..tokenizer import Tokenizer

        self.tok, self.form = Tokenizer.from_dir(embedded_model_path()), form

    def chat_template_source(self, tools: bool = False) -> str:
        return "... <function=NAME> ..." if self.form == "xml" else "... <tool_call> ..."

    def token_to_id(self, s: str) -> int | None:
        return self.tok.token_to_id(s)


@functools.cache
def embedded_grammars():
    """A GrammarCompiler for the embedded model's tokenizer (its think tags known), built once."""
    from ..engine.grammar import GrammarCompiler
    from ..engine.llm import embedded_model_path
    from ..tokenizer import Tokenizer

    t = Tokenizer.from_dir(embedded_model_path())
    think = t.token_to_id("<think>"), t.token_to_id("</think>")
    return GrammarCompiler(t.to_json(), 3072, t.eos_token_ids, think=think)
