"""Plain decoding of the 27B model with the kernel runner, against its memory floor and transformers.

Weights: random NVFP4 at the real 27B config (lumo.engine.gpu_weights.random_model_weights, generated on the
GPU, no files). One table, printed last:
- decode step time (median of CUDA-graph replays, GPU time) at several contexts next to its floor = bytes a
  step must move (every linear weight + embedding row + GDN/conv state read and written + K/V of the
  context + logits) / the device-copy bandwidth measured in this run, and the ratio; plus the end-to-end
  step with the one host sync (tokens/s). Decode at context L is timed by pointing the runner at position L
  (`seek`): a step's cost depends on L, not on what the cache holds;
- prefill tokens/s for the given prompt lengths (real chunked prefill) and the peak GPU memory;
- the peer: transformers' Qwen3_5ForCausalLM `generate` (BF16, same random weights dequantised) at 1k
  context, tokens/s, against the runner on the same layer count;
- a kernel-by-kernel breakdown of a decode step from torch.profiler (launch count, busy time, idle time).
JSON goes to $OUT or bench/results/bench_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from lumo.benchmark import copy_bandwidth, step_bytes  # noqa: F401 (bench_spec, trace_step import them here)
from lumo.config import ModelConfig
from lumo.engine.gpu_weights import GPUWeights, config_27b, pack_weights, random_model_weights
from lumo.engine.runner import GPURunner, linear_weight_bytes, memory_plan
from lumo.weights import GDNWeights, ModelWeights

GB = 1e9


def time_decode(runner: GPURunner, context: int, steps: int, trials: int = 5) -> tuple[float, float]:
    """(median GPU ms per graph-replayed step, ms per step including the host read of each token)."""
    per = []
    for _ in range(trials):
        runner.seek(context)
        for _ in range(3):
            runner.decode_step()
        runner.seek(context)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            runner.decode_step()  # enqueues a replay; the host runs ahead of the GPU
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / steps)
    runner.seek(context)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.decode_step()
        runner.token()
    e2e = (time.perf_counter() - t0) * 1e3 / steps
    return statistics.median(per), e2e


def time_prefill(runner: GPURunner, n: int, vocab: int) -> tuple[float, int]:
    """(seconds, peak bytes allocated during the prefill) of an n-token prompt from an empty slot."""
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    runner.reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    runner.prefill(ids)
    runner.token()
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated()


def kernel_events(prof) -> list[dict]:
    """The profiler's kernel events (device start "ts", duration "dur", name, args with the grid), in
    start order, read from its Chrome trace."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(events, key=lambda e: e["ts"])


def kernel_breakdown(events: list[dict], reps: int, key=lambda e: e["name"]) -> list[dict]:
    """Per key (default: the kernel name), per replay: calls, summed durations ("us") and exclusive time
    ("excl_us").

    Under programmatic dependent launch a kernel starts before its predecessor ends and waits inside
    (pdl_wait), so durations overlap and their sum exceeds the step. The exclusive time gives each instant
    of the run to the kernel that started first among those running (the rest of a chain: its end minus
    the previous end), so it sums to the busy time and shows what each kernel adds to the critical path."""
    agg: dict[str, list[float]] = {}
    prev_end = None
    for e in events:
        start, end = e["ts"], e["ts"] + e["dur"]
        a = agg.setdefault(key(e), [0, 0.0, 0.0])
        a[0] += 1
        a[1] += e["dur"]
        a[2] += max(0.0, end - (start if prev_end is None else max(start, prev_end)))
        prev_end = end if prev_end is None else max(prev_end, end)
    rows = [
        {"name": k, "calls": c / reps, "us": t / reps, "excl_us": x / reps} for k, (c, t, x) in agg.items()
    ]
    return sorted(rows, key=lambda r: -r["excl_us"])


def gemv_by_launch(events: list[dict], reps: int) -> list[dict]:
    """kernel_breakdown's rows of the GEMVs keyed by name, grid and block (a launch configuration: one
    weight shape of the step); the other kernels' time is computed alongside but not returned."""

    def key(e: dict) -> str:
        a = e.get("args", {})
        return f"{e['name']} {a.get('grid')} x {a.get('block')}" if "gemv" in e["name"] else e["name"]

    return [k for k in kernel_breakdown(events, reps, key) if "gemv" in k["name"]]


def profile_step(runner: GPURunner, context: int, steps: int = 5) -> dict:
    """Kernels of `steps` graph-replayed decode steps (eager if the profiler sees no graph kernels)."""
    from torch.profiler import ProfilerActivity, profile

    for use_graph in (True, False):
        runner.seek(context)
        runner.decode_step(use_graph)  # warm
        runner.seek(context)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.decode_step(use_graph)
            torch.cuda.synchronize()
        events = kernel_events(prof)
        if events:
            break
    kernels = kernel_breakdown(events, steps)
    return {
        "mode": "graph" if use_graph else "eager",
        "launches_per_step": sum(k["calls"] for k in kernels),
        "busy_us_per_step": sum(k["excl_us"] for k in kernels),
        "kernels": kernels,
        "gemv_launches": gemv_by_launch(events, steps),
    }


def profile_prefill(runner: GPURunner, n: int, vocab: int) -> dict:
    """Kernels of one n-token prefill (eager, as the runner prefills), exclusive time per kernel name."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    runner.reset()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.prefill(ids)
        torch.cuda.synchronize()
    kernels = kernel_breakdown(kernel_events(prof), 1)
    return {"tokens": n, "busy_ms": sum(k["excl_us"] for k in kernels) / 1e3, "kernels": kernels}


# ---------------------------------------------------------------------------------------------
# The peer: transformers on the same weights in BF16.


def hf_tensors(w: ModelWeights):
    """(checkpoint name, bf16 tensor) of every weight, in transformers' Qwen3_5ForCausalLM names."""

    def deq(lin):
        return lin.dequantize(torch.float32).to(torch.bfloat16)

    yield "model.embed_tokens.weight", w.embed_tokens
    yield "model.norm.weight", w.norm
    yield "lm_head.weight", deq(w.lm_head)
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", lw.input_layernorm
        yield p + "post_attention_layernorm.weight", lw.post_attention_layernorm
        for n in ("gate_proj", "up_proj", "down_proj"):
            yield f"{p}mlp.{n}.weight", deq(getattr(lw.mlp, n))
        m = lw.mixer
        if isinstance(m, GDNWeights):
            q = p + "linear_attn."
            for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
                yield f"{q}{n}.weight", deq(getattr(m, n))
            yield q + "conv1d.weight", m.conv1d[:, None, :]
            yield q + "dt_bias", m.dt_bias
            yield q + "A_log", m.A_log
            yield q + "norm.weight", m.norm
        else:
            q = p + "self_attn."
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                yield f"{q}{n}.weight", deq(getattr(m, n))
            yield q + "q_norm.weight", m.q_norm
            yield q + "k_norm.weight", m.k_norm


@torch.no_grad()
def peer_decode(cfg: ModelConfig, w: ModelWeights, prompt: int, new: int) -> dict:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        layer_types=list(cfg.layer_types),
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        },
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
    )
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in BF16 directly (fp32 first would double the memory)
    try:
        with torch.device("cuda"):
            hf = Qwen3_5ForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    sd = hf.state_dict()
    seen = set()
    for name, t in hf_tensors(w):
        sd[name].copy_(t)
        seen.add(name)
    if missing := set(sd) - seen:
        raise RuntimeError(f"peer weights not set: {sorted(missing)[:5]}")
    hf.generation_config.eos_token_id = None
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(2)  # warm up
    t1, tn = run(1), run(1 + new)
    gib = sum(p.numel() * p.element_size() for p in hf.parameters()) / GB
    return {"ms_per_token": (tn - t1) * 1e3 / new, "prefill_s": t1, "weights_gb": gib}


def truncated(cfg: ModelConfig, gw: GPUWeights, n: int) -> tuple[ModelConfig, GPUWeights]:
    return replace(cfg, layer_types=cfg.layer_types[:n]), replace(gw, layers=gw.layers[:n])


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=64, help="model depth (64 = the real 27B)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    ap.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timing trial")
    ap.add_argument("--peer-layers", type=int, default=64, help="0: no peer; else its depth (BF16)")
    ap.add_argument("--peer-tokens", type=int, default=16)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--prefill-profile", action="store_true", help="kernels of one prefill (first length)")
    ap.add_argument("--bf16-head", action="store_true", help="a bf16 lm_head (as ModelOpt ships it)")
    args = ap.parse_args()

    cfg = config_27b(num_layers=args.layers)
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    w = random_model_weights(cfg, "cuda", nvfp4=True, seed=0, dense_head=args.bf16_head)
    gw = pack_weights(cfg, w, "cuda")
    torch.cuda.synchronize()
    t_pack = time.perf_counter() - t0
    max_len = max(args.contexts + args.prefill) + 4 * args.steps + 64
    runner = GPURunner(cfg, gw, max_len)
    runner.capture()
    print(f"{dev}: copy {bw / GB:.0f} GB/s; weights made + packed in {t_pack:.1f} s; max_len {max_len}")

    decode = []
    for L in args.contexts:
        gpu_ms, e2e_ms = time_decode(runner, L, args.steps)
        floor_ms = step_bytes(cfg, gw, L) / bw * 1e3
        decode.append({"context": L, "ms": gpu_ms, "e2e_ms": e2e_ms, "floor_ms": floor_ms})
        x = gpu_ms / floor_ms
        print(f"decode @ {L}: {gpu_ms:.3f} ms (floor {floor_ms:.3f}, x{x:.2f}), e2e {e2e_ms:.3f}")

    if args.prefill:
        time_prefill(runner, 2048, cfg.vocab_size)  # warm-up: cuBLAS, SDPA, kernels
    prefill = []
    for n in args.prefill:
        s, peak = time_prefill(runner, n, cfg.vocab_size)
        prefill.append({"tokens": n, "s": s, "tok_s": n / s, "peak_gb": peak / GB})
        print(f"prefill {n}: {s:.2f} s, {n / s:.0f} tokens/s, peak {peak / GB:.1f} GB")
    peak_all = torch.cuda.max_memory_allocated()
    min_splits = 16 if torch.cuda.get_device_capability()[0] >= 9 else 8  # clusters take the rest at M > 8
    plan = memory_plan(cfg, max_len, partial_min_splits=min_splits)

    prof = None if args.no_profile else profile_step(runner, args.contexts[0])
    pprof = None
    if args.prefill_profile and args.prefill:
        pprof = profile_prefill(runner, args.prefill[0], cfg.vocab_size)
    peer = None
    if args.peer_layers:
        n = min(args.peer_layers, cfg.num_layers)
        ours_ms = decode[0]["e2e_ms"]
        if n != cfg.num_layers:
            c2, g2 = truncated(cfg, gw, n)
            r2 = GPURunner(c2, g2, args.contexts[0] + 4 * args.steps + 64)
            r2.capture()
            ours_ms = time_decode(r2, args.contexts[0], args.steps)[1]
            del r2
        del runner, gw
        torch.cuda.empty_cache()
        wp = replace(w, layers=w.layers[:n])
        p = peer_decode(replace(cfg, layer_types=cfg.layer_types[:n]), wp, args.contexts[0], args.peer_tokens)
        torch.cuda.empty_cache()
        peer = {"layers": n, **p, "ours_ms_per_token": ours_ms, "speedup": p["ms_per_token"] / ours_ms}

    # ---- the table ----
    head = ", bf16 lm_head" if args.bf16_head else ""
    print(f"\n## bench_decode: {dev}, 27B config ({cfg.num_layers} layers), random NVFP4 weights{head}")
    wgb = linear_weight_bytes(cfg) / GB
    print(f"copy bandwidth {bw / GB:.0f} GB/s (read + write); linear weights {wgb:.2f} GB\n")
    print("| context | step ms (graph) | floor ms | x floor | e2e ms | tokens/s |")
    print("|---|---|---|---|---|---|")
    for d in decode:
        x = d["ms"] / d["floor_ms"]
        print(
            f"| {d['context']} | {d['ms']:.3f} | {d['floor_ms']:.3f} | {x:.2f} | {d['e2e_ms']:.3f} | "
            f"{1e3 / d['e2e_ms']:.1f} |"
        )
    for p in prefill:
        tail = f"{p['tok_s']:.0f} (peak {p['peak_gb']:.1f} GB)"
        print(f"| prefill {p['tokens']} | {p['s']:.2f} s | | | | {tail} |")
    print(
        f"\npeak GPU memory {peak_all / GB:.1f} GB (plan for max_len {max_len}: "
        f"{sum(plan.values()) / GB:.1f} GB: " + ", ".join(f"{k} {v / GB:.2f}" for k, v in plan.items()) + ")"
    )
    if peer:
        print(
            f"peer: transformers Qwen3_5ForCausalLM.generate, BF16, {peer['layers']} layers "
            f"({peer['weights_gb']:.1f} GB), 1k context: {peer['ms_per_token']:.1f} ms/token vs lumo "
            f"{peer['ours_ms_per_token']:.2f} ms/token: lumo x{peer['speedup']:.1f}"
        )
    if prof:
        step = decode[0]["ms"] * 1e3
        print(
            f"profile ({prof['mode']}, context {args.contexts[0]}): "
            f"{prof['launches_per_step']:.0f} launches/step, "
            f"kernels busy {prof['busy_us_per_step']:.0f} us of {step:.0f} us "
            f"(idle {max(step - prof['busy_us_per_step'], 0):.0f} us)"
        )
        print("| kernel | calls/step | exclusive us/step | % of step | summed durations us/step |")
        print("|---|---|---|---|---|")
        for k in prof["kernels"][:15]:
            x = k["excl_us"]
            print(f"| {k['name'][:60]} | {k['calls']:.0f} | {x:.1f} | {100 * x / step:.1f} | {k['us']:.1f} |")
        print("\nGEMV launches by configuration (grid x block: one weight shape each), per step:")
        print("| GEMV grid x block | calls/step | exclusive us/step | us/call | summed durations us/step |")
        print("|---|---|---|---|---|")
        for k in prof["gemv_launches"]:
            x, c = k["excl_us"], k["calls"]
            print(f"| {k['name'][:70]} | {c:.0f} | {x:.1f} | {x / max(c, 1):.2f} | {k['us']:.1f} |")

    if pprof:
        print(f"\nprefill profile ({pprof['tokens']} tokens, eager): kernels busy {pprof['busy_ms']:.1f} ms")
        print("| kernel | calls | exclusive ms | summed durations ms |")
        print("|---|---|---|---|")
        for k in pprof["kernels"][:15]:
            print(f"| {k['name'][:70]} | {k['calls']:.0f} | {k['excl_us'] / 1e3:.2f} | {k['us'] / 1e3:.2f} |")

    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / "bench_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "device": dev,
        "copy_bandwidth_gbs": bw / GB,
        "layers": cfg.num_layers,
        "decode": decode,
        "prefill": prefill,
        "peak_gb": peak_all / GB,
        "memory_plan_gb": {k: v / GB for k, v in plan.items()},
        "peer": peer,
        "prefill_profile": pprof,
        "profile": prof,
    }
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
