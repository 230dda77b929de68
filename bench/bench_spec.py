"""Tree speculative decoding on the kernels (lumo/engine/gpu_spec.py), issue 7 item 8.

1. Embedded model (lumo-tiny, greedy, held-out stdlib prompts): accepted drafts per event, the acceptance
   histogram, and tokens/s of tree vs chain vs plain decoding (all CUDA graphs, host sync included), and
   of tree decoding with a draft vocabulary (lumo.engine.draft_vocab; --draft-vocab, default 1024 tokens).
2. Random 27B NVFP4 model with a random MTP head (gpu_weights.random_model_weights, config_27b): per-event
   GPU spans (draft, verify, accept+commit; graph replays), verify of R rows / plain decode step (goal
   <= 1.25), dispatch share = host time not covered by GPU work / event wall time (goal <= 5%), projected
   tokens/s at 4.05 accepted drafts per event on the H200 and on a GB10 (273 GB/s, same ratio to the
   floor), and the extra GPU memory of tree decoding over plain decoding; the same spans with a draft
   vocabulary (default 32768 tokens: the draft head's lm_head reads 13% of the whole one).
3. GDN tree step at 27B shapes, ours (gdn_tree over the rows, leaves forked off their parents, + gdn_decode
   replay of the accepted path) vs the design other engines use (every node's full state computed from its
   parent's and stored: gdn_decode(state_out=...) per node, then the accepted node's state copied in):
   goal ours >= 3x faster. Ours reads the rows' normalised q and k, made like the rows themselves before the
   timed region (in the verify the conv writes them: conv_gather_qk); a second line times ours with a
   standalone gdn_qk launch per layer as well.
One table, printed last; JSON beside it in $OUT or bench/results/bench_spec.json.
Run: python bench/bench_spec.py [--layers 64] [--context 1024] [--events 40] [--prompts 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch
from bench_decode import (  # same folder: one floor, one profile
    copy_bandwidth,
    gemv_by_launch,
    kernel_breakdown,
    kernel_events,
    step_bytes,
)

from lumo.config import FULL, TreeConfig
from lumo.corpus import split_documents, stdlib_documents
from lumo.engine.draft_vocab import MIN_DRAFT_VOCAB, draft_vocab_ids
from lumo.engine.gpu_decode import GPUDecoder
from lumo.engine.gpu_spec import GPUSpecDecoder, GPUSpecEngine
from lumo.engine.gpu_weights import (
    config_27b,
    draft_quant,
    pack_draft_head,
    pack_mtp,
    pack_weights,
    random_model_weights,
)
from lumo.engine.llm import embedded_model_path
from lumo.engine.runner import GPURunner
from lumo.engine.sampling import SamplingParams
from lumo.engine.tree import chain_config
from lumo.kernels.gdn import gdn_decode
from lumo.kernels.gdn_tree import gdn_qk, gdn_tree
from lumo.tokenizer import Tokenizer
from lumo.weights import load_model

GB, GB10_BW, PAPER_ACCEPTED = 1e9, 273e9, 4.05
GREEDY = SamplingParams(temperature=0.0)


def held_out_prompts(path: Path, n: int, length: int = 128) -> list[list[int]]:
    tok = Tokenizer.from_dir(path)
    out = []
    for doc in split_documents(stdlib_documents())[2]:
        ids = tok.encode(doc.text)
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


def decode_timed(dec, prompt: list[int], new: int) -> tuple[list[int], float]:
    """Prefill, then steps until at least `new` tokens: (the tokens, seconds of the steps, host syncs
    included; the prefill is not timed)."""
    out = dec.prefill(prompt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while len(out) < new:
        out += dec.step()
    return out, time.perf_counter() - t0


def embedded_on_gpu(n_prompts: int, new: int):
    """The embedded model packed on the GPU with its MTP head, `n_prompts` held-out prompts and the runner
    capacity one of them plus `new` tokens needs: (cfg, weights, prompts, capacity)."""
    path = embedded_model_path()
    cfg, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    prompts = held_out_prompts(path, n_prompts)
    return cfg, pack_weights(cfg, w, "cuda", mtp=True), prompts, max(len(p) for p in prompts) + new + 128


def graphed_decoder(cfg, gw, capacity: int, mode: str, params: SamplingParams):
    """A fresh runner's decoder replaying CUDA graphs: plain ("plain") or the default tree ("tree")."""
    runner = GPURunner(cfg, gw, capacity)
    if mode == "plain":
        return GPUDecoder(runner, params, use_graph=True)
    return GPUSpecDecoder(GPUSpecEngine(runner, TreeConfig()), params, use_graph=True)


def timed_requests(dec, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]], list[int]]:
    """decode_timed over the prompts: (tokens/s of the steps, each prompt's first `new` tokens, the
    accepted drafts of every event when the decoder speculates)."""
    n, secs, got, accepted = 0, 0.0, [], []
    for p in prompts:
        toks, t = decode_timed(dec, p, new)
        n, secs = n + len(toks) - 1, secs + t
        got.append(toks[:new])
        stats = getattr(dec, "stats", None)
        accepted += stats.accepted if stats is not None else []
    return n / secs, got, accepted


def repeated_requests(dec, prompts, new: int, repeats: int, ref=None, what: str = "tokens changed"):
    """timed_requests `repeats` times: (median tokens/s, the tokens, every run's accepted drafts). Every
    run must give the same tokens, and `ref`'s when given (another mode's or setting's), else `what`."""
    rates, accepted = [], []
    for _ in range(repeats):
        rate, got, acc = timed_requests(dec, prompts, new)
        ref = ref or got
        assert got == ref, what
        rates.append(rate)
        accepted += acc
    return statistics.median(rates), ref, accepted


def save_json(name: str, res: dict) -> None:
    """res, with the GPU's name, as JSON file `name` in $OUT (bench/results/ without it)."""
    dst = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(json.dumps({"device": torch.cuda.get_device_name(), **res}, indent=1))


def gpu_us_per_call(call, launches: int = 50) -> tuple[float, float]:
    """(GPU us, host us) per call(): the launches are queued behind a long sleep kernel, so CUDA events
    time the GPU's work alone and the queueing loop's wall time is the host's. Warm the call up first."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time: the host queues everything below meanwhile
    start.record()
    t0 = time.perf_counter()
    for _ in range(launches):
        call()
    host = (time.perf_counter() - t0) / launches * 1e6
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / launches, host


def embedded(n_prompts: int, new: int, draft_vocab: int) -> dict:
    path = embedded_model_path()
    cfg, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    gw = pack_weights(cfg, w, "cuda", mtp=True)
    ids = draft_vocab_ids(draft_vocab, cfg.vocab_size, Tokenizer.from_dir(path).added_token_ids())
    head, dev_ids = pack_draft_head(w.lm_head, ids, "cuda")  # the same weights plus a draft head
    gw_dv = replace(gw, mtp=replace(gw.mtp, draft_head=head, draft_ids=dev_ids))
    gw_q = replace(gw, mtp=pack_mtp(cfg, w.mtp, "cuda", w.lm_head, nvfp4=True))  # the drafter in NVFP4
    prompts = held_out_prompts(path, n_prompts)
    res = {}
    # The prompts follow each other in one sequence (a decoder per mode, graphs captured once): room for all.
    capacity = sum(len(p) for p in prompts) + len(prompts) * (new + 64)
    dv_mode, q_mode = f"tree, draft vocabulary {len(ids)}", "tree, NVFP4 drafter"
    weights = {dv_mode: gw_dv, q_mode: gw_q}
    for mode in ("plain", "chain", "tree", dv_mode, q_mode):
        runner = GPURunner(cfg, weights.get(mode, gw), capacity)
        if mode == "plain":
            dec = GPUDecoder(runner, GREEDY, use_graph=True)
        else:
            tree = chain_config(TreeConfig().depth) if mode == "chain" else TreeConfig()  # both trees
            dec = GPUSpecDecoder(GPUSpecEngine(runner, tree), GREEDY, use_graph=True)
        hist: Counter = Counter()
        n_tok, secs = 0, 0.0
        for p in prompts:
            out, t = decode_timed(dec, p, new)
            secs += t
            n_tok += len(out) - 1
            if mode != "plain":
                hist.update(dec.stats.accepted)
        events = sum(hist.values())
        res[mode] = {
            "tokens_per_s": n_tok / secs,
            "accepted_per_event": sum(k * v for k, v in hist.items()) / events if events else 0.0,
            "histogram": {int(k): v for k, v in sorted(hist.items())},
        }
    return res


def spans(engine: GPUSpecEngine, events: int) -> dict:
    """Median GPU ms of each graph per event, event wall ms (host sync included), dispatch share."""
    names = list(engine.graphs)
    per = {k: [] for k in names}
    gpu, wall = [], []
    for _ in range(events):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ev[0].record()
        for i, k in enumerate(names):
            engine.graphs[k].replay()
            ev[i + 1].record()
        n = engine._read_result()[0]  # the event's one device-to-host copy
        wall.append((time.perf_counter() - t0) * 1e3)
        engine.runner.length += n
        for i, k in enumerate(names):
            per[k].append(ev[i].elapsed_time(ev[i + 1]))
        gpu.append(ev[0].elapsed_time(ev[-1]))
    out = {k: statistics.median(v) for k, v in per.items()}
    out["event_gpu_ms"], out["event_wall_ms"] = statistics.median(gpu), statistics.median(wall)
    out["dispatch_share"] = max(0.0, 1 - out["event_gpu_ms"] / out["event_wall_ms"])
    return out


def graph_profile(engine: GPUSpecEngine, reps: int = 3, top: int = 10) -> dict:
    """Kernel breakdown of each event graph (draft, verify, commit) from torch.profiler over `reps`
    replays of that graph alone (bench_decode.kernel_breakdown: calls, summed durations, exclusive time).
    Replaying one graph repeatedly is safe here: draft and verify only write tree buffers and tree slots;
    commit's state change does not matter to a timing breakdown."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, g in engine.graphs.items():
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
        events = kernel_events(prof)
        out[name] = kernel_breakdown(events, reps)[:top]
        if name == "verify":
            out["verify's GEMVs by launch configuration"] = gemv_by_launch(events, reps)
    return out


def plain_step_ms(runner: GPURunner, context: int, steps: int = 30) -> float:
    runner.capture()
    per = []
    for _ in range(5):
        runner.seek(context)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            runner.decode_step()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / steps)
    return statistics.median(per)


def graph_ms(fn, reps: int = 20) -> float:
    """Median GPU ms of fn captured as one graph (launch overhead excluded for both designs alike)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    per = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b))
    return statistics.median(per)


def gdn_designs(engine: GPUSpecEngine) -> dict:
    """Ours (path-parallel verify with fork leaves + replay; the engine's schedule, each walking path's forks
    spread over as many warps as the device holds at once) vs per-node stored states, over every GDN layer
    of the model; and ours with one row (warp) per walking path (TreeBuffers.gdn_items, the same bits)."""
    cfg, r, tb = engine.cfg, engine.runner, engine.tb
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gdn = [lw.mixer for kind, lw in zip(cfg.layer_types, engine.w.layers, strict=True) if kind != FULL]
    n = tb.n_nodes
    parent = tb.parent.tolist()
    # A scratch copy of the states: the timing loops must not touch the engine's committed state.
    states = [s.clone() for s in r.gdn_state]
    node_states = torch.empty(n, nv, dk, dv, device="cuda")  # one layer's worth, reused (same time)
    out1 = torch.empty(1, nv, dv, dtype=torch.bfloat16, device="cuda")
    accepted = torch.tensor([0, 1, 2, 3, 4] + [-1] * (engine.cap - 5), dtype=torch.int32, device="cuda")
    count = torch.tensor([5], dtype=torch.int32, device="cuda")  # a 4-draft acceptance (~ the paper's)

    per_path = [tb.gdn_items.cuda(), tb.gdn_items_len.cuda()]

    # The rows' normalised q and k, as the verify's conv (conv_gather_qk) leaves them beside `mixed`: like
    # mixed itself, made before the timed region (neither design's conv is timed). `with_qk` also times
    # them as a standalone gdn_qk launch per layer.
    heads = (cfg.linear_num_key_heads, nv, dk, dv)
    qks = [gdn_qk(m, heads) for m in engine.gdn_mixed]

    def ours(items=(engine.gdn_items, engine.gdn_items_len), with_qk: bool = False) -> None:
        for i, g in enumerate(gdn):
            mixed, ba = engine.gdn_mixed[i], engine.gdn_ba[i]
            if with_qk:
                gdn_qk(mixed, heads, out=qks[i])
            operands = (mixed, ba[:, nv:], ba[:, :nv], g.A_log, g.dt_bias, states[i])  # b, a; the state
            gdn_tree(*operands, *items, out=engine.gdn_o, qk=qks[i])
            gdn_decode(*operands, out=engine.replay_o, rows=accepted, count=count)

    def per_node() -> None:
        for i, g in enumerate(gdn):
            mixed, ba = engine.gdn_mixed[i], engine.gdn_ba[i]
            for u in range(n):
                src = states[i] if parent[u] < 0 else node_states[parent[u]]
                gdn_decode(
                    mixed[u : u + 1],
                    ba[u : u + 1, nv:],
                    ba[u : u + 1, :nv],
                    g.A_log,
                    g.dt_bias,
                    src,
                    out=out1,
                    state_out=node_states[u],
                )
            states[i].copy_(node_states[4])  # commit = copy the accepted node's state

    ms_ours, ms_other = graph_ms(ours), graph_ms(per_node)
    ms_per_path = graph_ms(lambda: ours(per_path))
    ms_with_qk = graph_ms(lambda: ours(with_qk=True))
    return {
        "ours_ms": ms_ours,
        "ours_with_qk_launch_ms": ms_with_qk,
        "per_node_ms": ms_other,
        "speedup": ms_other / ms_ours,
        "per_node_state_bytes": len(gdn) * n * nv * dk * dv * 4,
        "gdn_tree_rows": engine.gdn_items.shape[0],  # schedule rows: warps = rows x nv x dv / DVT per layer
        "gdn_tree_items": engine.gdn_items_len.tolist(),  # per row: its critical path in gdn_step calls
        "per_path_ms": ms_per_path,
        "per_path_items": per_path[1].tolist(),
    }


def event_engine(runner: GPURunner, context: int, tree: TreeConfig) -> GPUSpecEngine:
    """A tree engine of shape `tree` on the runner after `context` random prompt tokens, graphs captured."""
    engine = GPUSpecEngine(runner, tree)
    vocab = runner.cfg.vocab_size
    ids = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.set_sampling(GREEDY)
    engine.prefill(ids)
    engine.capture()
    torch.cuda.synchronize()
    return engine


def big(
    layers: int,
    context: int,
    events: int,
    draft_vocab: int,
    dense_head: bool = False,
    quant: str = "auto",
    tree: TreeConfig | None = None,
) -> dict:
    tree = tree or TreeConfig()
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    cfg = config_27b(layers)
    w = random_model_weights(cfg, "cuda", nvfp4=True, seed=0, mtp=True, dense_head=dense_head)
    nvfp4 = draft_quant(w, quant)  # auto: the drafter in NVFP4, as LLM packs it for an NVFP4 target
    gw = pack_weights(cfg, w, "cuda", mtp=True, draft_nvfp4=nvfp4)
    # The same weights with a draft vocabulary of the draft_vocab lowest ids (the ids do not matter to the
    # time on random weights): the draft head's rows of the lm_head.
    if not MIN_DRAFT_VOCAB <= draft_vocab <= cfg.vocab_size:
        raise SystemExit(
            f"--draft-vocab: the 27B size must lie in [{MIN_DRAFT_VOCAB}, {cfg.vocab_size}], "
            f"got {draft_vocab}"
        )
    head, ids = pack_draft_head(w.lm_head, torch.arange(draft_vocab), "cuda", nvfp4)
    gw_dv = replace(gw, mtp=replace(gw.mtp, draft_head=head, draft_ids=ids))
    del w
    torch.cuda.empty_cache()
    capacity = context + 40 * events + 256
    runner = GPURunner(cfg, gw, capacity)
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    engine = event_engine(runner, context, tree)
    extra = torch.cuda.memory_allocated() - m0  # engine buffers + MTP cache + graph pools
    sp = spans(engine, events)
    kernels = graph_profile(engine)
    designs = gdn_designs(engine)
    plain = plain_step_ms(runner, context)
    floor_ms = step_bytes(cfg, gw, context) / bw * 1e3
    ev = sp["event_wall_ms"]
    sp_dv = spans(event_engine(GPURunner(cfg, gw_dv, capacity), context, tree), events)
    ev_dv = sp_dv["event_wall_ms"]
    return {
        "layers": layers,
        "context": context,
        "tree": [tree.depth, tree.topk, engine.tb.n_nodes - 1, engine.R],
        "default_tree": tree == TreeConfig(),
        "dense_head": dense_head,
        "draft_nvfp4": nvfp4,
        "copy_bandwidth_GBps": bw / GB,
        "floor_ms": floor_ms,
        "plain_step_ms": plain,
        **sp,
        "verify_over_plain": sp["verify"] / plain,
        "tokens_per_s_h200_at_4.05": (PAPER_ACCEPTED + 1) / ev * 1e3,
        "tokens_per_s_gb10_at_4.05": (PAPER_ACCEPTED + 1) / (ev * bw / GB10_BW) * 1e3,
        "plain_tokens_per_s_h200": 1e3 / plain,
        "extra_memory_GB": extra / GB,
        "extra_memory_buffers_GB": engine.extra_bytes() / GB,
        "mtp_weights_GB": gw.mtp.nbytes() / GB,
        "gdn": designs,
        "kernels": kernels,
        "draft_vocab": {
            "size": draft_vocab,
            **sp_dv,
            "tokens_per_s_h200_at_4.05": (PAPER_ACCEPTED + 1) / ev_dv * 1e3,
            "tokens_per_s_gb10_at_4.05": (PAPER_ACCEPTED + 1) / (ev_dv * bw / GB10_BW) * 1e3,
            "head_GB": head.nbytes() / GB,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--events", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--skip-27b", action="store_true")
    ap.add_argument("--skip-embedded", action="store_true")
    ap.add_argument(
        "--tree-27b",
        type=int,
        nargs=4,
        metavar=("DEPTH", "TOPK", "BUDGET", "ROWS"),
        help="the 27B's tree (TreeConfig; default: the default tree), e.g. 5 1 5 6 for a 5-draft chain",
    )
    ap.add_argument(
        "--draft-vocab",
        type=int,
        nargs=2,
        default=[1024, 32768],
        metavar=("EMBEDDED", "BIG"),
        help="draft vocabulary sizes of the extra runs (embedded model, 27B)",
    )
    ap.add_argument(
        "--bf16-head",
        action="store_true",
        help="27B with the lm_head and the MTP head in bf16, as ModelOpt's NVFP4 checkpoints ship them",
    )
    ap.add_argument(
        "--draft-quant",
        default="auto",
        choices=["auto", "nvfp4", "none"],
        help="the 27B drafter's weights (gpu_weights.draft_quant; auto: NVFP4, the target being NVFP4)",
    )
    args = ap.parse_args()
    emb = {} if args.skip_embedded else embedded(args.prompts, args.tokens, args.draft_vocab[0])
    result = {"device": torch.cuda.get_device_name(), "embedded": emb}
    if not args.skip_27b:
        tree = TreeConfig(*args.tree_27b) if args.tree_27b else None
        result["27b"] = big(
            args.layers,
            args.context,
            args.events,
            args.draft_vocab[1],
            args.bf16_head,
            args.draft_quant,
            tree,
        )
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "bench_spec.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    rows = []
    for mode, r in result["embedded"].items():
        rows.append((f"embedded {mode}: tokens/s", f"{r['tokens_per_s']:.0f}", ""))
        if mode != "plain":
            rows.append((f"embedded {mode}: accepted drafts/event", f"{r['accepted_per_event']:.2f}", ""))
            rows.append((f"embedded {mode}: histogram", str(r["histogram"]), ""))
    if "27b" in result:
        b = result["27b"]
        g = b["gdn"]
        rows += [
            (
                f"27B ({b['layers']} layers, ctx {b['context']}"
                f"{', lm_head + MTP bf16' if b['dense_head'] else ''}"
                f"{', drafter nvfp4' if b['draft_nvfp4'] else ''}): draft ms",
                f"{b['draft']:.3f}",
                "",
            ),
            (
                f"27B verify ms ({b['tree'][3]} rows)",
                f"{b['verify']:.3f}",
                f"tree (D, k, nodes, rows) {b['tree']}",
            ),
            ("27B accept+commit ms", f"{b['commit']:.3f}", ""),
            ("27B plain decode step ms (floor)", f"{b['plain_step_ms']:.3f} ({b['floor_ms']:.3f})", ""),
            ("27B verify / plain step", f"{b['verify_over_plain']:.2f}", "goal <= 1.25"),
            (
                "27B event wall ms / dispatch share",
                f"{b['event_wall_ms']:.3f} / {b['dispatch_share']:.1%}",
                "goal <= 5%",
            ),
            (
                "27B tokens/s at 4.05 drafts: H200 / GB10",
                f"{b['tokens_per_s_h200_at_4.05']:.0f} / {b['tokens_per_s_gb10_at_4.05']:.1f}",
                f"plain {b['plain_tokens_per_s_h200']:.0f}"
                + ("" if b["default_tree"] else " (4.05 is the default tree's acceptance)"),
            ),
            (
                "27B break-even accepted drafts per event (event wall / plain step - 1)",
                f"{b['event_wall_ms'] / b['plain_step_ms'] - 1:.2f}",
                "the tree beats plain decoding above it",
            ),
            (
                f"27B draft vocabulary {b['draft_vocab']['size']}: draft / verify / commit ms",
                f"{b['draft_vocab']['draft']:.3f} / {b['draft_vocab']['verify']:.3f} / "
                f"{b['draft_vocab']['commit']:.3f}",
                f"head {b['draft_vocab']['head_GB']:.3f} GB",
            ),
            (
                f"27B draft vocabulary {b['draft_vocab']['size']}: tokens/s at 4.05 drafts: H200 / GB10",
                f"{b['draft_vocab']['tokens_per_s_h200_at_4.05']:.0f} / "
                f"{b['draft_vocab']['tokens_per_s_gb10_at_4.05']:.1f}",
                "if the acceptance held (random weights: not measured)",
            ),
            (
                "27B extra GPU memory GB (buffers, MTP weights)",
                f"{b['extra_memory_GB']:.2f} ({b['extra_memory_buffers_GB']:.2f}, {b['mtp_weights_GB']:.2f})",
                "",
            ),
            (
                "GDN tree step ms: ours / per-node states",
                f"{g['ours_ms']:.3f} / {g['per_node_ms']:.3f}",
                f"{g['speedup']:.1f}x (goal >= 3x); rows' items {g['gdn_tree_items']}",
            ),
            (
                "GDN tree step ms, ours with a gdn_qk launch per layer",
                f"{g['ours_with_qk_launch_ms']:.3f}",
                f"{g['per_node_ms'] / g['ours_with_qk_launch_ms']:.1f}x (the verify's conv does it)",
            ),
            (
                "GDN tree step ms, one warp per walking path",
                f"{g['per_path_ms']:.3f}",
                f"{g['per_node_ms'] / g['per_path_ms']:.1f}x; rows' items {g['per_path_items']}",
            ),
        ]
    if "27b" in result:
        for graph, ks in result["27b"]["kernels"].items():
            what = graph if "GEMV" in graph else f"{graph} graph, top kernels"
            print(f"\n27B {what} (us per event: exclusive / summed durations):")
            for k in ks:
                print(f"  {k['excl_us']:9.1f} / {k['us']:9.1f} us  {k['calls']:5.0f} calls  {k['name'][:72]}")
    w = max(len(r[0]) for r in rows)
    print(f"\n{'metric':<{w}}  value  note")
    for name, val, note in rows:
        print(f"{name:<{w}}  {val}  {note}")
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
