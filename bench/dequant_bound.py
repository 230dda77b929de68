"""Lower bound on the ALU instructions of linear.cu's dequant8 (fp4.cuh), the bit-placement dequantisation.

dequant8 turns one 32-bit word of eight E2M1 codes into four bf16x2 mma registers. Each register takes its
value bits at the same eight positions T (m, e0, e1 at bf16 bits 6, 7, 8 and the sign at 15, both halves);
the packing (linear.py:pack_nvfp4) may put each code bit anywhere in the word. With rotations (SHF) and
masks (LOP3) as the instructions, a register built from p pieces (rotl(w, r) & mask, OR-ed) costs p LOP3,
and each rotation other than 0 one SHF. Every rotation r can supply only the bits T - r, 8 of the 32, so
at least 4 rotations are needed, and exactly 4 (or 4 one-piece registers) would tile Z_32 with translates
of T. T is 16-periodic, so that is a tiling of Z_16 by translates of {6, 7, 8, 15}, and none exists (checked
below). Hence >= 5 rotations (4 SHF) and >= 5 pieces: 9 instructions, what dequant8 spends.

Run: python -m bench.dequant_bound (pure Python, no GPU). Session 26 also ran an integer program over two
words with cross-word funnel shifts (SHF.L of two different words): its optimum was 18, two words' 9 each,
under the constraint that each word's unrotated copy is one register's piece (see docs/kernels.md).
"""

from __future__ import annotations

import itertools

TARGETS = (6, 7, 8, 15)  # bf16 bits of m, e0, e1, sign (the high half: + 16)


def tilings(period: int = 16, shape: tuple[int, ...] = TARGETS) -> list[tuple[int, ...]]:
    """Translates t_1 < .. < t_n (t_1 = 0) whose shifted copies of `shape` partition Z_period."""
    n = period // len(shape)
    found = []
    for rest in itertools.combinations(range(1, period), n - 1):
        cover = [(s - t) % period for t in (0, *rest) for s in shape]
        if len(set(cover)) == period:
            found.append((0, *rest))
    return found


def main() -> None:
    found = tilings()
    print(f"tilings of Z_16 by 4 translates of {set(TARGETS)}: {len(found)}")
    if found:
        print("a 4-rotation packing exists:", found[0])
    else:
        print("so a word needs >= 5 rotations (4 SHF) and >= 5 masked pieces (LOP3): >= 9 ALU instructions;")
        print("dequant8 spends 9 (rotations 0, 4, 10 and 6 + 30 for the last register)")


if __name__ == "__main__":
    main()
