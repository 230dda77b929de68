"""`lumo bench`: prefill and decode speed of a model as lumo serves it, plain and speculative, in one table.

Prompts are real text: Python standard-library files the embedded model never trained on (lumo.corpus's
held-out split, then the rest), cut to each prompt length in the model's own tokens; within a mode every
request takes another stretch of text (the modes time the same prompts), and prefix caching is off.
Decoding is greedy unless a temperature is given (top-k / top-p / min-p and the penalties only if asked,
whatever the checkpoint's generation_config says) and runs for exactly `gen_tokens` tokens whatever the
model emits (end-of-sequence tokens included, as vLLM's ignore_eos), so every mode times the same work.
Speculative modes report the accepted drafts per event and their histogram, the numbers that decide their
speed, and the plain steps adaptive speculation took (each request starts with a fresh policy, so no row
depends on the requests before it). On the GPU kernels a plain row also shows its floor: the bytes one
decode step must move at the request's mean context, at the device copy bandwidth measured in the run.
A first request as long as the longest warms up (compiles kernels, captures CUDA graphs) and is not timed.
Times are medians over `repeats` requests; rates are the work divided by those medians.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from .config import ModelConfig
from .engine.sampling import SamplingParams

ROOM = 64  # positions past the last token a request reserves (an event may run past it)


@dataclass
class BenchRow:
    mode: str  # "plain" or the speculative mode ("tree", "chain")
    prompt_tokens: int
    gen_tokens: int
    prefill_ms: float  # prompt in, first token out (median)
    prefill_tok_s: float  # prompt_tokens / prefill_ms
    decode_tok_s: float  # the gen_tokens - 1 tokens after the first / their median time
    floor_tok_s: float | None  # plain decoding's ceiling: copy bandwidth / bytes of a step (kernels only)
    accepted: float | None  # mean accepted drafts per speculative event, over all repeats
    events: int  # speculative events over all repeats
    plain_steps: int  # tokens adaptive speculation decoded plainly, over all repeats
    histogram: list[int] = field(default_factory=list)  # events by accepted drafts 0, 1, 2, ...


def copy_rates(nbytes: int = 2 << 30, warm: int = 50) -> dict[str, float]:
    """Bytes/s (read + written) of a device copy of `nbytes` by cudaMemcpy ("memcpy") and by an elementwise
    kernel ("kernel"), each timed over 20 launches after `warm` launches that raise the clocks."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    res = {}
    for name, fn in (("memcpy", lambda: dst.copy_(src)), ("kernel", lambda: torch.mul(src, 1.0, out=dst))):
        for _ in range(warm):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            fn()
        b.record()
        b.synchronize()
        res[name] = 2 * nbytes * 20 / (a.elapsed_time(b) * 1e-3)
    return res


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """The device's copy bandwidth in bytes/s (read + written): the faster of copy_rates' two ways."""
    return max(copy_rates(nbytes).values())


def step_bytes(cfg: ModelConfig, gw, context: int) -> int:
    """Bytes one plain decode step on the kernels must move at `context` positions: every linear weight
    (GPUWeights.nbytes), the GDN and conv states read and written, the K/V read and the new row written,
    the hidden row and the logits."""
    H, V = cfg.hidden_size, cfg.vocab_size
    nkv, d, nv = cfg.num_key_value_heads, cfg.head_dim, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    n_full = len(cfg.full_attention_layers)
    n_gdn = cfg.num_layers - n_full
    state = 2 * n_gdn * (nv * dk * dv * 4 + cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * 2)  # r + w
    kv = n_full * (context + 1) * nkv * d * 2 * 2  # K and V of the context read, the new row written
    return gw.nbytes() + 2 * H + state + kv + V * (2 + 2 + 4 + 4)


def check_args(lengths: list[int], gen: int, repeats: int) -> None:
    """The settings alone (before a model loads: a mistake should not wait for it)."""
    if gen < 2:
        raise ValueError("--gen-tokens must be at least 2 (decode speed needs tokens after the first)")
    if repeats < 1 or not lengths or min(lengths) < 1:
        raise ValueError("--repeats and every --prompt-tokens value must be at least 1")


def _text_stream() -> Iterator[str]:
    from .corpus import split_documents, stdlib_documents

    train, val, held = split_documents(stdlib_documents())
    docs = [d.text for d in (*held, *val, *train)]  # held-out files first; the rest for long prompts
    if not docs:
        raise ValueError("no Python standard-library source files found to cut prompts from")
    while True:
        yield from docs


def bench_prompts(
    tokenizer, lengths: list[int], repeats: int
) -> tuple[list[int], dict[int, list[list[int]]]]:
    """A warm-up prompt as long as the longest, then `repeats` prompts of each length, each from its own
    stretch of the text."""
    stream, buf = _text_stream(), []

    def take(n: int) -> list[int]:
        nonlocal buf
        while len(buf) < n:
            buf += tokenizer.encode(next(stream))
        out, buf = buf[:n], buf[n:]
        return out

    warm = take(max(lengths))
    return warm, {n: [take(n) for _ in range(repeats)] for n in lengths}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_request(
    llm, prompt: list[int], gen: int, params: SamplingParams, spec: str, max_len: int
) -> tuple[float, float, object]:
    """(prefill seconds, decode seconds, decoder) of one request of `gen` tokens after `prompt`, on a
    runner of `max_len` positions (the same for every request of a run: no runner is made mid-run)."""
    llm.reset_adaptive()  # each request on its own (a backoff would carry over from the one before)
    dec = llm.decoder(params, max_len, spec=spec)
    _sync(llm.device)
    t0 = time.perf_counter()
    out = dec.prefill(prompt)
    _sync(llm.device)
    t1 = time.perf_counter()
    while len(out) < gen:
        out += dec.step()
    _sync(llm.device)
    return t1 - t0, time.perf_counter() - t1, dec


def sampling_for(llm, temperature: float = 0.0, **shaping: float) -> SamplingParams:
    """The benchmark's sampling: `temperature` (0: greedy) and only the top-k / top-p / min-p / penalties
    given in `shaping` (LLM.sampling_params' names), each off otherwise; seed 0."""
    off = dict(
        top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0
    )
    return llm.sampling_params(temperature=temperature, seed=0, **{**off, **shaping})


def describe(params: SamplingParams) -> str:
    """'greedy' or the temperature, then the settings that are on, e.g. 'temperature 0.7, top-k 20'."""
    settings = (
        ("top-k", params.top_k, 0),
        ("top-p", params.top_p, 1.0),
        ("min-p", params.min_p, 0.0),
        ("repetition", params.repetition_penalty, 1.0),
        ("frequency", params.frequency_penalty, 0.0),
        ("presence", params.presence_penalty, 0.0),
    )
    head = "greedy" if params.greedy else f"temperature {params.temperature:g}"
    return ", ".join([head, *(f"{name} {value:g}" for name, value, off in settings if value != off)])


def run_bench(
    llm,
    lengths: list[int],
    gen: int,
    repeats: int,
    temperature: float = 0.0,
    modes: list[str] | None = None,
    params: SamplingParams | None = None,
) -> list[BenchRow]:
    """Rows for each mode (default: plain, and the LLM's speculative mode if it has one) and prompt length.
    params (sampling_for) replaces temperature when given."""
    check_args(lengths, gen, repeats)
    max_len = max(lengths) + gen + ROOM
    if max_len > llm.max_model_len:
        raise ValueError(
            f"a {max(lengths)}-token prompt and {gen} new tokens need a context of {max_len} tokens; the "
            f"model's is {llm.max_model_len} (--max-model-len, or shorter --prompt-tokens / --gen-tokens)"
        )
    modes = modes or (["plain"] if llm.spec == "off" else ["plain", llm.spec])
    params = params or SamplingParams(temperature=temperature, seed=0)
    warm, prompts = bench_prompts(llm.tokenizer, lengths, repeats)
    gw = llm.gpu_weights
    bw = copy_bandwidth(512 << 20) if gw is not None else None
    rows = []
    for mode in modes:
        spec = "off" if mode == "plain" else mode
        time_request(llm, warm, min(gen, 16), params, spec, max_len)  # compile, capture graphs
        for n in lengths:
            pre, dec, acc, events, plain = [], [], [], 0, 0
            for p in prompts[n]:
                tp, td, d = time_request(llm, p, gen, params, spec, max_len)
                pre.append(tp)
                dec.append(td)
                stats = getattr(d, "stats", None)
                if stats is not None:
                    acc += stats.accepted
                    events += stats.events
                    plain += stats.plain_steps
            tp, td = statistics.median(pre), statistics.median(dec)
            floor = None
            if bw is not None and mode == "plain":
                floor = bw / step_bytes(llm.config, gw, n + gen // 2)
            hist = Counter(acc)
            rows.append(
                BenchRow(
                    mode,
                    n,
                    gen,
                    tp * 1e3,
                    n / tp,
                    (gen - 1) / td,
                    floor,
                    sum(acc) / len(acc) if acc else None,
                    events,
                    plain,
                    [hist[i] for i in range(max(hist) + 1)] if hist else [],
                )
            )
    return rows


def device_name(llm) -> str:
    return torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "CPU"


def format_table(rows: list[BenchRow]) -> str:
    lines = [
        "| mode | prompt tokens | prefill ms | prefill tokens/s | decode tokens/s | floor tokens/s (% of it) "
        "| accepted drafts/event | events by accepted drafts 0, 1, ... |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain = {r.prompt_tokens: r.decode_tok_s for r in rows if r.mode == "plain"}
    for r in rows:
        speed = f"{r.decode_tok_s:.1f}"
        if r.mode != "plain" and r.prompt_tokens in plain:
            speed += f" ({r.decode_tok_s / plain[r.prompt_tokens]:.2f}x plain)"
        floor = ""
        if r.floor_tok_s is not None:
            floor = f"{r.floor_tok_s:.0f} ({100 * r.decode_tok_s / r.floor_tok_s:.0f}%)"
        acc = "" if r.accepted is None else f"{r.accepted:.2f} over {r.events} events"
        if r.plain_steps:
            acc += f", {r.plain_steps} plain steps"
        hist = " ".join(map(str, r.histogram))
        lines.append(
            f"| {r.mode} | {r.prompt_tokens} | {r.prefill_ms:.1f} | {r.prefill_tok_s:.0f} | {speed} "
            f"| {floor} | {acc} | {hist} |"
        )
    return "\n".join(lines)


def write_json(path: str, llm, rows: list[BenchRow], params: SamplingParams | None = None) -> None:
    meta = {"model": llm.model_name, "device": device_name(llm), "backend": llm.backend}
    meta["dtype"] = str(llm.dtype).split(".")[-1]
    if params is not None:
        meta["sampling"] = asdict(params)
    with open(path, "w") as f:
        json.dump({**meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
