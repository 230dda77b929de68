"""CPU: packing ModelWeights for the GPU kernels (fusion bookkeeping, exact packed values), the random
27B-shaped weight generator, and the runner's memory plan against the reference model's own caches."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from lumo import model as M
from lumo.config import ModelConfig
from lumo.engine.gpu_decode import GPUBackend
from lumo.engine.gpu_weights import (
    GPUGDN,
    GPUAttn,
    config_27b,
    draft_quant,
    nvfp4_copy,
    pack_linear,
    pack_weights,
    random_model_weights,
    swiglu_scratch,
)
from lumo.engine.llm import embedded_model_path
from lumo.engine.prefix import PrefixCache
from lumo.engine.runner import linear_weight_bytes, memory_plan, splitk_partial_bytes
from lumo.kernels.attention import attn_decode_workspace
from lumo.kernels.linear import nvfp4_linear, pack_fused, unpack_nvfp4
from lumo.quant import fp8_quantize, nvfp4_quantize
from lumo.weights import DenseLinear, FP8Linear, NVFP4Linear, load_model


def dequantized(gl) -> torch.Tensor:
    """f32 [N, K] of a GPULinear, part by part, from the packed/dense tensors the kernels read."""
    rows = []
    for p in gl.parts:
        rows.append(unpack_nvfp4(p.packed) if p.packed is not None else p.weight.float())
    return torch.cat(rows)


@pytest.fixture(scope="module")
def tiny_nvfp4():
    path = embedded_model_path().parent / "lumo-tiny-nvfp4"
    if not (path / "config.json").exists():
        pytest.skip("lumo-tiny-nvfp4 is not in lumo/assets")
    cfg, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    return cfg, w, pack_weights(cfg, w, "cpu")


def test_fused_linears_hold_the_checkpoint_values(tiny_nvfp4):
    cfg, w, gw = tiny_nvfp4
    for lw, g in zip(w.layers, gw.layers, strict=True):
        m, gm = lw.mixer, g.mixer
        if isinstance(gm, GPUGDN):
            pairs = [
                (gm.qkvz, [m.in_proj_qkv, m.in_proj_z]),
                (gm.ba, [m.in_proj_b, m.in_proj_a]),
                (gm.out_proj, [m.out_proj]),
            ]
            assert torch.equal(gm.A_log, m.A_log.float()) and gm.conv1d.shape == m.conv1d.shape
        else:
            assert isinstance(gm, GPUAttn)
            pairs = [(gm.qkv, [m.q_proj, m.k_proj, m.v_proj]), (gm.o_proj, [m.o_proj])]
        pairs += [(g.gate_up, [lw.mlp.gate_proj, lw.mlp.up_proj]), (g.down, [lw.mlp.down_proj])]
        for gl, lins in pairs:
            if gl is g.gate_up:  # NVFP4 gate and up: packed for the fused SwiGLU, output [M, I]
                assert gl.glu and gl.shard_sizes == (lins[0].shape[0],)
            else:
                assert not gl.glu and gl.shard_sizes == tuple(lin.shape[0] for lin in lins)
            assert gl.k == lins[0].shape[1] and gl.n == sum(gl.shard_sizes)
            want = torch.cat([lin.dequantize(torch.float32) for lin in lins])
            assert torch.equal(dequantized(gl), want)
            # one launch per run of equal kinds: the embedded NVFP4 model fuses every group into one part
            assert len(gl.parts) == 1
    assert torch.equal(dequantized(gw.lm_head), w.lm_head.dequantize(torch.float32))


def test_mixed_kinds_become_parts_in_order():
    gen = torch.Generator().manual_seed(3)
    K = 96

    def fp4(n):
        return NVFP4Linear(*nvfp4_quantize(torch.randn(n, K, generator=gen)))

    dense = DenseLinear(torch.randn(10, K, generator=gen).to(torch.bfloat16))
    fp8 = FP8Linear(*fp8_quantize(torch.randn(6, K, generator=gen)))
    lins = [fp4(40), fp4(24), dense, fp8, fp4(8)]
    gl = pack_linear(lins, "cpu")
    assert [p.packed is not None for p in gl.parts] == [True, False, True]
    assert [p.n for p in gl.parts] == [64, 16, 8] and gl.shard_sizes == (40, 24, 10, 6, 8)
    # FP8 is dequantised to bf16 once (one rounding of float(w) * scale)
    assert torch.equal(gl.parts[1].weight[10:], fp8.dequantize(torch.float32).to(torch.bfloat16))
    want = torch.cat([lin.dequantize(torch.float32) for lin in lins])
    got = dequantized(gl)
    assert torch.equal(got[:64], want[:64]) and torch.equal(got[80:], want[80:])
    assert torch.equal(got[64:74], want[64:74])  # bf16 dense: exact
    y = torch.zeros(3, gl.n)
    assert [t.shape[-1] for t in gl.split(y)] == [40, 24, 10, 6, 8]


@pytest.mark.parametrize("i", [40, 44, 3])
def test_glu_packing_interleaves_gate_and_up(i):
    """pack_fused(glu=True): m16 tile T holds gate rows 8T..8T+7 then up rows 8T..8T+7 (each shard zero
    padded to a multiple of 8 rows, scales and global scales moved with their rows); unpack_nvfp4 gives
    back [gate | up]. A gate / up pair of mixed kinds stays a plain fused linear."""
    gen = torch.Generator().manual_seed(i)
    K = 80
    gate, up = (NVFP4Linear(*nvfp4_quantize(torch.randn(i, K, generator=gen) * s)) for s in (1.0, 3.0))
    gl = pack_linear([gate, up], "cpu", glu=True)
    packed = gl.parts[0].packed
    i8 = -(-i // 8) * 8
    assert gl.glu and packed.glu_n == i and packed.n == 2 * i8 and gl.n == i
    want = torch.cat([gate.dequantize(torch.float32), up.dequantize(torch.float32)])
    assert torch.equal(unpack_nvfp4(packed), want)
    gs = packed.gs[: 2 * i8].view(-1, 2, 8)  # [tile, gate / up, row]
    for h, lin in enumerate((gate, up)):
        assert (gs[:, h].flatten()[:i] == lin.weight_scale_2).all() and (gs[:, h].flatten()[i:] == 0).all()
    # the interleaved-rows workspace a caller may lend nvfp4_linear is checked before any launch
    x = torch.randn(2, K, generator=gen).to(torch.bfloat16)
    for bad in (
        torch.empty(2, 2 * i8 + 8, dtype=torch.bfloat16),
        torch.empty(1, 2 * i8, dtype=torch.bfloat16),
    ):
        with pytest.raises(ValueError, match="rows"):
            nvfp4_linear(x, packed, rows=bad)
    scratch = swiglu_scratch([SimpleNamespace(gate_up=gl)], 3, "cpu")
    assert scratch.numel() == 3 * 2 * i8 and gl.scratch_width == 2 * i8
    dense = DenseLinear(torch.randn(i, K, generator=gen).to(torch.bfloat16))
    mixed = pack_linear([gate, dense], "cpu", glu=True)
    assert not mixed.glu and mixed.shard_sizes == (i, i)
    with pytest.raises(ValueError, match="glu"):
        pack_fused([(gate.weight, gate.weight_scale, gate.weight_scale_2)], glu=True)


def shrunk_27b(vocab_size: int, hidden_size: int, intermediate_size: int, head_dim: int) -> ModelConfig:
    """The 27B config at 4 layers with small widths: 4 / 2 attention heads, 2 / 4 GDN key / value heads,
    every head head_dim wide."""
    return replace(
        config_27b(num_layers=4, vocab_size=vocab_size),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
    )


@pytest.mark.parametrize("nvfp4", [True, False], ids=["nvfp4", "bf16"])
def test_random_weights_run_through_the_reference_and_byte_count(nvfp4):
    small = shrunk_27b(vocab_size=200, hidden_size=64, intermediate_size=96, head_dim=32)
    w = random_model_weights(small, "cpu", nvfp4=nvfp4, seed=1)
    ids = torch.randint(0, small.vocab_size, (1, 13), generator=torch.Generator().manual_seed(0))
    logits, _ = M.forward(small, w, ids)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    gw = pack_weights(small, w, "cpu")
    assert gw.nbytes() == linear_weight_bytes(small, nvfp4=nvfp4)


def test_memory_plan_counts_the_split_k_partials():
    """Packing allocates no split-K partials (the first launch that needs one does, [S, 32, N] f32); the
    plan counts 32 rows for the weights of >= min_splits slices, with the slice counts the packer chose."""
    wide = shrunk_27b(vocab_size=300, hidden_size=1024, intermediate_size=2048, head_dim=64)
    gw = pack_weights(wide, random_model_weights(wide, "cpu", nvfp4=True, seed=2), "cpu")
    lins = [gw.lm_head] + [lin for lw in gw.layers for lin in (lw.gate_up, lw.down)]
    lins += [lin for lw in gw.layers for lin in vars(lw.mixer).values() if hasattr(lin, "parts")]
    packed = [p.packed for lin in lins for p in lin.parts if p.packed is not None]
    assert all(p.partial is None for p in packed)
    for min_splits in (2, 4, 8):
        want = sum(4 * p.splits * 32 * p.n for p in packed if p.splits > 1 and p.splits >= min_splits)
        assert splitk_partial_bytes(wide, min_splits) == want
    assert splitk_partial_bytes(wide, 2) > splitk_partial_bytes(wide, 4) > 0


def test_memory_plan_matches_the_reference_cache():
    cfg = config_27b(num_layers=8, vocab_size=512)
    L = 300
    cache = M.new_cache(cfg, L, dtype=torch.bfloat16)

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    plan = memory_plan(cfg, L, chunk=64)
    assert plan["kv_cache"] == nbytes(cache.kv_k + cache.kv_v)
    assert plan["gdn_state"] == nbytes(cache.gdn_state)
    assert plan["conv_state"] == nbytes(cache.conv_state)
    attn_ws = attn_decode_workspace(1, cfg.num_attention_heads, cfg.head_dim, L, "cpu")
    assert plan["decode_buffers"] > nbytes(attn_ws)  # the attention partials are counted whole
    pc = PrefixCache(chunk=64, capacity=2)  # what the runner's snapshots hold: states + the hidden row
    hidden = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
    for n in (64, 128):
        pc.add(n, [*cache.gdn_state, *cache.conv_state, hidden])
    assert memory_plan(cfg, L, chunk=64, prefix_snapshots=2)["prefix_snapshots"] == pc.nbytes()
    # at most: prefix_lines parked prefixes, each with as many snapshots and prefix_park positions of K/V
    # copied aside, and one line's positions more (the peak of a swap, which parks the slot's prefix before
    # it frees the swapped one's), beside the slot's own snapshots
    for lines in (1, 2, 3):
        pc = PrefixCache(chunk=64, capacity=2, park=128, window=1000, lines=lines)
        state = [*cache.gdn_state, *cache.conv_state, hidden]
        for i in range(lines + 1):
            pc.resume(
                list(range(i * 1000, i * 1000 + 200)), state, positions=cache.kv_k + cache.kv_v, written=200
            )
            for n in (64, 128):
                pc.add(n, state)
        assert len(pc.lines) == lines
        assert all(p.hi - p.lo == 128 and len(p.snapshots) == 2 for p in pc.lines)
        plan = memory_plan(cfg, L, chunk=64, prefix_snapshots=2, prefix_park=128, prefix_lines=lines)
        assert plan["prefix_snapshots"] + plan["prefix_parked"] == pc.nbytes() + nbytes(pc.lines[0].saved)
    for snaps, park, lines in ((0, 100, 2), (2, 0, 2), (2, 100, 0)):
        plan = memory_plan(cfg, L, chunk=64, prefix_snapshots=snaps, prefix_park=park, prefix_lines=lines)
        assert plan["prefix_parked"] == 0
    # the 128k plan on the 27B model fits a GB10 (128 GB shared with the OS) with a wide margin
    big = memory_plan(config_27b(), 131072)
    assert sum(big.values()) < 40e9
    # sm_90+ counts only the 16-slice weights: the 64 down projections (17408 -> 5120), 32 rows each
    assert big["splitk_partials"] == 64 * 16 * 32 * 5120 * 4


def test_backend_capacity_rounding(tiny_nvfp4):
    cfg, w, _ = tiny_nvfp4
    be = GPUBackend(cfg, w, max_model_len=10000, device="cpu")
    assert [be.capacity_for(n) for n in (1, 4096, 4097, 9000, 10000)] == [4096, 4096, 8192, 10000, 10000]
    with pytest.raises(ValueError, match="exceed"):
        be.capacity_for(10001)


def test_nvfp4_copy_block_by_block_equals_the_whole_quantisation(monkeypatch):
    """nvfp4_copy quantises QUANT_ROWS rows at a time with the whole weight's global scale: the bits of
    lumo.quant.nvfp4_quantize on the whole weight (dense and FP8 sources; an NVFP4 one is kept)."""
    from lumo.engine import gpu_weights

    monkeypatch.setattr(gpu_weights, "QUANT_ROWS", 7)
    w = torch.randn(100, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for lin, ref in ((DenseLinear(w), w), (FP8Linear(*fp8_quantize(w)), None)):
        ref = FP8Linear(*fp8_quantize(w)).dequantize(torch.float32) if ref is None else ref
        got, want = nvfp4_copy(lin, "cpu"), nvfp4_quantize(ref)
        assert torch.equal(got.weight, want[0])
        assert torch.equal(got.weight_scale.view(torch.uint8), want[1].view(torch.uint8))
        assert torch.equal(got.weight_scale_2, want[2])
    assert nvfp4_copy(got, "cpu").weight is got.weight


def test_nvfp4_drafter_packing(tiny_nvfp4):
    """draft_quant: auto is NVFP4 for an NVFP4 target only. An NVFP4 drafter of the BF16 model packs the
    MTP head and a draft head (an NVFP4 copy of the whole lm_head, ids None) in NVFP4, within NVFP4's error
    of the BF16 weights; the NVFP4 model's lm_head is NVFP4 already, so its drafter shares it."""
    cfg, w_q, _ = tiny_nvfp4
    cfg, w = load_model(embedded_model_path(), device="cpu", dtype=torch.bfloat16, progress=False)
    assert draft_quant(w_q) and not draft_quant(w)
    assert draft_quant(w, "nvfp4") and not draft_quant(w_q, "none")
    gw = pack_weights(cfg, w, "cpu", mtp=True, draft_nvfp4=True)
    head = gw.mtp.draft_head
    assert gw.mtp.draft_ids is None and [p.packed is not None for p in head.parts] == [True]
    ref = w.lm_head.weight.float()
    assert (dequantized(head) - ref).norm() / ref.norm() < 0.15
    fc = gw.mtp.fc
    assert all(p.packed is not None for p in fc.parts)
    assert (dequantized(fc) - w.mtp.fc.weight.float()).norm() / w.mtp.fc.weight.float().norm() < 0.15
    gq = pack_weights(cfg, w_q, "cpu", mtp=True, draft_nvfp4=True)
    assert isinstance(w_q.lm_head, NVFP4Linear) == (gq.mtp.draft_head is None)
