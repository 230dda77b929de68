"""bench/dequant_bound.py: the tiling check behind dequant8's 9-instruction lower bound."""

from bench.dequant_bound import TARGETS, tilings
from lumo.kernels.linear import _BITS


def test_tiling_search_finds_tilings_that_exist():
    assert (0, 4, 8, 12) in tilings(16, (0, 1, 2, 3))
    assert (0, 1, 4, 5) in tilings(8, (0, 2))


def test_no_four_rotation_packing_of_the_bf16_targets():
    assert tilings(16, TARGETS) == []


def test_the_packing_uses_five_rotations():
    # linear.py's packing: register A, B, C from rotl 0, 4, 10; D from rotl 6 (m) and 30 (the rest).
    rots = set()
    for q, bits in enumerate(_BITS):
        for target, pos in zip(TARGETS, bits, strict=True):
            rots.add((target + 16 * (q % 2) - pos) % 32)
    assert rots == {0, 4, 10, 6, 30}
