"""What the first request after start-up pays, and what `LLM.warm_up` (run by `lumo serve`) moves before it.

On the kernels backend the first request compiles the kernels it runs (NVRTC; cubins cached on disk under
$LUMO_CACHE_DIR), allocates the runner and captures the decode graphs. Each row is a fresh process:
- cold: an empty kernel cache (the first start on a machine, or after a lumo upgrade);
- disk: the cubins on disk from the run before (every later start);
- warm_up: as disk, with `llm.warm_up()` before the first request (what `lumo serve` does).
Columns: load (LLM()), warm-up, the first request (a 512-token prompt, 32 tokens greedy, the LLM's default
decoding: tree speculation with an MTP head), a second request, all in seconds. The floor of the first
request is the second's time. One table, printed last.
    python bench/bench_first_request.py [--model lumo/assets/lumo-tiny-nvfp4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ONE = """
import json, sys, time
t0 = time.perf_counter()
from lumo.engine.llm import LLM
llm = LLM(sys.argv[1], device="cuda")
t1 = time.perf_counter()
warm = llm.warm_up() if sys.argv[2] == "1" else 0.0
ids = list(range(1000, 1512))
times = []
for _ in range(2):
    s = time.perf_counter()
    llm.generate(ids, max_tokens=32, temperature=0, ignore_eos=True)
    times.append(time.perf_counter() - s)
print(json.dumps({"load": t1 - t0, "warm_up": warm, "first": times[0], "second": times[1], "spec": llm.spec}))
"""


def one(model: str, cache: str, warm: bool) -> dict:
    env = {**os.environ, "LUMO_CACHE_DIR": cache}
    out = subprocess.run(
        [sys.executable, "-c", ONE, model, "1" if warm else "0"], env=env, capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lumo/assets/lumo-tiny-nvfp4")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for name, warm in (("cold", False), ("disk", False), ("warm_up", True)):
            rows.append({"case": name, **one(args.model, cache, warm)})
    print(f"first request after start-up, {args.model} ({rows[0]['spec']} decoding), seconds; {time.ctime()}")
    print(f"{'case':<8} {'load':>7} {'warm-up':>8} {'first':>8} {'second (floor)':>15} {'first/second':>13}")
    for r in rows:
        ratio = r["first"] / r["second"]
        times = f"{r['load']:7.2f} {r['warm_up']:8.2f} {r['first']:8.3f} {r['second']:15.3f}"
        print(f"{r['case']:<8} {times} {ratio:13.1f}")


if __name__ == "__main__":
    main()
