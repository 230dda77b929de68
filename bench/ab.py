"""A/B of launch choices in whole processes, variants interleaved over rounds, one table of medians.

Each variant runs a benchmark script in a fresh Python process with runner class attributes or
lumo.kernels module constants set first; the lines that matter are printed as they come.

    python bench/ab.py --rounds 2 --variant stage_gdn_out_proj=0 --variant stage_gdn_out_proj=1 \\
        -- bench/bench_decode.py --contexts 1024 --prefill --peer-layers 0 --no-profile

A variant is a comma-separated list of NAME=VALUE: NAME a class attribute of GPURunner
(`fuse_gdn_norm`, `stage_gdn_out_proj`, ...) or `MODULE.NAME` a module constant of lumo.kernels.MODULE
(`linear.L2_PREFETCH_BYTES`, `gdn.TRIGGER`); VALUE an integer (0 / 1 for a flag). Only names that already
exist are set, so a typo fails instead of measuring the default twice. Whole processes, because a launch
choice often changes what gets compiled and cached per process, and because processes differ by more than
the effects measured here (sessions 19-24: ~10-40 us at 1k on the 27B step): compare within one call,
over rounds.
"""

from __future__ import annotations

import argparse
import re
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

# `decode @ 1024: 5.221 ms ...` (bench_decode.py) and `27B verify ms (32 rows)   9.507` (bench_spec.py)
DEFAULT_PATTERN = (
    r"decode @ \d+: [\d.]+ ms|27B (?:verify ms \(\d+ rows\)|plain decode step ms \(floor\))\s+[\d.]+"
)


def parse_variant(text: str) -> dict[str, int]:
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if (
            not sep
            or not re.fullmatch(r"([a-z_]\w*\.)?[A-Za-z_]\w*", name)
            or not re.fullmatch(r"-?\d+", value)
        ):
            raise ValueError(f"a variant is NAME=INT[,NAME=INT...], got {item!r}")
        out[name] = int(value)
    return out


def apply(settings: dict[str, int]) -> None:
    """Set the attributes in this process (the child), refusing names that do not exist."""
    import importlib

    from lumo.engine.runner import GPURunner

    for name, value in settings.items():
        module, _, attr = name.rpartition(".")
        owner = importlib.import_module(f"lumo.kernels.{module}") if module else GPURunner
        if not hasattr(owner, attr):
            raise SystemExit(f"ab.py: {name} is not an attribute of {owner.__name__}")
        old = getattr(owner, attr)
        setattr(owner, attr, bool(value) if isinstance(old, bool) else value)


def measurements(line: str, pattern: str) -> list[tuple[str, float]]:
    """(label, last number) of each match of `pattern` in a line of the script's output."""
    out = []
    for m in re.finditer(pattern, line):
        text = m.group(0)
        label, number = re.match(r"(.*?)[:\s]*([\d.]+)(?: ms)?$", text).groups()
        out.append((label.strip(), float(number)))
    return out


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":  # python bench/ab.py --child VARIANT SCRIPT ARGS...
        apply(parse_variant(sys.argv[2]))
        script = sys.argv[3]
        sys.argv = sys.argv[3:]
        sys.path.insert(0, str(Path(script).resolve().parent))
        runpy.run_path(script, run_name="__main__")
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME=INT[,NAME=INT...] (repeat)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pattern", default=DEFAULT_PATTERN, help="regex of the lines' measurements")
    ap.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = ap.parse_args()
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("give the benchmark after --")
    try:
        variants = [(v, parse_variant(v)) for v in args.variant]
    except ValueError as e:
        ap.error(str(e))
    results: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for text, _ in variants:
            print(f"## round {r + 1}: {text}", flush=True)
            cmd = [sys.executable, __file__, "--child", text, *script]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            for line in proc.stdout.splitlines():
                found = measurements(line, args.pattern)
                if found:
                    print(line, flush=True)
                for label, value in found:
                    results.setdefault((text, label), []).append(value)
            if proc.returncode != 0:
                print(
                    proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"
                )
    print("\n| variant | measurement | median | runs |\n|---|---|---|---|")
    for (text, label), values in results.items():
        runs = " / ".join(f"{v:g}" for v in values)
        print(f"| {text} | {label} | {statistics.median(values):g} | {runs} |")


if __name__ == "__main__":
    main()
