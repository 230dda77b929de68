"""Host cost of structured outputs (lumo.engine.grammar), on the CPU: what a grammar adds to a plain step
(one mask) and to a speculative event (the default tree's 28 masks, computed between the draft and the
verify), at a 248,320-token vocabulary (Qwen3.5's size).

No Qwen tokenizer is reachable offline, so the vocabulary is built here: the 256 byte tokens plus the most
frequent pre-tokenized pieces of the Python standard library (lumo.corpus's split), byte-level encoded as
Qwen's are, topped up with frequent two-piece joins. llguidance's mask cost grows with the vocabulary and
the grammar's state, not with where the tokens came from, so this measures the right order of magnitude;
a real Qwen tokenizer is not measured.

    python bench/bench_grammar.py [--vocab 248320] [--events 40] [--gpu]

Prints one table: medians (and 90th percentiles) of --events measurements each, next to the time the
GPU spends on the step or event they are added to (the H200's 27B numbers in docs/runner.md and
docs/spec-engine.md, and the same scaled to a GB10's 273 GB/s).

--acceptance adds a table from the CPU reference decoders (the embedded model in fp32, the default tree,
held-out prompts): accepted drafts per event free, under LONG with the drafter unconstrained, and under
LONG with the drafter proposing under the grammar along its spine (Constraint.spine).

--gpu adds a table (needs CUDA): the embedded model's tree decoding from CUDA graphs, free and under
a JSON schema that keeps it inside the grammar, and plain decoding under the same schema: tokens/s,
accepted drafts per event, the host's mask time per event, and the event's wall time (the draft -> host
-> verify round trip included). The texts differ (the grammar changes them), so so does acceptance.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import time

import torch

from lumo.config import TreeConfig
from lumo.corpus import SPLIT_PATTERN, stdlib_documents
from lumo.engine.grammar import GrammarCompiler, StructuredOutputs
from lumo.engine.tree import build_tree

# A tool-call-like schema: nested objects, an enum, an array, optional fields.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "hours": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "get_weather_forecast",
    "arguments": {"city": "San Francisco", "unit": "celsius", "days": 5, "hours": [6, 12, 18, 21]},
}
# The 27B step / event on the H200 (bench_decode / bench_spec, docs): a plain step at 1k, a 32-row verify
H200_STEP_MS, H200_EVENT_MS = 5.25, 5.25 * 1.76 + 1.0
GB10_SCALE = 4270 / 273  # the same floor ratio at the GB10's bandwidth


def _byte_alphabet() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def synthetic_tokenizer(vocab: int) -> tuple[str, int]:
    """A byte-level BPE tokenizer.json of `vocab` tokens (the last one an end token) and that end id."""
    alphabet = _byte_alphabet()
    enc = lambda s: "".join(alphabet[b] for b in s.encode())  # noqa: E731
    pieces: collections.Counter[str] = collections.Counter()
    split = re.compile(SPLIT_PATTERN.replace(r"\p{L}", "a-zA-Z").replace(r"\p{N}", "0-9"))
    for doc in stdlib_documents()[:3000]:
        pieces.update(p for p in split.findall(doc.text) if len(p) > 1)
    tokens = [alphabet[b] for b in range(256)]
    seen = set(tokens)
    common = [enc(p) for p, _ in pieces.most_common()]
    for t in common:
        if len(tokens) >= vocab - 1:
            break
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    i = 0
    while len(tokens) < vocab - 1:  # frequent pieces joined two by two
        t = common[i // 1000] + common[i % 1000]
        if t not in seen:
            seen.add(t)
            tokens.append(t)
        i += 1
    end = "<|endoftext|>"
    model = {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)}, "merges": []}
    spec = {
        "version": "1.0",
        "added_tokens": [{"id": vocab - 1, "content": end, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": model,
    }  # fmt: skip
    return json.dumps(spec), vocab - 1


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{1e3 * statistics.median(xs):.3f} (p90 {1e3 * xs[int(0.9 * (len(xs) - 1))]:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--events", type=int, default=40)
    ap.add_argument("--acceptance", action="store_true", help="also accepted drafts, CPU reference decoders")
    ap.add_argument("--gpu", action="store_true", help="also the embedded model's decoding on the GPU")
    args = ap.parse_args()

    t0 = time.perf_counter()
    text, end = synthetic_tokenizer(args.vocab)
    t1 = time.perf_counter()
    compiler = GrammarCompiler(text, args.vocab, [end])
    t2 = time.perf_counter()
    spec = StructuredOutputs(json=SCHEMA)
    compiler.constraint(spec)
    t3 = time.perf_counter()
    compiler.constraint(spec)  # the compiled matcher cached: a copy
    t4 = time.perf_counter()

    ids = compiler.tokenizer.tokenize_str(json.dumps(DOCUMENT, separators=(",", ":")))
    con = compiler.constraint(spec)
    one, tree_times = [], []
    tb = build_tree(TreeConfig())
    n, parent, depth = tb.n_nodes, tb.parent[: tb.n_nodes].tolist(), tb.depth[: tb.n_nodes].tolist()
    gen = torch.Generator().manual_seed(0)
    buf = torch.zeros(tb.rows, con.words, dtype=torch.int32)
    for i, t in enumerate(ids[: args.events]):
        s = time.perf_counter()
        con.bitmask()
        one.append(time.perf_counter() - s)
        # the default tree over the document's next tokens: the spine right, the siblings random tokens
        nxt = ids[i + 1 : i + 1 + 12] + [end] * 12
        tokens = [t] + [0] * (n - 1)
        for j in range(1, n):
            spine = parent[j] == j - 1 and depth[j] == j
            tokens[j] = (
                nxt[depth[j] - 1] if spine else int(torch.randint(0, args.vocab - 1, (1,), generator=gen))
            )
        con.advance([t])
        s = time.perf_counter()
        on = con.tree_bitmasks(tokens, parent, buf)
        tree_times.append(time.perf_counter() - s)
        assert on[0]

    rows = [
        ("tokenizer for llguidance (once per model)", f"{1e3 * (t2 - t1):.0f}", "-"),
        ("schema compiled (once per schema; then cached)", f"{1e3 * (t3 - t2):.1f}", "-"),
        ("a request's copy of a cached schema", f"{1e3 * (t4 - t3):.3f}", "-"),
        (
            "plain step: one mask",
            _ms(one),
            f"H200 27B step {H200_STEP_MS:.2f}; GB10 ~{H200_STEP_MS * GB10_SCALE:.0f}",
        ),
        (
            f"event: masks of the default tree ({n} rows, depth {tb.depth_max})",
            _ms(tree_times),
            f"H200 27B event ~{H200_EVENT_MS:.1f}; GB10 ~{H200_EVENT_MS * GB10_SCALE:.0f}",
        ),
    ]
    print(
        f"bench_grammar: V = {args.vocab} (synthetic byte-level vocabulary, built in {t1 - t0:.1f} s), "
        f"{len(ids)}-token JSON document, medians of {len(one)}; one CPU thread of this machine"
    )
    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}} | {'ms':>22} | GPU time it adds to (ms)")
    for name, ms, ref in rows:
        print(f"{name:<{w}} | {ms:>22} | {ref}")
    if args.acceptance:
        acceptance_table()
    if args.gpu:
        gpu_table()


# A JSON grammar long enough to keep --gpu's requests inside it for all their tokens
LONG = {
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["lines"],
}


def acceptance_table(n_prompts: int = 6, new: int = 64) -> None:
    """Accepted drafts per event of the CPU reference tree decoder (module docstring)."""
    from unittest import mock

    from lumo.corpus import split_documents, stdlib_documents
    from lumo.engine.decode import SpecDecoder
    from lumo.engine.grammar import Constraint
    from lumo.engine.llm import embedded_model_path
    from lumo.engine.sampling import SamplingParams
    from lumo.tokenizer import Tokenizer
    from lumo.weights import load_model

    path = embedded_model_path()
    cfg, w = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    tok = Tokenizer.from_dir(path)
    think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    compiler = GrammarCompiler(tok.to_json(), cfg.vocab_size, tok.eos_token_ids, think=think)
    prompts = [tok.encode(d.text)[:64] for d in split_documents(stdlib_documents())[2][:n_prompts]]
    head = "the embedded model (fp32, CPU reference, default tree), greedy"
    print(f"\n{head}, {n_prompts} held-out prompts x {new} tokens")
    for name, grammar, drafter in (
        ("free", False, False),
        ("JSON schema, drafter unconstrained", True, False),
        ("JSON schema, drafter under the grammar", True, True),
    ):
        accepted = events = 0
        with mock.patch.object(Constraint, "spine", Constraint.spine if drafter else lambda self: None):
            for p in prompts:
                dec = SpecDecoder(
                    cfg,
                    w,
                    SamplingParams(temperature=0.0),
                    len(p) + new + 64,
                    "cpu",
                    torch.float32,
                    TreeConfig(),
                )
                if grammar:
                    dec.constraint = compiler.constraint(StructuredOutputs(json=LONG), think)  # thinking off
                out = dec.prefill(p)
                while len(out) < new:
                    out += dec.step()
                accepted, events = accepted + sum(dec.stats.accepted), events + dec.stats.events
        print(f"{name:<40} | {accepted / events:5.2f} accepted drafts/event over {events} events")


def gpu_table(n_prompts: int = 8, new: int = 160, repeats: int = 3) -> None:
    """The embedded model on the GPU, tree / plain decoding, free and under LONG (module docstring)."""
    from bench_spec import decode_timed, embedded_on_gpu, graphed_decoder  # same folder, as python runs it

    from lumo.engine.llm import embedded_model_path
    from lumo.engine.sampling import SamplingParams
    from lumo.tokenizer import Tokenizer

    cfg, gw, prompts, capacity = embedded_on_gpu(n_prompts, new)
    tok = Tokenizer.from_dir(embedded_model_path())
    think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    compiler = GrammarCompiler(tok.to_json(), cfg.vocab_size, tok.eos_token_ids, think=think)
    spec = StructuredOutputs(json=LONG)
    rows = []
    for mode, grammar in (("tree", False), ("tree", True), ("plain", True), ("plain", False)):
        dec = graphed_decoder(cfg, gw, capacity, mode, SamplingParams(temperature=0.0))
        engine, mask_s = getattr(dec, "engine", None), [0.0]
        if engine is not None:
            mask_tree = engine.mask_tree

            def timed_mask(constraint, tokens=None, mask_tree=mask_tree, mask_s=mask_s):
                t0 = time.perf_counter()
                mask_tree(constraint, tokens)
                mask_s[0] += time.perf_counter() - t0

            engine.mask_tree = timed_mask
        rates, events, accepted, masks, total = [], 0, 0, 0.0, 0.0
        for _ in range(repeats):
            n, secs, mask_s[0] = 0, 0.0, 0.0
            for p in prompts:
                dec.constraint = compiler.constraint(spec, p) if grammar else None
                toks, t = decode_timed(dec, p, new)
                n, secs = n + len(toks) - 1, secs + t
                stats = getattr(dec, "stats", None)
                if stats is not None:
                    events, accepted = events + stats.events, accepted + sum(stats.accepted)
            rates.append(n / secs)
            masks, total = masks + mask_s[0], total + secs
        step = "event" if events else "step"
        per_step = total / (events or repeats * len(prompts) * new)
        rows.append((
            f"{mode}{' + JSON schema' if grammar else ''}",
            f"{statistics.median(rates):.0f}",
            f"{accepted / events:.2f}" if events else "-",
            f"{1e3 * per_step:.3f} per {step}",
            f"{1e3 * masks / events:.3f}" if events and grammar else "-",
        ))  # fmt: skip
    print(f"\nembedded model on {torch.cuda.get_device_name()}, CUDA graphs, greedy, {len(prompts)} held-out"
          f" prompts x {new} tokens, medians of {repeats} (ms: means over all runs)")  # fmt: skip
    head = ("decoding", "tokens/s", "accepted/event", "wall ms", "mask host ms/event")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
