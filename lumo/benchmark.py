"""`lumo bench`: prefill and decode speed of a model as lumo serves it, plain and speculative, in one table.

Prompts are real text: Python standard-library files the embedded model never trained on (lumo.corpus's
held-out split, then the rest), cut to each prompt length in the model's own tokens; every repeat takes
another stretch of text, so no prompt shares a prefix with an earlier one (and prefix caching is off).
Decoding is greedy unless a temperature is given and runs for exactly `gen_tokens` tokens whatever the
model emits (end-of-sequence tokens included, as vLLM's ignore_eos), so every mode times the same work.
Speculative modes report the accepted drafts per event, the number that decides their speed, and the
plain steps adaptive speculation took (each request starts with a fresh policy, so no row depends on the
requests before it). A first request warms up (compiles kernels, captures CUDA graphs) and is not timed.
Medians over `repeats`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from .engine.sampling import SamplingParams


@dataclass
class BenchRow:
    mode: str  # "plain" or the speculative mode ("tree", "chain")
    prompt_tokens: int
    gen_tokens: int
    prefill_ms: float  # prompt in, first token out (median)
    prefill_tok_s: float
    decode_tok_s: float  # tokens after the first / the time they took (median)
    accepted: float | None  # mean accepted drafts per speculative event, over all repeats
    events: int  # speculative events over all repeats
    plain_steps: int  # tokens adaptive speculation decoded plainly, over all repeats


def _text_stream() -> Iterator[str]:
    from .corpus import split_documents, stdlib_documents

    train, val, held = split_documents(stdlib_documents())
    while True:  # held-out files first; the rest only for very long or many prompts
        yield from (d.text for d in (*held, *val, *train))


def bench_prompts(
    tokenizer, lengths: list[int], repeats: int
) -> tuple[list[int], dict[int, list[list[int]]]]:
    """A warm-up prompt, then `repeats` prompts of each length, each from its own stretch of the text."""
    stream, buf = _text_stream(), []

    def take(n: int) -> list[int]:
        nonlocal buf
        while len(buf) < n:
            buf += tokenizer.encode(next(stream))
        out, buf = buf[:n], buf[n:]
        return out

    warm = take(min(lengths))
    return warm, {n: [take(n) for _ in range(repeats)] for n in lengths}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_request(
    llm, prompt: list[int], gen: int, params: SamplingParams, spec: str
) -> tuple[float, float, object]:
    """(prefill seconds, decode seconds, decoder) of one request of `gen` tokens after `prompt`."""
    llm.reset_adaptive()  # each request on its own (a backoff would carry over from the one before)
    dec = llm.decoder(params, len(prompt) + gen + 64, spec=spec)  # room for an event past the last token
    _sync(llm.device)
    t0 = time.perf_counter()
    out = dec.prefill(prompt)
    _sync(llm.device)
    t1 = time.perf_counter()
    while len(out) < gen:
        out += dec.step()
    _sync(llm.device)
    return t1 - t0, time.perf_counter() - t1, dec


def run_bench(
    llm, lengths: list[int], gen: int, repeats: int, temperature: float = 0.0, modes: list[str] | None = None
) -> list[BenchRow]:
    """Rows for each mode (default: plain, and the LLM's speculative mode if it has one) and prompt length."""
    if gen < 2:
        raise ValueError("--gen-tokens must be at least 2 (decode speed needs tokens after the first)")
    if repeats < 1 or not lengths or min(lengths) < 1:
        raise ValueError("--repeats and every --prompt-tokens value must be at least 1")
    longest = max(lengths) + gen + 64
    if longest > llm.max_model_len:
        raise ValueError(
            f"a {max(lengths)}-token prompt and {gen} new tokens need a context of {longest} tokens; the "
            f"model's is {llm.max_model_len} (--max-model-len, or shorter --prompt-tokens / --gen-tokens)"
        )
    modes = modes or (["plain"] if llm.spec == "off" else ["plain", llm.spec])
    params = SamplingParams(temperature=temperature, seed=0)
    warm, prompts = bench_prompts(llm.tokenizer, lengths, repeats)
    rows = []
    for mode in modes:
        spec = "off" if mode == "plain" else mode
        time_request(llm, warm, min(gen, 16), params, spec)  # compile, capture graphs
        for n in lengths:
            pre, dec, acc, events, plain = [], [], [], 0, 0
            for p in prompts[n]:
                tp, td, d = time_request(llm, p, gen, params, spec)
                pre.append(tp)
                dec.append((gen - 1) / td)
                stats = getattr(d, "stats", None)
                if stats is not None:
                    acc += stats.accepted
                    events += stats.events
                    plain += stats.plain_steps
            tp = statistics.median(pre)
            rows.append(
                BenchRow(
                    mode,
                    n,
                    gen,
                    tp * 1e3,
                    n / tp,
                    statistics.median(dec),
                    sum(acc) / len(acc) if acc else None,
                    events,
                    plain,
                )
            )
    return rows


def format_table(rows: list[BenchRow]) -> str:
    lines = [
        "| mode | prompt tokens | prefill ms | prefill tokens/s | decode tokens/s | accepted drafts/event |",
        "|---|---|---|---|---|---|",
    ]
    plain = {r.prompt_tokens: r.decode_tok_s for r in rows if r.mode == "plain"}
    for r in rows:
        speed = f"{r.decode_tok_s:.1f}"
        if r.mode != "plain" and r.prompt_tokens in plain:
            speed += f" ({r.decode_tok_s / plain[r.prompt_tokens]:.2f}x plain)"
        acc = "" if r.accepted is None else f"{r.accepted:.2f} over {r.events} events"
        if r.plain_steps:
            acc += f", {r.plain_steps} plain steps"
        lines.append(
            f"| {r.mode} | {r.prompt_tokens} | {r.prefill_ms:.1f} | {r.prefill_tok_s:.0f} | {speed} | {acc} |"
        )
    return "\n".join(lines)


def write_json(path: str, llm, rows: list[BenchRow]) -> None:
    device = torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "cpu"
    meta = {"model": llm.model_name, "device": device, "backend": llm.backend, "dtype": str(llm.dtype)}
    with open(path, "w") as f:
        json.dump({**meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
