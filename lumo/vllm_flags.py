"""vLLM's `vllm serve` flags on `lumo serve`, so that a user's vLLM command line runs as it is.

Each flag below is accepted and ignored, and says once at start-up what lumo does instead (so an output may
differ from vLLM's where the flag changed vLLM's: `--seed`, `--generation-config vllm`). A flag that asks
for what lumo cannot do (more than one GPU, more than one replica) is a one-line error before any weights
load. Flags that lumo shares with vLLM under the same name and meaning (`--host`, `--port`,
`--max-model-len`, `--served-model-name`, `--api-key`, `--chat-template`, `--ssl-certfile`, `--ssl-keyfile`,
`--return-tokens-as-token-ids`, `--dtype auto|bfloat16|float32`) are lumo's own; any other unknown flag
stays an error (`--tokenizer` too: another tokenizer would change the prompts), so that a typo of one of
lumo's is not ignored.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # "--gpu-memory-utilization" (and a short form)
    takes_value: bool
    instead: str  # what lumo does (the start-up notice)


IGNORED = (
    Flag(("--enable-auto-tool-choice",), False, "tool calls are parsed whenever a request has tools"),
    Flag(
        ("--tool-call-parser",),
        True,
        "the Qwen3 family's <tool_call> forms, JSON and XML (qwen3_coder), are both parsed",
    ),
    Flag(("--reasoning-parser",), True, "<think> ... </think> is parsed into the reasoning fields"),
    Flag(("--trust-remote-code",), False, "lumo runs no code from a checkpoint"),
    Flag(("--quantization", "-q"), True, "the quantisation is read from the checkpoint's config"),
    Flag(("--load-format",), True, "safetensors shards are read as they are"),
    Flag(
        ("--gpu-memory-utilization",),
        True,
        "the context is fitted to the GPU's free memory at start-up (--max-model-len to set it)",
    ),
    Flag(
        ("--max-num-seqs",),
        True,
        "one request decodes at a time, the others wait in a queue (--max-queue)",
    ),
    Flag(("--max-num-batched-tokens",), True, "prompts are prefilled in chunks of lumo's own size"),
    Flag(("--enable-chunked-prefill",), False, "prompts are always prefilled in chunks"),
    Flag(
        ("--speculative-config",),
        True,
        "the checkpoint's MTP head drafts a token tree (--spec, --spec-depth, --spec-topk, --spec-budget)",
    ),
    Flag(("--kv-cache-dtype",), True, "K/V are kept in bfloat16"),
    Flag(("--mamba-ssm-cache-dtype",), True, "the recurrent (GDN) states are kept in float32"),
    Flag(("--attention-backend",), True, "attention runs lumo's own kernels"),
    Flag(("--enforce-eager",), False, "the kernels backend replays CUDA graphs (--backend torch: eager)"),
    Flag(("--compilation-config", "-O"), True, "lumo's kernels are compiled by NVRTC, not torch.compile"),
    Flag(("--async-scheduling",), False, "lumo schedules one request at a time itself"),
    Flag(("--seed",), True, "each request samples with its own seed (a random one when it gives none)"),
    Flag(
        ("--generation-config",),
        True,
        "the checkpoint's generation_config.json gives the default sampling settings",
    ),
    Flag(
        ("--enable-prompt-tokens-details",),
        False,
        "usage always has prompt_tokens_details.cached_tokens",
    ),
    Flag(("--disable-log-requests",), False, "requests are not logged"),
    Flag(("--enable-log-requests",), False, "requests are not logged (/metrics counts them)"),
    Flag(("--disable-log-stats",), False, "statistics are served at /metrics, not logged"),
    Flag(("--uvicorn-log-level",), True, "uvicorn logs warnings and errors"),
    Flag(("--disable-uvicorn-access-log",), False, "there is no access log"),
)

# one GPU, one replica: a size above 1 is refused
SIZES = (
    ("--tensor-parallel-size", "-tp"),
    ("--pipeline-parallel-size", "-pp"),
    ("--data-parallel-size", "-dp"),
)


def _dest(name: str) -> str:
    return "vllm_" + name.lstrip("-").replace("-", "_")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags on a `lumo serve` parser (module docstring)."""
    g = p.add_argument_group(
        "vLLM's flags", "accepted so that a `vllm serve` command line runs; each says what lumo does instead"
    )
    for f in IGNORED:
        kw = {"metavar": "X"} if f.takes_value else {"action": argparse.BooleanOptionalAction}  # --no-X too
        g.add_argument(*f.names, dest=_dest(f.names[0]), default=None, help=f.instead, **kw)
    for names in SIZES:
        g.add_argument(*names, dest=_dest(names[0]), type=int, default=1, metavar="1", help="one GPU: 1 only")
    g.add_argument(
        "--enable-prefix-caching",
        dest="vllm_enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on by default (--prefix-snapshots); --no-enable-prefix-caching is --prefix-snapshots 0",
    )


def apply_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Check the vLLM flags given and apply the one with a meaning here (--no-enable-prefix-caching); the
    notices to print, one per flag. Raises ValueError for a parallel size above 1."""
    for names in SIZES:
        n = getattr(args, _dest(names[0]))
        if n != 1:
            raise ValueError(f"lumo serves a model on one GPU: {names[0]} {n} is not available (1 only)")
    notes = []
    for f in IGNORED:
        v = getattr(args, _dest(f.names[0]))
        if v is None:
            continue
        given = f"{f.names[0]} {v}" if f.takes_value else f.names[0] if v else "--no-" + f.names[0][2:]
        notes.append(f"{given} (vLLM's) has no effect here: {f.instead}")
    if args.vllm_enable_prefix_caching is False:
        args.prefix_snapshots = 0
        notes.append("--no-enable-prefix-caching (vLLM's): prefix caching is off (--prefix-snapshots 0)")
    return notes
