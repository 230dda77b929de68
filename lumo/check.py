"""`lumo check`: is this machine and this checkpoint ready to serve, and does lumo compute what it should?

One line per check, `ok`, `FAIL` or `skip`, then a summary; the exit code is 0 when nothing failed, 1
otherwise (2 for a user error such as a wrong path, as every command). The checks:

- environment: Python, torch, cuda-bindings and NVRTC versions; the GPU, its architecture and memory.
- kernels: every CUDA kernel source of the package compiled through NVRTC for the target architectures
  (`--arch`, default: the GPU's, or sm_121a, the DGX Spark's, without one), so a machine can check the
  builds for a GB10 before it has one. Cached on disk (LUMO_CACHE_DIR): a second run takes no time.
- model: the checkpoint loads (configuration, every tensor, quantisation formats, tokenizer); its layers,
  parameters, MTP head, context, and on a GPU the memory the weights take.
- generation: a short greedy request through the engine lumo serves with (backend, speculation).
- exactness: with speculative decoding, its tokens against plain decoding's on the same weights, which
  lumo promises to be identical (greedy and seeded sampling).
- reference (`--reference`; by default for checkpoints under 2 GB, whose fp32 CPU forward is quick): the
  engine's logprobs of a prompt against lumo's plain fp32 CPU model (lumo.model), within bf16 error.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .config import FULL
from .engine.grammar import StructuredOutputs
from .engine.sampling import SamplingParams

CHECK_PROMPTS = ["def fibonacci(n):\n", "The capital of France is", "import os\nimport sys\n\n"]
REFERENCE_BYTES = 2e9  # the reference check runs by default for checkpoints below this size


class Report:
    def __init__(self, out: Callable[[str], None] = print):
        self.out, self.failed, self.results = out, 0, []

    def line(self, status: str, name: str, text: str) -> None:
        self.results.append((status, name, text))
        self.failed += status == "FAIL"
        self.out(f"[{status:>4}] {name}: {text}")

    def run(self, name: str, fn: Callable[[], str | None]):
        """fn's text is an ok line; SkipCheck a skip line; any other exception a FAIL line (not a crash:
        the checks after it still run)."""
        try:
            text = fn()
        except SkipCheck as e:
            self.line("skip", name, str(e))
        except Exception as e:  # a failed check is reported, the rest still run
            self.line("FAIL", name, f"{type(e).__name__}: {e}")
        else:
            self.line("ok", name, text or "")


class SkipCheck(Exception):
    pass


def environment() -> str:
    from cuda import bindings

    from .kernels.compile import nvrtc_version

    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    parts += [f"cuda-bindings {bindings.__version__}", "NVRTC {}.{}".format(*nvrtc_version())]
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        parts.append(f"GPU {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB)")
    else:
        parts.append("no CUDA GPU (the CPU reference model serves)")
    return ", ".join(parts)


def default_arches() -> list[str]:
    if torch.cuda.is_available():
        from .kernels.compile import arch_of

        return [arch_of(0)]
    return ["sm_121a"]


def compile_kernels(arches: list[str]) -> str:
    """Every kernel source's builds (their `lumo:test-defines` lines, as CI compiles them) for each arch."""
    from .kernels.compile import cached_cubin, compile_test_defines, define_options, kernel_sources

    jobs = [
        (p, d, a) for a in arches for p in kernel_sources() for d in compile_test_defines(p)
    ]  # fmt: skip
    t0 = time.perf_counter()

    def build(job):
        p, d, a = job
        try:
            cached_cubin(p.read_text(), a, define_options(d), p.name)
        except Exception as e:
            return f"{p.name} {d} for {a}: {str(e).splitlines()[0]}"
        return None

    with ThreadPoolExecutor() as pool:
        errors = [e for e in pool.map(build, jobs) if e]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(jobs)} builds failed; first: {errors[0]}")
    names, secs = len({p for p, _, _ in jobs}), time.perf_counter() - t0
    return f"{len(jobs)} builds of {names} sources for {', '.join(arches)} in {secs:.1f} s"


def describe_model(llm) -> str:
    cfg = llm.config
    n, full = len(cfg.layer_types), sum(t == FULL for t in cfg.layer_types)
    text = f"{llm.model_name}: {n} layers ({n - full} GDN, {full} attention), "
    text += f"vocabulary {cfg.vocab_size}, context {llm.max_model_len}, "
    text += f"backend {llm.backend} on {llm.device}, speculation {llm.spec}"
    if llm.device.type == "cuda":
        text += f", {torch.cuda.memory_allocated(llm.device) / 2**30:.2f} GiB on the GPU after loading"
    return text


def generate(llm, tokens: int) -> str:
    room = llm.max_model_len  # a short --max-model-len shortens the prompt and the output, not the check
    if room < 2:
        raise SkipCheck(f"a {room}-token context holds no prompt and a token")
    tokens = min(tokens, room // 2)
    ids = llm.tokenizer.encode(CHECK_PROMPTS[0])[: room - tokens]
    r = llm.generate(ids, max_tokens=tokens, temperature=0)
    if not r.token_ids:
        raise RuntimeError("no tokens generated")
    rate = (len(r.token_ids) - 1) / r.decode_seconds if len(r.token_ids) > 1 and r.decode_seconds else 0.0
    return f"{len(r.token_ids)} tokens, first after {r.prefill_seconds * 1e3:.0f} ms, {rate:.1f} tokens/s"


# A JSON grammar that keeps the check's tokens inside it (an object closed early leaves only end tokens)
LONG_JSON = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 64}},
    "required": ["text"],
    "additionalProperties": False,
}


def exactness_settings(i: int, bias: tuple) -> list[tuple[SamplingParams, StructuredOutputs | None]]:
    """spec_equals_plain's settings for prompt i (a logit bias of two of its tokens)."""
    return [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=0.8, top_p=0.95, seed=i), None),
        (
            SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=i, presence_penalty=1.5, min_p=0.02),
            None,
        ),
        (SamplingParams(temperature=0.0, logit_bias=bias), None),
        (SamplingParams(temperature=0.8, seed=i), StructuredOutputs(json=LONG_JSON)),
    ]


@torch.inference_mode()
def spec_equals_plain(llm, tokens: int) -> str:
    """Speculative and plain decoders on the same weights emit the same tokens (greedy, seeded, seeded
    with Qwen's recommended presence penalty and min-p: a verify row's penalties see its drafted path,
    greedy under a logit bias on two of the prompt's tokens, and seeded under a JSON grammar: each verify
    row masked with its path's grammar state)."""
    if llm.spec == "off":
        raise SkipCheck("speculative decoding is off (no MTP head, or --spec off)")
    events, accepted, requests = 0, 0, 0
    for i, prompt in enumerate(CHECK_PROMPTS):
        ids = llm.tokenizer.encode(prompt)
        bias = tuple(sorted({ids[len(ids) // 2]: 3.0, ids[-1]: -100.0}.items()))
        for params, structured in exactness_settings(i, bias):
            got = []
            for spec in ("off", llm.spec):  # events only: adaptive plain steps would test plain decoding
                dec = llm.decoder(params, len(ids) + tokens + 64, spec=spec, adaptive=False)
                if structured is not None:
                    dec.constraint = llm.constraint(structured, ids)
                out = dec.prefill(ids)
                while len(out) < tokens:
                    out += dec.step()
                got.append(out[:tokens])
            if got[0] != got[1]:
                where = next(j for j, (a, b) in enumerate(zip(*got, strict=True)) if a != b)
                raise RuntimeError(
                    f"{llm.spec} decoding left plain decoding at token {where} of prompt {prompt!r} "
                    f"(temperature {params.temperature})"
                )
            stats = dec.stats
            if stats.events == 0:
                raise RuntimeError(f"no speculative event ran for prompt {prompt!r}")
            events, accepted = events + stats.events, accepted + sum(stats.accepted)
            requests += 1
    mean = accepted / events if events else 0.0
    same = f"{requests} requests x {tokens} tokens identical to plain decoding"
    return f"{same} ({mean:.2f} accepted drafts/event)"


def against_reference(llm) -> str:
    """The engine's logprobs (of a prompt's tokens, and of the tokens it generates after it) against
    lumo.model in fp32 on the CPU, token by token."""
    from . import model as M
    from .weights import load_model

    room = llm.max_model_len  # a short --max-model-len shortens the prompt, not the check
    if room < 8:
        raise SkipCheck(f"a {room}-token context is too short to compare")
    new = min(16, room // 4)
    ids = llm.tokenizer.encode("".join(CHECK_PROMPTS) * 4)[: min(64, room - new)]
    r = llm.generate(ids, max_tokens=new, temperature=0, logprobs=0, prompt_logprobs=0)
    got = [*r.prompt_logprobs[1:], *r.logprobs]
    # lazy: the one forward reads a layer at a time (a whole 27B model in fp32 would need 108 GB)
    overrides = getattr(llm, "hf_overrides", None)  # the engine's config.json, --hf-overrides and all
    cfg, w = load_model(
        llm.path, device="cpu", dtype=torch.float32, progress=False, lazy=True, overrides=overrides
    )
    with torch.inference_mode():
        logits, _ = M.forward(cfg, w, torch.tensor([ids + r.token_ids[:-1]]))
    ref = torch.log_softmax(logits[0].double(), dim=-1)
    diff = torch.tensor([abs(t.logprob - float(ref[i, t.token])) for i, t in enumerate(got)])
    median, worst = diff.median().item(), diff.max().item()
    tol = 1e-3 if llm.dtype == torch.float32 else 0.05  # fp32 engine: summation order; bf16: its rounding
    if median > tol or worst > 10 * tol:
        raise RuntimeError(
            f"logprobs differ from the fp32 reference by {median:.4f} (median) / {worst:.4f} (max); "
            f"allowed {tol} / {10 * tol}"
        )
    n = f"{len(got)} logprobs ({len(ids) - 1} prompt, {len(r.logprobs)} generated tokens)"
    return f"{n} within {median:.4f} (median), {worst:.4f} (max) of the fp32 CPU model"


def run_check(args, make_llm: Callable[[], object], out: Callable[[str], None] = print) -> int:
    rep = Report(out)
    rep.run("environment", environment)
    if args.skip_kernels:
        rep.line("skip", "kernels", "--skip-kernels")
    else:
        rep.run("kernels", lambda: compile_kernels(args.arch or default_arches()))
    holder = []

    def load() -> str:
        t0 = time.perf_counter()
        holder.append(make_llm())
        return f"{describe_model(holder[0])}, loaded in {time.perf_counter() - t0:.1f} s"

    rep.run("model", load)
    if not holder:  # nothing to run the rest on
        for name in ("generation", "exactness", "reference"):
            rep.line("skip", name, "the model did not load")
    else:
        llm = holder[0]
        rep.run("generation", lambda: generate(llm, args.tokens))
        rep.run("exactness", lambda: spec_equals_plain(llm, args.tokens))
        size = checkpoint_bytes(llm.path)
        if args.reference is False or (args.reference is None and size >= REFERENCE_BYTES):
            why = "--no-reference" if args.reference is False else f"a {size / 1e9:.1f} GB checkpoint"
            rep.line("skip", "reference", f"{why} (--reference compares with an fp32 CPU forward)")
        else:
            rep.run("reference", lambda: against_reference(llm))
    ok = sum(s == "ok" for s, _, _ in rep.results)
    skipped = sum(s == "skip" for s, _, _ in rep.results)
    out(f"lumo check: {ok} ok, {rep.failed} failed, {skipped} skipped")
    return 1 if rep.failed else 0


def checkpoint_bytes(path) -> int:
    """Bytes of the checkpoint's weight files."""
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
