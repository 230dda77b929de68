"""bench/trace_step.py's summaries on the CPU, from synthetic records: the GEMV table and the row kernels'
phases and boundaries come out as the records say (the script itself needs a GPU)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

_BENCH = str(Path(__file__).parents[1] / "bench")
sys.path.insert(0, _BENCH)  # trace_step imports bench_decode from its own folder
try:
    trace_step = importlib.import_module("trace_step")
finally:
    sys.path.remove(_BENCH)


def launch(
    kind: int, key: int, ctas: int, start: int, wait: int, p2: int, p4: int, end: int
) -> list[list[int]]:
    """Records of one launch whose CTAs all carry the same stamps (ns)."""
    return [[start, wait, p2, end, p4, kind, (c % 4) << 32 | ctas, key] for c in range(ctas)]


def test_row_kernel_phases_and_boundaries(capsys):
    # norm (1 CTA) -> GEMV (8 CTAs) -> GDN (4 CTAs) -> GEMV, at known times (ns)
    rec = launch(2, 11, 1, 0, 1000, 1700, 0, 2500)
    rec += launch(0, 100, 8, 2000, 3400, 9000, 0, 10000)
    rec += launch(1, 22, 4, 10500, 11800, 13400, 15700, 16500)
    rec += launch(0, 101, 8, 15000, 17000, 21000, 0, 22000)
    trace_step.report_rows(rec)
    out = capsys.readouterr().out
    assert "4 traced launches over 21 us; 3 us of it between" in out  # 0.9 + 1.8 + 0.5
    gdn = next(line for line in out.splitlines() if line.startswith("gdn_recurrent_norm"))
    # early 1.3, before 1.8 (GEMV end 10.0 -> wait 11.8), load 1.6, work 2.3, end 0.8, span 4.7, after 0.5
    assert gdn.split()[1:10] == ["1", "4", "1.30", "1.80", "1.60", "2.30", "0.80", "4.70", "0.50"]
    norm = next(line for line in out.splitlines() if line.startswith("rmsnorm1p_residual"))
    # early 1.0, no launch before it, load 0.7, no work stamp, end 0.8, span 1.5, after 0.9 (2.5 -> 3.4)
    assert norm.split()[1:10] == ["1", "1", "1.00", "nan", "0.70", "nan", "0.80", "1.50", "0.90"]


def test_gemv_table_reads_only_the_gemv_records(capsys):
    rec = launch(0, 100, 8, 2000, 3400, 9000, 0, 10000) + launch(0, 101, 8, 15000, 17000, 21000, 0, 22000)
    weights = {100: ("5120->10240", 30_000_000), 101: ("6144->5120", 18_000_000)}
    trace_step.report(rec, weights, 3e12, 4)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("6144->5120"))
    # ideal 18 MB / 3 TB/s = 6.0 us, span 5.0 (17.0 -> 22.0), gap 7.0 (10.0 -> 17.0), early 2.0
    cols = row.split()
    assert (
        cols[1:4] == ["1", "8", "18.0"]
        and cols[4:7] == ["6.0", "5.0", "120.0"]
        and cols[12:14] == ["7.0", "2.0"]
    )
