"""`lumo generate | serve | bench | check | quantize`: the command line. User mistakes print one line and
exit 2."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import NoReturn

from . import __version__
from .config import DEFAULT_PREFIX_LINES, DEFAULT_PREFIX_PARK, DEFAULT_PREFIX_SNAPSHOTS, DRAFT_QUANTS
from .vllm_flags import add_vllm_flags, apply_vllm_flags

USER_ERROR = 2


def _add_model_args(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", nargs="?", default=None, help="model directory or hub id (default: embedded)")
    else:
        p.add_argument("--model", default=None, help="model directory or hub id (default: embedded)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    dtypes = ["auto", "float32", "bfloat16"]
    p.add_argument("--dtype", default=None, choices=dtypes, help="auto (the default): the device's")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output)")
    p.add_argument(
        "--backend", default="auto", choices=["auto", "torch", "kernels"], help="kernels: lumo's CUDA runner"
    )
    p.add_argument(
        "--spec",
        default="auto",
        choices=["auto", "tree", "chain", "off"],
        help="speculative decoding with the MTP head (auto: tree on the GPU kernels, off elsewhere)",
    )
    p.add_argument("--spec-depth", type=int, default=11, help="draft tree spine depth D")
    p.add_argument("--spec-topk", type=int, default=3, help="candidates per spine depth (siblings + 1)")
    p.add_argument("--spec-budget", type=int, default=27, help="draft nodes per tree, root excluded")
    p.add_argument(
        "--draft-vocab",
        default=None,
        metavar="N|FILE",
        help="the drafter proposes only these tokens: a file of token ids, used as is (JSON list, plain "
        "integers, or a .pt tensor; `python -m lumo.engine.draft_vocab` ranks them on your text) or a size N "
        "(the tokenizer's added tokens + the lowest ids); the output is unchanged, and on the kernels "
        "backend the draft's lm_head shrinks to those rows (default: whole vocabulary)",
    )
    p.add_argument(
        "--draft-quant",
        default="auto",
        choices=DRAFT_QUANTS,
        help="the drafter's weights (MTP head and its lm_head) on the kernels backend: nvfp4 copies made at "
        "load, or none (the checkpoint's); auto: nvfp4 for an NVFP4 checkpoint. The output is unchanged; "
        "the drafter reads fewer bytes and may be accepted less often",
    )
    p.add_argument(
        "--adaptive-spec",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on the GPU kernels, decode plainly while speculation's events emit fewer tokens per second "
        "than plain steps (measured as it decodes; tried again later); the output is the same either way",
    )
    p.add_argument(
        "--prefix-snapshots",
        type=int,
        default=DEFAULT_PREFIX_SNAPSHOTS,
        metavar="N",
        help="prefix caching: a prompt that starts like an earlier one resumes after the shared prefix, from "
        "one of N snapshots of the recurrent state taken on the prefill's chunk grid (~154 MB each on a "
        "27B); the output is unchanged. 0 turns it off",
    )
    p.add_argument(
        "--prefix-park",
        type=int,
        default=DEFAULT_PREFIX_PARK,
        metavar="N",
        help="a cached prefix another prompt would overwrite (a coding agent's side call between two turns) "
        "is parked: the positions that prompt may write are copied aside, at most N (0: none parked; on a "
        "27B each parked prefix takes its snapshots, ~0.6 GB, and about N x 68 KiB, one more N x 68 KiB "
        "for swapping them, counted by the start-up memory check)",
    )
    p.add_argument(
        "--prefix-lines",
        type=int,
        default=DEFAULT_PREFIX_LINES,
        metavar="N",
        help="prefixes parked at once: the newest, then those resumed before, then the longest (a "
        "conversation and a sub-agent's, while a side call runs; 0: none parked)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a jinja chat template (a file, or the template itself) to use instead of the checkpoint's",
    )
    p.add_argument(
        "--hf-overrides",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="a JSON object merged into the checkpoint's config.json (vLLM's flag; objects key by key), "
        'e.g. yarn for a longer context: \'{"text_config": {"rope_parameters": {"rope_type": "yarn", '
        '"factor": 4.0, "original_max_position_embeddings": 262144}}}\' --max-model-len 1010000',
    )


def _json_object(text: str) -> dict:
    """--hf-overrides: a JSON object (argparse turns the error into one line and exit 2)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _llm(args: argparse.Namespace, progress: bool = False):
    from .config import TreeConfig
    from .engine.llm import LLM

    nodes = 1 + min(args.spec_budget, args.spec_depth * args.spec_topk)  # what the tree can hold
    rows = max(32, -(-nodes // 8) * 8)  # verify rows are padded to a multiple of 8
    tree = TreeConfig(depth=args.spec_depth, topk=args.spec_topk, budget=args.spec_budget, rows=rows)
    return LLM(
        args.model,
        device=args.device,
        dtype=None if args.dtype == "auto" else args.dtype,
        max_model_len=args.max_model_len,
        progress=progress,
        spec=args.spec,
        tree=tree,
        backend=args.backend,
        draft_vocab=args.draft_vocab,
        draft_quant=args.draft_quant,
        prefix_snapshots=args.prefix_snapshots,
        prefix_park=args.prefix_park,
        prefix_lines=args.prefix_lines,
        adaptive_spec=args.adaptive_spec,
        chat_template=args.chat_template,
        hf_overrides=args.hf_overrides,
    )


def _origins(text: str) -> tuple[str, ...]:
    """--allowed-origins: a browser sends its page's origin, scheme://host[:port], compared as a string, so
    a path or a trailing slash would never match: refused here rather than silently matching nothing."""
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin like http://host:port (or '*')")
    if not origins:
        raise argparse.ArgumentTypeError("no origin given")
    return origins


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port {text!r} is not a whole number") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port {port} is outside 1..65535")
    return port


def _bias(text: str) -> tuple[int, float]:
    """--logit-bias TOKEN_ID=VALUE."""
    token, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=VALUE (e.g. 13=-100), got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse with lumo's one-line errors (argparse prints the whole usage first): `lumo serve: error:
    ...`, a pointer to --help, exit code 2. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lumo", description=__doc__)
    parser.add_argument("--version", action="version", version=f"lumo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: model's config)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None, help="0 = off (default: model's config)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="1 = off (prompt and output)")
    g.add_argument("--frequency-penalty", type=float, default=None, help="0 = off (output)")
    g.add_argument("--presence-penalty", type=float, default=None, help="0 = off (output)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument(
        "--logit-bias", type=_bias, action="append", default=None, metavar="ID=VALUE",
        help="add VALUE to token ID's logit (repeatable; -100 bans it)",
    )  # fmt: skip
    g.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence tokens")
    g.add_argument("--stop-token-id", type=int, action="append", default=None, metavar="ID",
                   help="a token that ends the output like end-of-sequence (repeatable)")  # fmt: skip
    g.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="no end-of-sequence / stop token before N tokens")  # fmt: skip
    so = g.add_mutually_exclusive_group()  # structured outputs (lumo.engine.grammar)
    so.add_argument(
        "--json-schema", metavar="SCHEMA", help="the output is JSON of this schema (text or @FILE)"
    )
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", help="the output matches this regular expression")
    so.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    so.add_argument("--grammar", help="the output follows this Lark or GBNF grammar (text or @FILE)")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_args(s, positional=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name in the API (default: the checkpoint's); several: the first is reported, all "
        "are accepted (vLLM's)",
    )
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before 503")
    s.add_argument(
        "--api-key",
        default=None,
        help="answer only requests with `Authorization: Bearer KEY` or `x-api-key: KEY` (/health, /ping, "
        "/version and /metrics stay open); default: $LUMO_API_KEY, else no key",
    )
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    s.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    s.add_argument(
        "--allowed-origins",
        type=_origins,
        default=(),
        metavar="ORIGINS",
        help="comma-separated web origins (e.g. http://localhost:3000) whose pages may call the API from a "
        "browser (CORS), or '*' for any; default none",
    )
    s.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name tokens `token_id:N` unless a request's return_tokens_as_token_ids says otherwise",
    )
    add_vllm_flags(s)

    b = sub.add_parser(
        "bench",
        help="prefill and decode speed, plain and speculative, on real text (lumo/benchmark.py)",
        description="Times requests as lumo serves them: prompts cut from Python source files, greedy "
        "decoding of exactly --gen-tokens tokens, prefix caching off; medians of --repeats requests.",
    )
    _add_model_args(b, positional=True)
    b.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024], metavar="N", help="prompt lengths")
    b.add_argument("--gen-tokens", type=int, default=128, metavar="N", help="tokens generated per request")
    b.add_argument("--repeats", type=int, default=3, metavar="N", help="requests per prompt length and mode")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--top-k", type=int, default=0, help="0 = off (default; the checkpoint's is not used)")
    b.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    b.add_argument("--min-p", type=float, default=0.0, help="0 = off (default)")
    b.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default)")
    b.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off (default)")
    b.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off (default)")
    b.add_argument(
        "--plain-only", action="store_true", help="time plain decoding only (default: also the --spec mode)"
    )
    b.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")

    c = sub.add_parser(
        "check",
        help="check the install, the kernels' builds, a checkpoint and lumo's exactness (lumo/check.py)",
        description="One line per check (ok / FAIL / skip); exit code 1 if any failed.",
    )
    _add_model_args(c, positional=True)
    c.add_argument(
        "--arch",
        action="append",
        default=None,
        help="compile the kernels for this architecture (repeatable; default: the GPU's, or sm_121a)",
    )
    c.add_argument("--skip-kernels", action="store_true", help="do not compile the kernels")
    c.add_argument("--tokens", type=int, default=32, help="tokens per request of the generation checks")
    c.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare the engine's logprobs with the fp32 CPU model (default: for checkpoints under 2 GB)",
    )

    q = sub.add_parser("quantize", help="write a ModelOpt-format NVFP4 checkpoint")
    q.add_argument("src")
    q.add_argument("dst")
    q.add_argument("--format", default="nvfp4", choices=["nvfp4", "w4a16_nvfp4"])
    q.add_argument(
        "--exclude", nargs="+", default=None, help="fnmatch patterns kept in BF16 (replaces the defaults)"
    )
    return parser


def _text_or_file(value: str | None) -> str | None:
    """An option's value, or the text of the file it names as @FILE."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as e:
        raise ValueError(f"cannot read {value[1:]}: {e.strerror}") from None


def _structured(args: argparse.Namespace) -> dict | None:
    """`lumo generate`'s structured-output option as LLM.generate's structured_outputs (None: none)."""
    forms = {
        "json": _text_or_file(args.json_schema),
        "json_object": args.json_object or None,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": _text_or_file(args.grammar),
    }
    forms = {k: v for k, v in forms.items() if v is not None}
    return forms or None


def _generate(args: argparse.Namespace) -> int:
    structured = _structured(args)
    llm = _llm(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    t0 = time.perf_counter()
    n, reason, t_first = 0, "length", None
    for chunk in llm.generate_stream(
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        logit_bias=dict(args.logit_bias) if args.logit_bias else None,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        stop_token_ids=args.stop_token_id,
        min_tokens=args.min_tokens,
        structured_outputs=structured,
    ):
        t_first = t_first or time.perf_counter()
        n += len(chunk.token_ids)
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        reason = chunk.finish_reason or reason
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    t_first = t_first or t1
    decode = t1 - t_first
    # the first token comes from the prefill: a decode rate needs two
    decoded = f"{(n - 1) / decode:.1f} tokens/s decode" if n > 1 and decode > 0 else "no decode steps"
    stats = getattr(llm.last_decoder, "stats", None)
    spec = f", {stats.mean_accepted:.2f} accepted drafts/event" if stats and stats.events else ""
    if stats and getattr(stats, "plain_steps", 0):  # adaptive speculation decoded part of it plainly
        spec += f" over {stats.events} events and {stats.plain_steps} plain steps"
    print(
        f"[lumo] {n} tokens ({reason}), prefill {1000 * (t_first - t0):.0f} ms, "
        f"{decoded}{spec}, model {llm.model_name} on {llm.device} ({llm.backend})",
        file=sys.stderr,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .server.app import run_server

    for note in apply_vllm_flags(args):  # before minutes of loading weights
        print(f"lumo serve: {note}", file=sys.stderr)
    if args.max_queue < 1:  # before minutes of loading weights
        raise ValueError(f"--max-queue must be at least 1, got {args.max_queue}")
    key = args.api_key if args.api_key is not None else os.environ.get("LUMO_API_KEY")
    if key is not None and not key.strip():
        raise ValueError("the API key is empty (--api-key or LUMO_API_KEY)")
    if args.ssl_certfile is not None or args.ssl_keyfile is not None:
        from .server.app import check_tls

        check_tls(args.ssl_certfile, args.ssl_keyfile)  # before minutes of loading weights
    llm = _llm(args, progress=True)
    if llm.backend == "kernels":
        import torch

        what = f"kernels, CUDA graphs, caches for {llm.max_model_len} tokens"
        print(f"lumo: warming up ({what}) ...", end="", flush=True)
        secs = llm.warm_up()
        held = torch.cuda.memory_reserved(llm.device) / 1e9
        print(f" {secs:.1f} s, {held:.1f} GB held on the GPU", flush=True)
    run_server(
        llm,
        host=args.host,
        port=args.port,
        model_name=args.served_model_name,
        max_queue=args.max_queue,
        api_key=key,
        allowed_origins=args.allowed_origins,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .benchmark import (
        check_args,
        describe,
        device_name,
        format_table,
        run_bench,
        sampling_for,
        write_json,
    )

    check_args(args.prompt_tokens, args.gen_tokens, args.repeats)
    if args.json:  # before the benchmark, not after it
        out = Path(args.json)
        writable = out.parent.is_dir() and os.access(out.parent, os.W_OK)
        if out.is_dir() or not writable or (out.exists() and not os.access(out, os.W_OK)):
            raise ValueError(f"--json {args.json}: cannot write a file there")
    args.prefix_snapshots = 0  # every request prefilled in full
    llm = _llm(args, progress=True)
    modes = ["plain"] if args.plain_only else None
    shaping = {k: getattr(args, k) for k in ("top_k", "top_p", "min_p")}
    shaping |= {k: getattr(args, k) for k in ("repetition_penalty", "frequency_penalty", "presence_penalty")}
    params = sampling_for(llm, args.temperature, **shaping)
    rows = run_bench(llm, args.prompt_tokens, args.gen_tokens, args.repeats, modes=modes, params=params)
    dtype = str(llm.dtype).split(".")[-1]
    head = f"lumo bench: {llm.model_name} on {device_name(llm)} ({llm.backend}, {dtype}), "
    head += f"medians of {args.repeats} requests, {args.gen_tokens} tokens each, {describe(params)}"
    if llm.device.type == "cuda":
        import torch  # only here: the CLI's start-up stays light

        head += f", peak GPU memory {torch.cuda.max_memory_allocated(llm.device) / 2**30:.2f} GiB"
    print(head)
    print(format_table(rows))
    if args.json:
        write_json(args.json, llm, rows, params)
    return 0


def _check(args: argparse.Namespace) -> int:
    from .check import run_check
    from .weights import resolve_model_path

    if args.model is not None:
        resolve_model_path(args.model)  # a wrong path is a user error (exit 2), not a failed check
    if args.tokens < 2:
        raise ValueError("--tokens must be at least 2")
    for arch in args.arch or []:
        if not re.fullmatch(r"sm_\d{2,3}[af]?", arch):
            raise ValueError(f"--arch {arch!r}: expected a CUDA architecture such as sm_90 or sm_121a")
    return run_check(args, lambda: _llm(args))


def _quantize(args: argparse.Namespace) -> int:
    from .quant import format_error_report, quantize_checkpoint

    report = quantize_checkpoint(args.src, args.dst, fmt=args.format, exclude=args.exclude)
    print(format_error_report(report))
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from .config import ConfigError
    from .tokenizer import TokenizerError
    from .weights import WeightError

    # OSError: permissions, a read-only or full disk, a missing path - the environment, not a lumo bug
    return (ConfigError, WeightError, TokenizerError, ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run = {"generate": _generate, "serve": _serve, "bench": _bench, "check": _check, "quantize": _quantize}
    run = run[args.command]
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `lumo generate ... | head`: the reader left; nothing more to say
        sys.stderr.close()
        return 0
    except _user_errors() as e:
        print(f"lumo {args.command}: error: {e}", file=sys.stderr)
        return USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
