"""CPU dry run of the GPU speculative engine (lumo/engine/gpu_spec.py) on lumo-tiny with every kernel launch
stubbed: each launcher's shape / dtype / stride / alignment checks run on the engine's real buffers through a
prefill and three events. The stubs that produce indices behave like their kernels' index semantics (top-k
writes candidates through the draft node table, the sampler writes choices, tree_accept runs the reference
walk), so the commit, the MTP feed and the length bookkeeping see real accepted paths (siblings included).
Numerics are not checked here (the stubs compute nothing): that is tests/test_gpu_spec_gpu.py's job."""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import weakref
from collections import Counter

import pytest
import torch

from lumo import model as M
from lumo.config import ConfigError, TreeConfig
from lumo.engine.decode import SpecDecoder
from lumo.engine.gpu_decode import GPUDecoder
from lumo.engine.gpu_spec import GPUSpecDecoder, GPUSpecEngine
from lumo.engine.gpu_weights import pack_weights
from lumo.engine.llm import embedded_model_path
from lumo.engine.runner import GPURunner
from lumo.engine.sampling import SamplingParams, TokenHistory, bias_vector, penalize, sample
from lumo.engine.tree import accept, build_tree
from lumo.testing import ScriptedAdaptive
from lumo.weights import load_model

# attention._kernels: chunk, chunk pipelined (plain decode), chunk (tree rows), merge (plain), merge (tree)
ATTENTION_KERNELS = (
    "attn_decode_chunk",
    "attn_decode_chunk_pipe",
    "attn_tree_chunk",
    "attn_decode_merge",
    "attn_decode_merge_head",
)

# The modules themselves (lumo.kernels re-exports functions under some module names, e.g. gdn_tree).
attention, conv, gdn, gdn_tree, linear, norms, rope_kv, sampling, token_mask, tree_ops = (
    importlib.import_module(f"lumo.kernels.{m}")
    for m in (
        "attention", "conv", "gdn", "gdn_tree", "linear", "norms", "rope_kv", "sampling", "token_mask",
        "tree_ops",
    )
)  # fmt: skip


class StubKernel:
    def __init__(self, name: str, log: Counter, gen: torch.Generator, V: int):
        self.name, self.log, self.gen, self.V = name, log, gen, V

    def blocks_per_sm(self, block: int, shmem: int) -> int:
        return 1

    def launch(self, grid, block, args, shmem: int = 0, pdl: bool = False) -> None:
        self.log[self.name] += 1
        if self.name == "topk_final":  # [workspace, nb, k, out, tokens, nodes]
            out, tokens, nodes = args[3], args[4], args[5]
            ids = torch.randint(0, 3, out.shape, generator=self.gen, dtype=torch.int32)
            out.copy_(ids)
            if isinstance(tokens, torch.Tensor):
                for t, r in zip(*torch.nonzero(nodes >= 0, as_tuple=True), strict=True):
                    tokens[nodes[t, r]] = ids[t, r]
        elif self.name == "sample_final":  # [*5 params, min_p, val, idx, ssum, keys, out, count_out, V, nb]
            out = args[10]
            out.copy_(torch.randint(0, 3, out.shape, generator=self.gen, dtype=torch.int32))
        elif self.name == "tree_accept":  # [tokens, choice, parent, n_nodes, cap, accepted, result, counts]
            tokens, choice, parent, n, cap, acc, res, _ = args
            self.log["accept_inputs"] += 1
            tree = self.tree
            path, pending = accept(tree, tokens.tolist(), choice.tolist())
            emitted = [int(tokens[i]) for i in path[1:]] + [pending]
            acc.copy_(torch.tensor(path + [-1] * (cap - len(path)), dtype=torch.int32))
            res.copy_(torch.tensor([len(path), pending] + emitted + [-1] * (cap - len(emitted))))
            self.log["accepted_total"] += len(path)


@pytest.fixture
def stubbed(monkeypatch):
    log: Counter = Counter()
    gen = torch.Generator().manual_seed(0)
    holder: dict = {}

    def factory(name: str) -> StubKernel:
        kern = StubKernel(name, log, gen, 0)
        kern.tree = holder.get("tree")
        return kern

    def attn_kernels(*a, **k):  # attention._kernels
        return tuple(StubKernel(n, log, gen, 0) for n in ATTENTION_KERNELS)

    def named(name):
        return lambda *a, **k: factory(name)

    monkeypatch.setattr(linear, "_kernel", lambda *a, **k: factory(a[0]))
    monkeypatch.setattr(linear, "_bf16_kernel", lambda *a, **k: factory("bf16_gemv"))
    monkeypatch.setattr(norms, "_kernel", lambda *a, **k: factory(a[0]))
    monkeypatch.setattr(rope_kv, "_kernel", named("qk_norm_rope_kv"))
    monkeypatch.setattr(conv, "_kernel", lambda *a, **k: factory(a[0]))
    monkeypatch.setattr(conv, "_qk_kernel", lambda *a, **k: factory("conv_gather_qk"))
    monkeypatch.setattr(gdn, "_kernel", named("gdn_recurrent"))
    monkeypatch.setattr(gdn_tree, "_kernel", named("gdn_tree"))
    monkeypatch.setattr(tree_ops, "_kernel", lambda *a, **k: factory(a[0]))
    monkeypatch.setattr(attention, "_kernels", attn_kernels)
    monkeypatch.setattr(sampling, "_kernel", lambda *a, **k: factory(a[0]))
    monkeypatch.setattr(token_mask, "_kernel", named("apply_token_mask"))
    return log, holder


@functools.cache
def tokenizer():
    from lumo.tokenizer import Tokenizer

    return Tokenizer.from_dir(embedded_model_path())


def model_path(name: str = "lumo-tiny"):
    return embedded_model_path().parent / name


@functools.cache
def w32(name: str = "lumo-tiny"):
    return load_model(model_path(name), device="cpu", dtype=torch.float32, progress=False)[1]


# A draft vocabulary whose logits columns differ from their token ids (column j is token 2j below 3065),
# so a missing map shows: the even ids and the added tokens.
DRAFT_IDS = sorted({*range(0, 2400, 2), *range(3065, 3072)})
# A logit bias that changes the embedded model's greedy output on the tests' prompt (' and' banned,
# "')" lifted, '.startswith' lowered: tokens of that output).
BIAS = ((446, -100.0), (650, 1.5), (2232, -5.0))
# min_tokens: the end token lifted to the top, banned (with the other end token) below the prompt's length
# + 9 (ban_until here counts from the prompt's end; the test adds the prompt's length)
MIN_TOKENS = dict(logit_bias=((3067, 50.0),), stop_ids=(3065, 3067), ban_until=9)


@functools.cache
def tiny(draft: bool = False, name: str = "lumo-tiny", draft_nvfp4: bool = False):
    path = model_path(name)
    cfg, w = load_model(path, device="cpu", dtype=torch.bfloat16, progress=False)
    ids = DRAFT_IDS if draft else None
    return cfg, pack_weights(cfg, w, "cpu", mtp=True, draft_ids=ids, draft_nvfp4=draft_nvfp4)


@pytest.mark.parametrize(
    "tree", [TreeConfig(), TreeConfig(depth=4, topk=2, budget=6, rows=8)], ids=["default", "d4"]
)
def test_one_event_dry_run(stubbed, tree):
    log, holder = stubbed
    holder["tree"] = build_tree(tree)
    cfg, gw = tiny()
    runner = GPURunner(cfg, gw, max_len=256, prefill_chunk=40, device="cpu")
    dec = GPUSpecDecoder(runner, SamplingParams(temperature=0.0), tree)
    prompt = list(range(5, 5 + 97))  # 3 prefill chunks: the MTP carry row crosses chunk boundaries
    first = dec.prefill(prompt)
    assert first == [int(runner.tok)] and runner.length == len(prompt) and int(runner.pos) == len(prompt)
    n_gdn = cfg.num_layers - len(cfg.full_attention_layers)
    total = 0
    for _ in range(3):
        before = Counter(log)
        out = dec.step()
        total += len(out)
        assert 1 <= len(out) <= tree.depth + 1
        assert runner.length == len(prompt) + total == int(runner.pos)
        assert int(runner.sample_pos) == runner.length + 1 and int(runner.tok) == out[-1]
        assert int(dec.engine.tokens[0]) == out[-1]  # the new root
        per_event = log - before
        assert per_event["gdn_tree"] == n_gdn and per_event["gdn_recurrent"] == n_gdn  # verify + replay
        assert per_event["tree_accept"] == 1 and per_event["kv_remap"] == 1
        assert per_event["topk_final"] == tree.depth  # one candidate selection per depth
        assert per_event["conv_state_commit"] == n_gdn and per_event["conv_gather_qk"] == n_gdn
    assert dec.stats.events == 3 and sum(dec.stats.accepted) == total - 3
    assert dec.engine.extra_bytes() > 0


# ---------------------------------------------------------------------------------------------
# The engine's index logic with real numbers: every launcher replaced by a row-by-row CPU emulation
# built on the kernels' own torch references (each row computed alone, so the emulation is batch
# invariant like the kernels). Then tree decoding must reproduce plain decoding over the same
# emulated ops token for token, and the committed GDN / conv / K/V state bitwise.


def _emulated_ops():
    from lumo.kernels.attention import attn_decode_ref
    from lumo.kernels.conv import conv_gather_ref, conv_pred_chain, conv_prefill_ref, conv_state_commit_ref
    from lumo.kernels.gdn import gdn_decode_ref
    from lumo.kernels.gdn_tree import gdn_qk_ref, gdn_tree_ref, gdn_tree_written
    from lumo.kernels.linear import unpack_nvfp4
    from lumo.kernels.norms import gated_rmsnorm_ref, rmsnorm1p_ref, silu_mul_ref
    from lumo.kernels.sampling import sample_tokens_ref
    from lumo.kernels.token_mask import apply_token_mask_ref as apply_token_mask  # noqa: F401 (in locals())
    from lumo.kernels.tree_ops import topk_select_ref

    bf = torch.bfloat16

    cache: dict = {}

    def rows_linear(x, key, make_w, out):
        # f64 products and sums, rounded once to bf16: any row grouping gives the same bf16 bits (short of
        # a 2^-40-rare tie), so one matmul per call stands in for a batch-invariant kernel.
        if key not in cache:
            cache[key] = make_w().double()
        out = torch.empty(x.shape[0], cache[key].shape[0], dtype=bf) if out is None else out
        return out.copy_(x.double() @ cache[key].t())

    def nvfp4_linear(x, packed, out=None, conv=None, **k):
        if packed.glu_n:  # fused SwiGLU: [gate | up] rows, then the activation
            y = silu_mul_ref(rows_linear(x, packed.qw.data_ptr(), lambda: unpack_nvfp4(packed), None))
            return y if out is None else out.copy_(y)
        y = rows_linear(x, packed.qw.data_ptr(), lambda: unpack_nvfp4(packed), out)
        if conv is not None:  # the GEMV-fused decode conv: conv_decode's bits
            conv_decode(y[:, : conv[0].shape[0]], conv[0], conv[1], out=conv[2])
        return y

    def bf16_linear(x, w, out=None, workspace=None):
        return rows_linear(x, w.data_ptr(), lambda: w, out)

    def bf16_linear_partials(x, w, workspace):  # the bf16 result and a zero slice: their sum is exact
        y = bf16_linear(x, w).float()
        return torch.stack([y, torch.zeros_like(y)])

    def rmsnorm1p(h, w, eps, delta=None, out=None):
        y, hn = rmsnorm1p_ref(h, w, eps, delta)
        if delta is not None:
            h.copy_(hn)
        out = torch.empty_like(h) if out is None else out
        return out.copy_(y)

    def silu_mul(gu, out=None):
        y = silu_mul_ref(gu)
        return y if out is None else out.copy_(y)

    def gated_rmsnorm(o, z, w, eps, out=None):
        y = gated_rmsnorm_ref(o, z, w, eps)
        return y.to(bf) if out is None else out.copy_(y)

    def rope(x, pos, inv_freq, scale=1.0):
        x, rd = x.float(), 2 * inv_freq.numel()
        f = pos.float()[:, None] * inv_freq
        cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        cos, sin = cos * scale, sin * scale
        xr = x[..., :rd]
        rot = torch.cat([-xr[..., rd // 2 :], xr[..., : rd // 2]], dim=-1)
        return torch.cat([xr * cos + rot * sin, x[..., rd:]], dim=-1)

    def qk_norm_rope_kv(
        qg, k, v, q_norm, k_norm, positions, slots, kc, vc, inv_freq, eps, q_out=None, rope_scale=1.0
    ):
        d = k.shape[-1]
        q = rope(rmsnorm1p_ref(qg[..., :d], q_norm, eps)[0], positions, inv_freq, rope_scale)
        kk = rope(rmsnorm1p_ref(k, k_norm, eps)[0], positions, inv_freq, rope_scale)
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                kc[s], vc[s] = kk[t].to(bf), v[t]
        q_out = torch.empty(q.shape, dtype=bf) if q_out is None else q_out
        return q_out.copy_(q)

    def attn_decode(q, kc, vc, length, mask, gate=None, out=None, workspace=None):
        rows = [
            attn_decode_ref(q[t : t + 1], kc, vc, length, mask[t : t + 1], gate[t : t + 1])
            for t in range(q.shape[0])
        ]
        out = torch.empty_like(q) if out is None else out
        return out.copy_(torch.cat(rows))

    def conv_gather(x, w, state, pred, out=None):
        y = conv_gather_ref(x, w, state, pred)  # per (row, channel): a K-term sum, independent of T
        out = torch.empty(x.shape[0], x.shape[1], dtype=bf) if out is None else out
        return out.copy_(y)

    def conv_gather_qk(x, w, state, pred, heads, out=None, qk=None):
        y = conv_gather(x, w, state, pred, out)
        return y, qk.copy_(gdn_qk_ref(y, heads))

    def conv_prefill(x, w, state, out=None):
        y, s = conv_prefill_ref(x, w, state)
        state.copy_(s)
        return y.to(bf) if out is None else out.copy_(y)

    def conv_state_commit(state, x, rows):
        state.copy_(conv_state_commit_ref(state, x, rows.tolist()))

    def conv_decode(x, w, state, out=None):  # the plain step: gather over the state, then commit row 0
        y = conv_gather(x, w, state, conv_pred_chain(1, w.shape[1]), out)
        conv_state_commit(state, x, torch.zeros(1, dtype=torch.int32))
        return y

    def gdn_decode(
        mixed,
        a,
        b,
        A_log,
        dt_bias,
        state,
        out=None,
        state_out=None,
        out_dtype=bf,
        rows=None,
        count=None,
        ba_splitk=None,
    ):
        if ba_splitk is not None:  # the b/a projection's split-K partials: their slice-order sum in bf16
            a, b = (p.sum(0, keepdim=True).to(bf) for p in ba_splitk)
        idx = list(range(mixed.shape[0])) if rows is None else rows.tolist()
        n = len(idx) if count is None else min(len(idx), int(count[0]))
        idx = idx[:n]
        o = (
            torch.empty(len(idx) if rows is None else rows.shape[0], *state.shape[::2], dtype=out_dtype)
            if out is None
            else out
        )
        for i in idx:  # token by token: what one decode launch per token gives
            oi, s = gdn_decode_ref(mixed[i : i + 1], a[i : i + 1], b[i : i + 1], A_log, dt_bias, state)
            (state if state_out is None else state_out).copy_(s)
            state = state if state_out is None else state_out
            o[idx.index(i) if rows is not None else i] = oi[0]
        return o

    def gdn_decode_norm(mixed, a, b, A_log, dt_bias, state, z, norm_w, eps, out=None, ba_splitk=None):
        o = gdn_decode(mixed, a, b, A_log, dt_bias, state, ba_splitk=ba_splitk)  # bf16 o, as the kernel
        return gated_rmsnorm(o, z, norm_w, eps, out=out)

    def gdn_prefill(mixed, a, b, A_log, dt_bias, state, out=None, state_out=None, out_dtype=bf):
        return gdn_decode(mixed, a, b, A_log, dt_bias, state, out, state_out, out_dtype)

    def gdn_tree(mixed, a, b, A_log, dt_bias, state, items, items_len, out=None, out_dtype=bf, qk=None):
        nk, dk = (mixed.shape[1] - state.shape[0] * state.shape[2]) // (2 * state.shape[1]), state.shape[1]
        # the engine hands over the qk of this layer's rows (a stale or another layer's qk fails here)
        assert qk is not None and torch.equal(qk, gdn_qk_ref(mixed, (nk, state.shape[0], dk, state.shape[2])))
        o = gdn_tree_ref(mixed, a, b, A_log, dt_bias, state, items, items_len)
        keep = gdn_tree_written(items, items_len, mixed.shape[0])[:, None, None]
        return out.copy_(torch.where(keep, o.to(bf), out))

    def sample_tokens(
        logits, temperature, top_k, top_p, seed, position, out=None, workspace=None, **shaping
    ):  # shaping: min_p, penalties, count_out
        return out.copy_(sample_tokens_ref(logits, temperature, top_k, top_p, seed, position, **shaping))

    def topk_select(
        logits, k, out=None, tokens=None, nodes=None, workspace=None, id_map=None, penalties=None, n_path=0
    ):
        if penalties is not None:  # the drafter under the bias and penalties: history = counts + the spine
            params = penalties.settings(0)
            cols = torch.arange(logits.shape[1]) if id_map is None else id_map.long()
            if params.logit_bias:  # bias [V_all] indexed by token id: the columns' entries
                logits = logits.float() + bias_vector(params.logit_bias, penalties.bias.numel())[cols]
            if params.penalized:
                history = penalties.history(extra=tokens[1 : 1 + n_path].tolist()).select(cols)
                logits = penalize(logits[0], params, history)[None]
        ids = topk_select_ref(logits, k)
        ids = ids if id_map is None else id_map[ids.long()]
        out.copy_(ids)
        for t, r in zip(*torch.nonzero(nodes >= 0, as_tuple=True), strict=True):
            tokens[nodes[t, r]] = ids[t, r]
        return out

    def tree_accept(tokens, choice, parent, n_nodes, accepted, result, cap, count_out=None):
        par = parent.tolist()
        path, u = [0], 0
        while True:
            nxt = next((c for c in range(n_nodes) if par[c] == u and tokens[c] == choice[u]), None)
            if nxt is None or len(path) == cap:
                break
            path.append(nxt)
            u = nxt
        pending = int(choice[u])
        em = [int(tokens[i]) for i in path[1:]] + [pending]
        if count_out is not None:
            for t in em:
                count_out[t] += 1
        accepted.copy_(torch.tensor(path + [-1] * (cap - len(path))))
        result.copy_(torch.tensor([len(path), pending] + em + [-1] * (cap - len(em))))
        return accepted, result

    def kv_remap(table, accepted, count, length):
        acc, L = accepted.tolist()[: int(count[0])], int(length[0])
        for j, a in enumerate(acc):
            if a != j:
                for c in table.caches:
                    c[L + j] = c[L + a]

    return locals()


def _install_emulation(monkeypatch) -> None:
    """Every launcher the engine imports replaced by its row-by-row emulation."""
    ops = _emulated_ops()
    for mod in ("lumo.engine.runner", "lumo.engine.gpu_spec", "lumo.engine.gpu_weights"):
        m = importlib.import_module(mod)
        for name, fn in ops.items():
            if callable(fn) and hasattr(m, name):
                monkeypatch.setattr(m, name, fn)


@pytest.mark.parametrize("name", ["lumo-tiny", "lumo-tiny-nvfp4"], ids=["bf16", "nvfp4"])
@pytest.mark.parametrize(
    "params,draft",
    [
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=0.7, top_k=20, seed=5), False),
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=0.7, top_k=20, seed=5), True),
        (SamplingParams(temperature=0.0, presence_penalty=1.5, repetition_penalty=1.2), False),
        (SamplingParams(temperature=0.8, seed=9, min_p=0.05, frequency_penalty=0.6, top_p=0.9), False),
        (SamplingParams(temperature=0.0, logit_bias=BIAS), False),
        (SamplingParams(temperature=0.7, top_k=20, seed=5, presence_penalty=1.0, logit_bias=BIAS), True),
        (SamplingParams(temperature=0.0, **MIN_TOKENS), False),
        (SamplingParams(temperature=0.8, seed=2, **MIN_TOKENS), False),
    ],
    ids=[
        "greedy",
        "seeded",
        "greedy-draft-vocab",
        "seeded-draft-vocab",
        "greedy-penalized",
        "seeded-penalized",
        "greedy-biased",
        "seeded-biased-draft-vocab",
        "greedy-min-tokens",
        "seeded-min-tokens",
    ],
)
def test_emulated_tree_decoding_equals_plain(monkeypatch, params, draft, name):
    """Tree decoding == plain decoding, with the whole vocabulary and with a draft vocabulary (the draft
    head's logits checked against the reference drafter's on the same token ids); BF16 and NVFP4 (its MLPs
    packed for the fused SwiGLU)."""
    _install_emulation(monkeypatch)
    cfg, gw = tiny(draft, name)
    if name.endswith("nvfp4"):
        assert all(lw.gate_up.glu for lw in gw.layers)
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    # prefill chunks of 10: the MTP's carried row crosses chunk boundaries (same chunking for both runners)
    rp, rs = (GPURunner(cfg, gw, 64, prefill_chunk=10, device="cpu") for _ in range(2))
    prompt = tokenizer().encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n")
    if params.stop_ids:  # the ban's end counts from the prompt's end in the parametrisation
        params = dataclasses.replace(params, ban_until=len(prompt) + params.ban_until)
    spec = GPUSpecDecoder(rs, params, tree)
    plain = GPUDecoder(rp, params, use_graph=False)
    # Greedy: the MTP path (prefill pairs, feed, draft steps) against the fp32 reference SpecDecoder: the
    # next draft step's logits within bf16 noise (a position off by one gives 3-20%), compared while the
    # two agree on the tokens (bf16 vs fp32 may part at a near-tie).
    ids = DRAFT_IDS if draft else None
    # (Penalised and biased runs skip it: their drafts are the adjusted logits' top-k; checked without.)
    check_mtp = params.greedy and not params.penalized and not params.logit_bias and not params.stop_ids
    ref = SpecDecoder(cfg, w32(name), params, 64, "cpu", torch.float32, tree, ids) if check_mtp else None
    got = spec.prefill(prompt)
    compared = 0
    if ref is not None and ref.prefill(prompt) != got:
        ref = None
    eng, path_nodes = spec.engine, spec.engine.tb.path_nodes()
    while len(got) < 16:
        counts, L = rs.counts.clone(), rs.length  # the committed history before the event
        out = spec.step()
        got += out
        if params.penalized or params.logit_bias or params.stop_ids:  # every node's choice: its logits, path
            for i in range(eng.tb.n_nodes):
                history = TokenHistory.of(counts, rs.prompt_mask.bool())
                history = history.with_tokens(int(eng.tokens[j]) for j in path_nodes[i].tolist() if j >= 0)
                want = sample(eng.logits[i], params, L + int(eng.tb.depth[i]) + 1, history)
                assert int(eng.choice[i]) == want, f"node {i}"
        if draft:  # every candidate the drafter proposed is a draft-vocabulary token
            assert set(spec.engine.cand.flatten().tolist()) <= set(DRAFT_IDS)
        banned = {i for i, v in params.logit_bias if v <= -100}  # the drafter proposes under the bias
        assert not banned & set(spec.engine.cand.flatten().tolist())
        if ref is not None and ref.step() == out:
            lg, want_lg = spec.engine.draft_logits[0], ref.draft_logits
            if draft:
                assert lg.numel() == len(DRAFT_IDS)
                want_lg = want_lg[torch.tensor(DRAFT_IDS)]
            assert (lg - want_lg).norm() / want_lg.norm() < 0.02
            compared += 1
        else:
            ref = None
    assert not check_mtp or compared >= 2, "the fp32 reference parted at once: check the prompt"
    want = plain.prefill(prompt)
    while rp.length < rs.length:
        want += plain.step()
    assert got[: len(want)] == want
    if params.stop_ids:  # no stop token below the ban's end, the lifted end token from there on
        k = params.ban_until - len(prompt)
        assert not set(want[:k]) & set(params.stop_ids) and want[k] == 3067
    # The MTP must draft well (the embedded model was trained with it), and siblings must get accepted
    # sometimes (kv_remap moves rows only then).
    mean = sum(spec.stats.accepted) / spec.stats.events
    assert mean > (0.5 if params.greedy and not draft else 0.0), (
        f"drafts rarely accepted: {spec.stats.accepted}"
    )
    for a, b in zip(rs.gdn_state + rs.conv_state, rp.gdn_state + rp.conv_state, strict=True):
        assert torch.equal(a, b)
    L = rs.length
    for a, b in zip(rs.kv_k + rs.kv_v, rp.kv_k + rp.kv_v, strict=True):
        assert torch.equal(a[:L], b[:L])
    # the penalties' history: every emitted token counted once, by the sampler or by tree_accept
    assert torch.equal(rs.counts, rp.counts) and int(rs.counts.sum()) == L - len(prompt) + 1


def _tree_then_plain(cfg, gw, params: SamplingParams, tokens: int):
    """Tree decoding (default-shaped small tree, prefill chunks of 10) of a code prompt for >= `tokens`
    tokens, then plain decoding to the same length on a second runner: (spec, got, want, rs, rp)."""
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    rp, rs = (GPURunner(cfg, gw, 64, prefill_chunk=10, device="cpu") for _ in range(2))
    spec = GPUSpecDecoder(rs, params, tree)
    plain = GPUDecoder(rp, params, use_graph=False)
    prompt = tokenizer().encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n")
    got = spec.prefill(prompt)
    while len(got) < tokens:
        got += spec.step()
    want = plain.prefill(prompt)
    while rp.length < rs.length:
        want += plain.step()
    return spec, got, want, rs, rp


def test_emulated_plain_step_with_the_ba_split_k_sum_equals_tree(monkeypatch):
    """The runner's plain step with a split-K b/a projection (the 27B's: its slices summed by gdn_decode,
    `ba_splitk`, not a reduce launch): the embedded model's b/a is one slice, so its parts are made to
    report a split-K workspace here. Tree decoding (whose verify reduces b/a as before) must still equal
    plain decoding token for token and in the committed state: a swapped (a, b) pair or a lost slice fails."""
    import lumo.engine.runner as runner_mod

    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    for lw in gw.layers:
        if hasattr(lw.mixer, "ba"):
            for part in lw.mixer.ba.parts:
                monkeypatch.setattr(part, "workspace", torch.empty(1))
    used = []

    def recording(name):  # the plain step calls gdn_decode_norm (fused, the default) or gdn_decode
        emulated = getattr(runner_mod, name)

        def call(*a, ba_splitk=None, **k):
            used.append(ba_splitk is not None)
            return emulated(*a, ba_splitk=ba_splitk, **k)

        monkeypatch.setattr(runner_mod, name, call)

    recording("gdn_decode")
    recording("gdn_decode_norm")
    _, got, want, rs, rp = _tree_then_plain(cfg, gw, SamplingParams(temperature=0.0), 12)
    assert any(used), "the plain step did not take the split-K b/a path"
    assert got[: len(want)] == want
    for a, b in zip(rs.gdn_state + rs.conv_state, rp.gdn_state + rp.conv_state, strict=True):
        assert torch.equal(a, b)


def test_no_room_to_capture_runs_eagerly(monkeypatch):
    """use_graph=True with a prompt that leaves no room for capture()'s two warm-up events: the decoder
    runs its events eagerly (same tokens) instead of failing the request."""
    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    prompt = tokenizer().encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n")
    outs = []
    for use_graph in (True, False):
        r = GPURunner(cfg, gw, len(prompt) + 30, prefill_chunk=10, device="cpu")
        dec = GPUSpecDecoder(r, SamplingParams(temperature=0.0), tree, use_graph=use_graph)
        got = dec.prefill(prompt)
        assert not dec.engine.can_capture() and dec.engine.graphs is None
        while len(got) < 12:
            got += dec.step()
        outs.append(got[:12])
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=20, seed=5)],
    ids=["greedy", "seeded"],
)
def test_emulated_tree_decoding_with_an_nvfp4_drafter_equals_plain(monkeypatch, params):
    """The drafter in NVFP4 (draft_quant: NVFP4 copies of the BF16 model's MTP head and lm_head): every
    drafter linear is NVFP4, the target's lm_head stays BF16, and tree decoding still emits plain
    decoding's tokens with the same state; the drafts still get accepted."""
    _install_emulation(monkeypatch)
    cfg, gw = tiny(name="lumo-tiny", draft_nvfp4=True)
    m = gw.mtp
    lins = [m.fc, m.draft_head] + [
        x for lw in m.layers for x in (lw.gate_up, lw.down, lw.mixer.qkv, lw.mixer.o_proj)
    ]
    assert all(part.packed is not None for lin in lins for part in lin.parts)
    assert m.draft_ids is None and m.draft_head.n == cfg.vocab_size
    assert all(part.packed is None for part in gw.lm_head.parts)
    spec, got, want, rs, rp = _tree_then_plain(cfg, gw, params, 24)
    assert got[: len(want)] == want
    assert sum(spec.stats.accepted) / spec.stats.events > (0.5 if params.greedy else 0.0)
    for a, b in zip(rs.gdn_state + rs.conv_state, rp.gdn_state + rp.conv_state, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["tree", "plain"])
def test_emulated_prefix_cache_resume_equals_cold(monkeypatch, kind):
    """The runner's prefix cache (lumo/engine/prefix.py) through the GPU engine's own bookkeeping: a second
    request that shares 37 tokens with the first resumes at the snapshot at 30 (chunks of 10) and then
    equals the same request on a fresh runner: tokens, states, K/V, the MTP's K/V and draft logits."""
    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    params = SamplingParams(temperature=0.7, top_k=20, seed=5)
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    warm_r, cold_r = (GPURunner(cfg, gw, 128, prefill_chunk=10, device="cpu") for _ in range(2))
    warm_r.enable_prefix_cache(3)

    engines = {}  # one per runner, as SpecBackend keeps it: the MTP's K/V live in the engine

    def decoder(r):
        if kind == "plain":
            return GPUDecoder(r, params, use_graph=False)
        return GPUSpecDecoder(engines.setdefault(id(r), GPUSpecEngine(r, tree)), params)

    first = tokenizer().encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n" * 3)
    assert 50 <= len(first) < 60
    d = decoder(warm_r)
    d.prefill(first)
    for _ in range(3):
        d.step()
    assert d.cached_tokens == 0 and sorted(warm_r.prefix.snapshots) == [30, 40, 50]  # 10, 20 evicted
    second = first[:37] + tokenizer().encode("    print(name)\n")
    warm, cold = decoder(warm_r), decoder(cold_r)
    got, want = warm.prefill(second), cold.prefill(second)
    assert (warm.cached_tokens, cold.cached_tokens) == (30, 0)
    assert sorted(warm_r.prefix.snapshots) == list(range(30, len(second) + 1, 10))  # 40, 50 rewritten
    while len(got) < 16:
        got += warm.step()
    while len(want) < len(got):
        want += cold.step()
    assert got == want[: len(got)]
    n = warm_r.length
    assert n == cold_r.length
    for a, b in zip(warm_r.gdn_state + warm_r.conv_state, cold_r.gdn_state + cold_r.conv_state, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(warm_r.kv_k + warm_r.kv_v, cold_r.kv_k + cold_r.kv_v, strict=True):
        assert torch.equal(a[:n], b[:n])
    if kind == "tree":
        ew, ec = warm.engine, cold.engine
        for a, b in zip(ew.mtp_k + ew.mtp_v, ec.mtp_k + ec.mtp_v, strict=True):
            assert torch.equal(a[:n], b[:n])
        assert torch.equal(ew.draft_logits, ec.draft_logits)
        # another engine on the runner has no MTP K/V of those prompts: it starts the prefix cache afresh
        other = GPUSpecDecoder(GPUSpecEngine(warm_r, tree), params)
        other.prefill(second)
        assert other.cached_tokens == 0
        # ... and the runner does not keep it alive: an engine left to the garbage collector could have its
        # CUDA graphs destroyed in the middle of another capture, which invalidates that capture
        gone = weakref.ref(other.engine)
        gc.disable()
        try:
            del other
            assert gone() is None, "a reference cycle keeps the engine alive"
        finally:
            gc.enable()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=20, seed=5)],
    ids=["greedy", "seeded"],
)
def test_emulated_events_and_plain_steps_mixed_equal_plain(monkeypatch, params):
    """Adaptive speculation's plain steps between events (GPUSpecEngine.plain_step): the tokens and the
    committed state are plain decoding's, and after plain steps the drafter (fed by them) still drafts
    what the target accepts."""
    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    rp, rs = (GPURunner(cfg, gw, 96, prefill_chunk=10, device="cpu") for _ in range(2))
    pattern = [True, False, False, True, True, False, True, False, False, False]
    spec = GPUSpecDecoder(rs, params, tree, adaptive=ScriptedAdaptive(pattern))
    plain = GPUDecoder(rp, params, use_graph=False)
    prompt = tokenizer().encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n")
    got = spec.prefill(prompt)
    # Every event's first draft step must come from the drafter's state as it stands (after plain steps:
    # fed by them, its head run before the event): the depth-1 candidates are the top-k of the head over
    # the MTP's output row at the event's start.
    from lumo.kernels.tree_ops import topk_select_ref

    eng, event = spec.engine, spec.engine.event
    firsts = []

    def checked_event(use_graph=False, constraint=None):
        want_ids = topk_select_ref(eng.draft_head(eng.d1.out.clone()).float(), eng.k)
        out = event(use_graph, constraint)
        firsts.append(torch.equal(eng.cand[0], want_ids[0]))
        return out

    monkeypatch.setattr(eng, "event", checked_event)
    while len(got) < 40:
        got += spec.step()
    assert firsts and all(firsts)
    # The MTP's K/V (fed by events and plain steps alike, a row at a time) equal those of tree decoding
    # without plain steps over their common committed positions.
    only = GPUSpecDecoder(GPURunner(cfg, gw, 96, prefill_chunk=10, device="cpu"), params, tree)
    out = only.prefill(prompt)
    while len(out) < 40:
        out += only.step()
    n = min(rs.length, only.engine.runner.length) - 1
    for a, b in zip(eng.mtp_k + eng.mtp_v, only.engine.mtp_k + only.engine.mtp_v, strict=True):
        assert torch.equal(a[:n], b[:n])
    want = plain.prefill(prompt)
    while rp.length < rs.length:
        want += plain.step()
    assert got[: len(want)] == want
    assert spec.stats.plain_steps > 0 and spec.stats.events > 0
    for a, b in zip(rs.gdn_state + rs.conv_state, rp.gdn_state + rp.conv_state, strict=True):
        assert torch.equal(a, b)
    L = rs.length
    for a, b in zip(rs.kv_k + rs.kv_v, rp.kv_k + rp.kv_v, strict=True):
        assert torch.equal(a[:L], b[:L])


def test_emulated_logprobs_of_events_and_plain_steps_equal_plain(monkeypatch):
    """Logprobs (lumo.engine.logprobs) from the GPU engine's code paths: the prefill's row, an event's
    verify rows of the accepted path (engine.accepted), a plain step's row: plain decoding's, exactly."""
    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    rp, rs = (GPURunner(cfg, gw, 96, prefill_chunk=10, device="cpu") for _ in range(2))
    params = SamplingParams(temperature=0.0)
    spec = GPUSpecDecoder(rs, params, tree, adaptive=ScriptedAdaptive([True, False, True, True, False]))
    plain = GPUDecoder(rp, params, use_graph=False)
    spec.logprobs = plain.logprobs = 4
    prompt = tokenizer().encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n")
    got, got_lp = spec.prefill(prompt), list(spec.last_logprobs)
    while len(got) < 40:
        got += spec.step()
        got_lp += spec.last_logprobs
    assert [t.token for t in got_lp] == got and max(spec.stats.accepted) > 0 and spec.stats.plain_steps
    want, want_lp = plain.prefill(prompt), list(plain.last_logprobs)
    while len(want) < len(got):
        want += plain.step()
        want_lp += plain.last_logprobs
    assert got == want and got_lp == want_lp


def test_emulated_prompt_logprobs(monkeypatch):
    """Prompt logprobs from the runner's prefill (its final-norm rows through the lm_head, chunk by chunk):
    plain and speculative decoders agree, the fp32 reference within bf16 error, and a prompt whose prefix
    is cached is still scored from its first token."""
    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    rp, rs = (GPURunner(cfg, gw, 96, prefill_chunk=10, device="cpu") for _ in range(2))
    for r in (rp, rs):
        r.enable_prefix_cache(2)
    params = SamplingParams(temperature=0.0)
    text = "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        print(name)\n"
    prompt = tokenizer().encode(text)
    assert len(prompt) > 20  # three chunks
    out = []
    for dec in (GPUDecoder(rp, params, use_graph=False), GPUSpecDecoder(rs, params, tree)):
        dec.prefill(prompt[:21])  # a cached prefix of 20 tokens
        dec.prompt_logprobs = 3
        first = dec.prefill(prompt)
        scored = dec.last_prompt_logprobs
        assert dec.cached_tokens == 0 and len(scored) == len(prompt) - 1
        assert [t.token for t in scored] == prompt[1:]
        dec.prompt_logprobs = None
        assert dec.prefill(prompt) == first and dec.cached_tokens == 20  # and the cache was rebuilt
        assert dec.last_prompt_logprobs == []
        out.append(scored)
    assert out[0] == out[1]
    logits, _ = M.forward(cfg, w32(), torch.tensor([prompt]))
    ref = torch.log_softmax(logits[0].double(), dim=-1)
    diff = [abs(t.logprob - float(ref[i, t.token])) for i, t in enumerate(out[0])]
    assert max(diff) < 0.1, max(diff)


@pytest.mark.parametrize(
    "params,mutant",
    [
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=0.8, top_k=40, seed=3), False),
        (SamplingParams(temperature=0.0), True),
    ],
    ids=["greedy", "seeded", "mutant-without-row-masks"],
)
def test_emulated_structured_output_equals_plain(monkeypatch, params, mutant):
    """A JSON schema (lumo.engine.grammar) on the GPU engine's code paths: the runner's mask for the
    prefill's sample and plain steps, the verify rows' masks computed between draft and verify
    (GPUSpecEngine.mask_tree), events and adaptive plain steps mixed: plain decoding's tokens and
    logprobs, exactly; the rows the grammar masks are the ones it reaches; the text is the schema's.
    The mutant skips the rows' masks: it must fail (a refused token emitted, or other tokens)."""
    import json

    from lumo.engine.grammar import GrammarCompiler, StructuredOutputs

    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    t = tokenizer()
    compiler = GrammarCompiler(t.to_json(), cfg.vocab_size, t.eos_token_ids)
    schema = {
        "type": "object",
        "properties": {"path": {"type": "string"}, "size": {"type": "integer"}},
        "required": ["path", "size"],
        "additionalProperties": False,
    }
    spec_ = StructuredOutputs(json=schema)
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    rp, rs = (GPURunner(cfg, gw, 96, prefill_chunk=10, device="cpu") for _ in range(2))
    spec = GPUSpecDecoder(rs, params, tree, adaptive=ScriptedAdaptive([True, False, True, True, False]))
    plain = GPUDecoder(rp, params, use_graph=False)
    spec.logprobs = plain.logprobs = 3
    spec.constraint, plain.constraint = compiler.constraint(spec_), compiler.constraint(spec_)
    if mutant:
        monkeypatch.setattr(spec.engine, "mask_tree", lambda constraint, tokens=None: None)
    prompt = t.encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n")
    eos = set(t.eos_token_ids)
    got, got_lp = spec.prefill(prompt), list(spec.last_logprobs)
    masked = 0
    try:
        while len(got) < 40 and not eos & set(got):
            got += spec.step()
            got_lp += spec.last_logprobs
            masked += int(spec.engine.token_masks_on.sum())
    except RuntimeError as e:
        assert mutant and "refuses" in str(e)
        return
    want, want_lp = plain.prefill(prompt), list(plain.last_logprobs)
    while len(want) < len(got):
        want += plain.step()
        want_lp += plain.last_logprobs
    assert (got == want and got_lp == want_lp) != mutant
    if mutant:
        return
    assert spec.stats.events > 0 and spec.stats.plain_steps > 0 and masked > spec.stats.events
    text = t.decode([x for x in want if x not in eos])
    if eos & set(want):
        assert set(json.loads(text)) == {"path", "size"}
    else:
        assert text.lstrip().startswith('{"path":"')


def test_emulated_drafter_proposes_under_the_grammar(monkeypatch):
    """Each draft step's candidates under the grammar's state after the spine (GPUSpecEngine._draft with a
    constraint): the same tokens as without (drafts never change the output), more of them accepted."""
    from lumo.engine.grammar import Constraint, GrammarCompiler, StructuredOutputs

    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    t = tokenizer()
    compiler = GrammarCompiler(t.to_json(), cfg.vocab_size, t.eos_token_ids)
    lines = {"type": "array", "items": {"type": "string"}, "minItems": 200}
    spec_ = StructuredOutputs(json={"type": "object", "properties": {"lines": lines}, "required": ["lines"]})
    prompt = t.encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n")
    runs = []
    for masked in (True, False):
        if not masked:
            monkeypatch.setattr(Constraint, "spine", lambda self: None)  # the drafter unconstrained
        runner = GPURunner(cfg, gw, 128, prefill_chunk=10, device="cpu")
        dec = GPUSpecDecoder(
            runner, SamplingParams(temperature=0.0), TreeConfig(depth=4, topk=3, budget=7, rows=8)
        )
        dec.constraint = compiler.constraint(spec_)
        out = dec.prefill(prompt)
        while len(out) < 48:
            out += dec.step()
        runs.append((out[:48], sum(dec.stats.accepted) / dec.stats.events))
    (masked_out, masked_rate), (free_out, free_rate) = runs
    assert masked_out == free_out and masked_rate > 1.5 * free_rate, runs


def test_prompts_at_the_end_of_the_context_speculate(monkeypatch):
    """A prompt in the last positions of the context, asking for the few tokens left: the speculative
    engine serves it (its runner holds the tree's slots past the context) with plain decoding's tokens. The
    prefill once required room for two trees' worth of commits and refused these prompts."""
    from lumo.engine.gpu_decode import GPUBackend
    from lumo.engine.gpu_spec import SpecBackend

    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    context = 48
    backend = GPUBackend(cfg, gw, context, "cpu", use_graph=False)
    spec = SpecBackend(backend, TreeConfig(depth=4, topk=3, budget=7, rows=8))
    text = tokenizer().encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n" * 4)
    params = SamplingParams(temperature=0.0)
    for n in (context - 12, context - 5, context - 1):
        new = context - n  # what LLM allows: the context's end
        prompt = text[:n]
        plain = backend.decoder(params, context)
        want = plain.prefill(prompt)
        while len(want) < new:
            want += plain.step()
        dec = spec.decoder(params, context)
        got = dec.prefill(prompt)
        while len(got) < new:
            got += dec.step()
        assert got[:new] == want[:new], n


def test_the_context_is_fitted_to_free_memory_with_the_trees_slots(monkeypatch):
    """GPUBackend.fit_context (what LLM calls after packing): the longest request's runner, max_model_len
    plus the tree's slots with the drafter's cache, against the free memory (patched: no GPU here); the
    backend then serves the lowered context, and a request for more is refused."""
    import lumo.engine.gpu_decode as gd
    from lumo.engine.gpu_spec import SpecBackend
    from lumo.engine.runner import cache_bytes

    cfg, gw = tiny()
    spec = SpecBackend(gd.GPUBackend(cfg, gw, 8192, "cpu", use_graph=False), TreeConfig())
    backend, extra, mtp = spec.backend, spec.extra_positions, cfg.mtp_num_hidden_layers
    assert extra == TreeConfig().rows + TreeConfig().depth + 1 and mtp >= 1

    def need(n):
        return cache_bytes(cfg, n + extra, backend.prefill_chunk, backend.prefix_snapshots, mtp)

    monkeypatch.setattr(gd, "free_gpu_bytes", lambda device: need(8192) + gd.GPU_MEMORY_MARGIN)
    assert backend.fit_context(False, extra, mtp) == 8192 == backend.max_model_len
    # room for 5120 positions in all: 4864 tokens and the tree's 44 slots (5120 without the slots)
    room = cache_bytes(cfg, 5120, backend.prefill_chunk, backend.prefix_snapshots, mtp)
    monkeypatch.setattr(gd, "free_gpu_bytes", lambda device: room + gd.GPU_MEMORY_MARGIN)
    with pytest.raises(ConfigError, match="at most 4864 tokens fit"):
        backend.fit_context(True, extra, mtp)
    assert backend.max_model_len == 8192
    assert backend.fit_context(False, extra, mtp) == 4864 == backend.max_model_len
    with pytest.raises(ValueError, match="exceed the context length 4864"):
        spec.decoder(SamplingParams(temperature=0.0), 5000)


def test_a_growing_runner_is_freed_before_the_larger_one_is_allocated(monkeypatch):
    """The speculative backend drops its engine (which holds the runner, its MTP cache and graphs) before
    the backend allocates a larger runner: the peak is the larger runner alone, what the start-up memory
    check counted, not both. A weak reference to the old runner is dead when the new one is built."""
    import weakref

    import lumo.engine.gpu_decode as gd
    from lumo.engine.gpu_spec import SpecBackend

    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    spec = SpecBackend(
        gd.GPUBackend(cfg, gw, 16384, "cpu", use_graph=False), TreeConfig(depth=4, topk=2, budget=6, rows=8)
    )
    params = SamplingParams(temperature=0.0)
    spec.decoder(params, 100)
    old = weakref.ref(spec.backend.runner)
    assert old().max_len == 4096
    alive_at_build = []
    real = gd.GPURunner

    def build(*args, **kw):
        alive_at_build.append(old() is not None)
        return real(*args, **kw)

    monkeypatch.setattr(gd, "GPURunner", build)
    spec.decoder(params, 5000)
    assert alive_at_build == [False] and spec.backend.runner.max_len == 8192


@pytest.mark.parametrize("reserved", [True, False], ids=["reserved", "growing"])
def test_a_reserved_runner_never_grows_and_keeps_the_prefix(monkeypatch, reserved):
    """SpecBackend.reserve (LLM.warm_up's, so lumo serve's): the engine's runner holds the whole context and
    the tree's slots from the start, so a later request for more positions than the first capacity (4096)
    runs on it: no new runner, no new engine (and graphs), and the conversation's earlier prompt is still in
    the prefix cache. Without it the runner grows and the prefix cache starts empty. Either way the tokens
    are a fresh backend's."""
    import lumo.engine.gpu_decode as gd
    from lumo.engine.gpu_spec import SpecBackend

    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    params = SamplingParams(temperature=0.7, top_k=20, seed=5)
    spec = SpecBackend(
        gd.GPUBackend(cfg, gw, 9000, "cpu", use_graph=False, prefill_chunk=10, prefix_snapshots=3), tree
    )
    if reserved:
        engine = spec.reserve()
        assert engine.runner.max_len == 9000 + spec.extra_positions and spec.backend.runner is engine.runner
    first = tokenizer().encode("import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n" * 3)
    dec = spec.decoder(params, len(first) + 8)
    dec.prefill(first)
    dec.step()
    engine = dec.engine
    second = first[:37] + tokenizer().encode("    print(name)\n")
    dec = spec.decoder(params, 8192)  # a client asking for most of the context: past the first capacity
    got = dec.prefill(second)
    assert (dec.engine is engine) == reserved and dec.cached_tokens == (30 if reserved else 0)
    assert spec.backend.runner.max_len == 9000 + (spec.extra_positions if reserved else 0)  # slot_capacity
    fresh = SpecBackend(gd.GPUBackend(cfg, gw, 9000, "cpu", use_graph=False, prefill_chunk=10), tree)
    cold = fresh.decoder(params, 8192)
    want = cold.prefill(second)
    while len(got) < 16:
        got += dec.step()
    while len(want) < len(got):
        want += cold.step()
    assert got == want[: len(got)]


FIRST = "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n" * 3  # 50-60 tokens


def _parked_runners(monkeypatch, kind: str, params: SamplingParams, max_len: int, park: int):
    """A runner with a prefix cache that parks (chunks of 10, 3 snapshots), a fresh one beside it, and a
    decoder factory (one engine per runner, as SpecBackend keeps it) for the emulated engine."""
    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    warm_r, cold_r = (GPURunner(cfg, gw, max_len, prefill_chunk=10, device="cpu") for _ in range(2))
    warm_r.enable_prefix_cache(3, park=park)
    engines = {}

    def decoder(r):
        if kind == "plain":
            return GPUDecoder(r, params, use_graph=False)
        return GPUSpecDecoder(engines.setdefault(id(r), GPUSpecEngine(r, tree)), params)

    return warm_r, cold_r, decoder


def _next_turn_equals_a_fresh_runners(warm_r, cold_r, decoder, prompt: list[int], resume_at: int, n: int):
    """The prompt on both runners: the warm one resumes at resume_at, and the tokens, states, K/V (and
    the drafter's K/V and draft logits) equal the fresh runner's."""
    warm, cold = decoder(warm_r), decoder(cold_r)
    got, want = warm.prefill(prompt), cold.prefill(prompt)
    assert (warm.cached_tokens, cold.cached_tokens) == (resume_at, 0)
    while len(got) < n:
        got += warm.step()
    while len(want) < len(got):
        want += cold.step()
    assert got == want[: len(got)]
    L = warm_r.length
    for a, b in zip(warm_r.gdn_state + warm_r.conv_state, cold_r.gdn_state + cold_r.conv_state, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(warm_r.kv_k + warm_r.kv_v, cold_r.kv_k + cold_r.kv_v, strict=True):
        assert torch.equal(a[:L], b[:L])
    if isinstance(warm, GPUSpecDecoder):
        ew, ec = warm.engine, cold.engine
        for a, b in zip(ew.mtp_k + ew.mtp_v, ec.mtp_k + ec.mtp_v, strict=True):
            assert torch.equal(a[:L], b[:L])
        assert torch.equal(ew.draft_logits, ec.draft_logits)


@pytest.mark.parametrize("kind", ["tree", "plain"])
def test_the_written_mark_is_what_a_request_wrote(monkeypatch, kind):
    """The positions a request may have written, which the next resume checks the parked prefixes
    against: its prompt and decoded tokens and what the decoder writes ahead (a tree's slots), not a
    prefill chunk more (a review found every answer of more than ~2048 tokens cutting the parked lines
    back); a prefill that fails midway counts the chunk it was in."""
    warm_r, _, decoder = _parked_runners(monkeypatch, kind, SamplingParams(temperature=0.0), 128, park=100)
    prompt = tokenizer().encode(FIRST)[:25]
    d = decoder(warm_r)
    d.prefill(prompt)
    for _ in range(4):
        d.step()
    length = warm_r.length  # prompt + decoded tokens (a tree event commits several)
    assert length > len(prompt)
    warm_r.reset()
    assert warm_r._written == length + max(warm_r.write_ahead, 1)

    def fail(*a, **k):
        raise RuntimeError("a failed chunk")

    monkeypatch.setattr(warm_r, "_prefill_chunk", fail)
    with pytest.raises(RuntimeError):
        decoder(warm_r).prefill(prompt[:13])  # resumes at 10 (its snapshot), fails in the chunk [10, 13)
    assert warm_r._written == 13


@pytest.mark.parametrize("kind", ["tree", "plain"])
def test_emulated_parked_prefix_survives_a_side_request(monkeypatch, kind):
    """The runner's parked prefix (prefix.py) through the GPU engine's bookkeeping: a conversation, an
    unrelated request (which overwrites its first positions: the target's and the drafter's K/V there
    copied aside first), the conversation's next turn: it resumes from the conversation's snapshot at 50
    and equals the same turn on a fresh runner (tokens, states, K/V, the drafter's K/V, draft logits)."""
    params = SamplingParams(temperature=0.7, top_k=20, seed=5)
    warm_r, cold_r, decoder = _parked_runners(monkeypatch, kind, params, 128, park=100)
    first = tokenizer().encode(FIRST)
    for prompt in (first, tokenizer().encode("class Point:\n    x: int\n")):
        d = decoder(warm_r)
        d.prefill(prompt)
        for _ in range(3):
            d.step()
    assert [p.tokens for p in warm_r.prefix.lines] == [first]
    second = first + tokenizer().encode("    print(name)\n")
    _next_turn_equals_a_fresh_runners(warm_r, cold_r, decoder, second, 50, 16)
    assert warm_r.prefix.swaps == 1


@pytest.mark.parametrize("side_steps", [0, 60], ids=["long-side-prompt", "side-decodes-far"])
@pytest.mark.parametrize("kind", ["tree", "plain"])
def test_emulated_parked_prefix_past_its_saved_positions_is_cut_back(monkeypatch, kind, side_steps):
    """A side request that writes past the positions copied aside (park=45: a 55-token side prompt, or a
    short one that decodes 60 tokens) overwrites the parked conversation's positions there: its next turn
    resumes from a snapshot inside them (40), not from 50, and equals a fresh runner's. The plain decoder
    resets the slot before resume: the runner keeps what was written across that reset (review of
    session 42: resume once saw length 0 and restored overwritten positions)."""
    warm_r, cold_r, decoder = _parked_runners(
        monkeypatch, kind, SamplingParams(temperature=0.0), 256, park=45
    )
    first = tokenizer().encode(FIRST)
    side = [7] + first[1:] if side_steps == 0 else tokenizer().encode("class Point:\n")
    d = decoder(warm_r)
    d.prefill(first)
    d.step()
    d = decoder(warm_r)
    d.prefill(side)
    while warm_r.length < len(side) + side_steps:
        d.step()
    second = first + tokenizer().encode("    print(name)\n")
    _next_turn_equals_a_fresh_runners(warm_r, cold_r, decoder, second, 40, 8)


def test_the_memory_check_counts_the_engines_attention_partials_and_mtp_cache(monkeypatch):
    """What a speculative engine allocates over its runner's positions (its rows' attention split-K
    partials, the drafter's K/V) is what cache_bytes adds for attn_rows = SpecBackend.attn_rows and
    mtp_layers (review of session 42: the partials, 2.3 GB on the 27B at 262k, were not counted)."""
    from lumo.engine.gpu_decode import GPUBackend
    from lumo.engine.gpu_spec import SpecBackend
    from lumo.engine.runner import cache_bytes

    _install_emulation(monkeypatch)
    cfg, gw = tiny()
    tree = TreeConfig(depth=4, topk=3, budget=7, rows=8)
    spec = SpecBackend(GPUBackend(cfg, gw, 3000, "cpu"), tree)
    engine = spec.reserve()
    L = engine.runner.max_len

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    partials = nbytes(t for rows in (engine.tr, engine.d1, engine.feed) for t in rows.attn_ws)
    mtp = nbytes(engine.mtp_k + engine.mtp_v)
    base = cache_bytes(cfg, L, prefix_snapshots=0)
    assert cache_bytes(cfg, L, prefix_snapshots=0, attn_rows=spec.attn_rows) - base == partials
    assert cache_bytes(cfg, L, prefix_snapshots=0, mtp_layers=cfg.mtp_num_hidden_layers) - base == mtp


@pytest.mark.parametrize("seed", range(5))
def test_emulated_random_conversations_with_parking_equal_fresh_runners(monkeypatch, seed):
    """Two conversations that grow turn by turn, unrelated side requests of random lengths and decode
    lengths, plain and tree decoders on one runner that parks (small cap and prefill chunk): every request's
    tokens equal the same request's on a fresh runner, whatever it resumed from."""
    import random

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.7, top_k=20, seed=5)
    warm_r, cold_r, plain = _parked_runners(monkeypatch, "plain", params, 256, park=rng.choice([20, 40, 90]))
    _, _, tree = _parked_runners(monkeypatch, "tree", params, 256, park=0)
    kind = rng.choice([plain, tree])  # one decoder kind per runner: another owner's prefill empties the cache
    vocab = tiny()[0].vocab_size
    convs = [[rng.randrange(vocab) for _ in range(30)] for _ in range(2)]
    hits = 0
    for _ in range(14):
        r = rng.random()
        if r < 0.6:
            c = rng.randrange(2)
            convs[c] = convs[c] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
            prompt = convs[c][:150]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 70))]
        steps = rng.randrange(0, 40)
        warm, cold = kind(warm_r), kind(cold_r)
        got, want = warm.prefill(prompt), cold.prefill(prompt)
        while len(got) < steps and warm_r.length < 200:
            got += warm.step()
        while len(want) < len(got):
            want += cold.step()
        assert got == want[: len(got)], (prompt, warm.cached_tokens)
        hits += warm.cached_tokens > 0
    assert hits > 0
