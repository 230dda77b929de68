"""bench/ab.py on the CPU: variants set GPURunner attributes in fresh processes, interleaved over rounds;
unknown names and malformed variants are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
SCRIPT = """
import sys
from lumo.engine.runner import GPURunner
from lumo.kernels import gdn, linear
print(f"args {sys.argv[1:]}")
t = 1 + GPURunner.fuse_gdn_norm + (0.5 if linear.L2_PREFETCH_BYTES == 5 else 0)
t += 0.25 if gdn.CHUNKED_MIN_TOKENS == 7 else 0
print(f"decode @ 1024: {t:.3f} ms (floor 1.0, x1.00)")
print("27B verify ms (32 rows)                 9.507")
"""


def ab(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "fake_bench.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, str(ROOT / "bench" / "ab.py"), *args, "--", str(script), "--x", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_variants_set_attributes_in_each_process(tmp_path):
    p = ab(
        tmp_path,
        "--rounds",
        "2",
        "--variant",
        "fuse_gdn_norm=0",
        "--variant",
        "fuse_gdn_norm=1,linear.L2_PREFETCH_BYTES=5",
        "--variant",
        "gdn.CHUNKED_MIN_TOKENS=7",
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.count("## round") == 6 and out.index("round 1: fuse_gdn_norm=0") < out.index(
        "round 1: fuse_gdn_norm=1"
    )
    assert "| fuse_gdn_norm=0 | decode @ 1024 | 1 | 1 / 1 |" in out
    assert "| fuse_gdn_norm=1,linear.L2_PREFETCH_BYTES=5 | decode @ 1024 | 2.5 | 2.5 / 2.5 |" in out
    assert "| fuse_gdn_norm=0 | 27B verify ms (32 rows) | 9.507 | 9.507 / 9.507 |" in out
    assert (
        "| gdn.CHUNKED_MIN_TOKENS=7 | decode @ 1024 | 2.25 | 2.25 / 2.25 |" in out
    )  # any lumo.kernels module


def test_unknown_names_and_bad_variants_are_refused(tmp_path):
    p = ab(tmp_path, "--rounds", "1", "--variant", "no_such_flag=1")
    assert "no_such_flag is not an attribute of GPURunner" in p.stdout
    assert "decode @" not in p.stdout.split("| variant |")[1]  # nothing measured
    p = ab(tmp_path, "--rounds", "1", "--variant", "gdn.NO_SUCH=1")
    assert "gdn.NO_SUCH is not an attribute of lumo.kernels.gdn" in p.stdout
    p = ab(tmp_path, "--variant", "fuse_gdn_norm=yes")
    assert p.returncode == 2 and "NAME=INT" in p.stderr
