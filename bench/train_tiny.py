"""Train lumo's embedded default model (lumo-tiny) on the Python standard library, evaluate it, export it.

    PYTHONPATH=. python bench/train_tiny.py --out DIR [--minutes 8] [--device cuda] [--seed 0]
    PYTHONPATH=. python bench/train_tiny.py --out DIR --smoke --device cpu     # CI: < 1 minute on a CPU
    PYTHONPATH=. python bench/train_tiny.py --out DIR --quantize-only          # DIR/lumo-tiny -> NVFP4 copy

Writes DIR/lumo-tiny/ (config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json), DIR/metrics.json and DIR/train_log.txt; `--quantize-only` adds DIR/lumo-tiny-nvfp4/.
The model is lumo's own reference model (lumo.model.forward / mtp_forward) over parameters that are leaf
tensors inside lumo.weights dataclasses; the MTP head is trained jointly (see `losses`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

from lumo import model as M
from lumo.config import FULL, LINEAR, ModelConfig
from lumo.corpus import EOT, encode_documents, split_documents, stdlib_documents, train_tokenizer
from lumo.testing import CHAT_TEMPLATE
from lumo.weights import ModelWeights, build_weights, dense_linear_builder, load_model

# The shipped architecture: the qwen3_5_text family at ~5M parameters (MODEL.md), 2 x [GDN, GDN, GDN, attn].
ARCH = dict(
    hidden_size=192,
    intermediate_size=384,
    layer_types=[LINEAR, LINEAR, LINEAR, FULL] * 2,
    linear_num_key_heads=2,  # nk
    linear_num_value_heads=4,  # nv = 2 nk
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    mtp_num_hidden_layers=1,
)
VOCAB = 3072


def hf_config(vocab_size: int, eos_ids: list[int], pad_id: int) -> dict:
    """config.json of a flat `qwen3_5_text` checkpoint that transformers' Qwen3_5ForCausalLM loads."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        **ARCH,
        "num_hidden_layers": len(ARCH["layer_types"]),
        "full_attention_interval": 4,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
    }


# ---------------------------------------------------------------------------------------------
# Parameters: checkpoint name -> f32 leaf tensor; ModelWeights views them through build_weights, so the
# names exported are by construction the ones lumo's loader reads.


def init_tensors(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Fresh f32 parameters (CPU, seeded): N(0, 0.02) linears with residual outputs scaled by
    1/sqrt(2 * layers) (GPT-2), 1+w norms at 0, the GDN output norm at 1, HF's A_log / dt_bias init."""
    g = torch.Generator().manual_seed(seed)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    nv, dv, C, K = (
        cfg.linear_num_value_heads,
        cfg.linear_value_head_dim,
        cfg.conv_dim,
        cfg.linear_conv_kernel_dim,
    )
    out_std = 0.02 / math.sqrt(2 * (cfg.num_layers + cfg.mtp_num_hidden_layers))
    t: dict[str, torch.Tensor] = {}

    def lin(name: str, n: int, k: int, std: float = 0.02) -> None:
        t[f"{name}.weight"] = torch.randn(n, k, generator=g) * std

    def layer(p: str, kind: str) -> None:
        t[f"{p}.input_layernorm.weight"] = torch.zeros(H)
        t[f"{p}.post_attention_layernorm.weight"] = torch.zeros(H)
        if kind == FULL:
            a = f"{p}.self_attn"
            lin(f"{a}.q_proj", nh * 2 * d, H)
            lin(f"{a}.k_proj", nkv * d, H)
            lin(f"{a}.v_proj", nkv * d, H)
            lin(f"{a}.o_proj", H, nh * d, out_std)
            t[f"{a}.q_norm.weight"] = torch.zeros(d)
            t[f"{a}.k_norm.weight"] = torch.zeros(d)
        else:
            a = f"{p}.linear_attn"
            lin(f"{a}.in_proj_qkv", C, H)
            lin(f"{a}.in_proj_z", nv * dv, H)
            lin(f"{a}.in_proj_b", nv, H)
            lin(f"{a}.in_proj_a", nv, H)
            t[f"{a}.conv1d.weight"] = (torch.rand(C, 1, K, generator=g) * 2 - 1) / math.sqrt(K)
            t[f"{a}.dt_bias"] = torch.ones(nv)
            t[f"{a}.A_log"] = (torch.rand(nv, generator=g) * 15.99 + 0.01).log()
            t[f"{a}.norm.weight"] = torch.ones(dv)
            lin(f"{a}.out_proj", H, nv * dv, out_std)
        lin(f"{p}.mlp.gate_proj", I, H)
        lin(f"{p}.mlp.up_proj", I, H)
        lin(f"{p}.mlp.down_proj", H, I, out_std)

    t["model.embed_tokens.weight"] = torch.randn(V, H, generator=g) * 0.02
    for i, kind in enumerate(cfg.layer_types):
        layer(f"model.layers.{i}", kind)
    t["model.norm.weight"] = torch.zeros(H)
    lin("lm_head", V, H)
    lin("mtp.fc", H, 2 * H)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
    t["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(H)
    for i in range(cfg.mtp_num_hidden_layers):
        layer(f"mtp.layers.{i}", FULL)
    t["mtp.norm.weight"] = torch.zeros(H)
    return t


def as_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> ModelWeights:
    return build_weights(cfg, tensors.get, dense_linear_builder(tensors.get), prefix="model.")


# ---------------------------------------------------------------------------------------------
# Training.


def losses(
    cfg: ModelConfig, w: ModelWeights, win: torch.Tensor, chain: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropies on windows win [B, T+3]: target next token; MTP step 1 (h_t, x_{t+1}) -> x_{t+2};
    MTP step 2 (its own output at t, x_{t+2}) -> x_{t+3}, the second link of a draft chain (teacher forced;
    its positions are shifted by one, which RoPE's relative form makes harmless)."""
    T, V = win.shape[1] - 3, cfg.vocab_size
    ids, y1, y2, y3 = (win[:, i : i + T] for i in range(4))

    def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))

    logits, hidden = M.forward(cfg, w, ids)
    mlog, out = M.mtp_forward(cfg, w, hidden, y1)
    ce2 = ce(M.mtp_forward(cfg, w, out, y2)[0], y3) if chain else torch.zeros((), device=win.device)
    return ce(logits, y1), ce(mlog, y2), ce2


@torch.no_grad()
def validation_loss(
    cfg: ModelConfig, w: ModelWeights, wins: torch.Tensor, batch: int, amp: torch.autocast
) -> tuple[float, float]:
    """Mean target and MTP-step-1 cross-entropy over validation windows [n, T+3]."""
    s1 = sm = 0.0
    for i in range(0, len(wins), batch):
        with amp:
            c1, cm, _ = losses(cfg, w, wins[i : i + batch], False)
        n = len(wins[i : i + batch])
        s1, sm = s1 + c1.item() * n, sm + cm.item() * n
    return s1 / len(wins), sm / len(wins)


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float = 0.1) -> float:
    """Linear warmup, then cosine from `peak` to floor * peak at step `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def train(
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    data: torch.Tensor,
    val: torch.Tensor,
    a: argparse.Namespace,
    log: Callable[[str], None],
) -> dict:
    """AdamW over the leaf tensors until `--steps`, or the number of steps that fit in `--minutes` (fixed
    from the measured step time after the first steps, so the cosine schedule is known before it starts).
    At every report the validation loss (target + MTP) is measured; the best weights are the result, so
    many epochs over a small corpus cannot end in an overfitted model."""
    dev = torch.device(a.device)
    params = {n: p.to(dev).requires_grad_() for n, p in tensors.items()}
    w = as_weights(cfg, params)
    decay = [p for p in params.values() if p.ndim == 2]  # matrices and embeddings; not norms/gates/conv
    no_decay = [p for p in params.values() if p.ndim != 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=dev.type == "cuda",
    )
    loss_fn = torch.compile(losses, dynamic=False) if a.compile else losses
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    B, T = a.batch, a.seq_len
    data = data.to(dev)
    # data order: its own stream on the training device, so drawing a batch never waits for the GPU
    gen = torch.Generator(device=dev).manual_seed(a.seed + 1)
    offsets = torch.arange(T + 3, device=dev)
    probe = val[: (len(val) // (T + 3)) * (T + 3)].view(-1, T + 3)[: a.val_windows].to(dev)
    best = (math.inf, 0, None)  # (validation loss, step, weights on the device)

    budget = a.minutes * 60.0
    total = a.steps or 10**9
    sums = torch.zeros(3, device=dev)  # running sums of the three losses since the last report
    n_sum, first_loss, hist, calib = 0, None, [], (0, 0.0)
    t0 = last = time.perf_counter()
    step = 0
    while step < total:
        start = torch.randint(0, len(data) - T - 3, (B,), generator=gen, device=dev)
        win = data[start[:, None] + offsets]  # [B, T+3]
        lr = lr_at(step, total, a.warmup, a.lr)
        for grp in opt.param_groups:
            grp["lr"] = lr
        with amp:
            ce1, cem, cem2 = loss_fn(cfg, w, win, a.mtp_chain > 0)
            loss = ce1 + a.mtp_weight * (cem + a.mtp_chain * cem2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sums += torch.stack([ce1, cem, cem2]).detach()
        n_sum += 1
        step += 1
        if first_loss is None:
            first_loss = ce1.item()
        now = time.perf_counter()
        if not a.steps and step in (a.calib_steps, 2 * a.calib_steps):
            # The first steps carry warm-up costs (allocator, autotuning, compilation): time the next
            # calib_steps with a sync on both ends and fix the step count (and so the cosine) from them.
            if dev.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if step == a.calib_steps:
                calib = (step, now)
            else:
                per_step = (now - calib[1]) / (step - calib[0])
                total = step + max(1, int((budget - (now - t0)) / per_step))
                mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
                log(f"step {per_step * 1e3:.1f} ms, {mem:.1f} GiB peak -> {total} steps in {a.minutes:g} min")
        done = step >= total or (not a.steps and now - t0 > budget * 1.02)
        if now - last >= a.log_every or done:
            s = (sums / n_sum).tolist()
            v1, vm = validation_loss(cfg, w, probe, a.eval_batch, amp)
            if v1 + vm < best[0]:
                best = (v1 + vm, step, {n: p.detach().clone() for n, p in params.items()})
            el = now - t0
            rec = dict(step=step, s=round(el, 1), lr=lr, loss=s[0], mtp=s[1], mtp2=s[2], val=v1, val_mtp=vm,
                       tok_s=step * B * T / el)  # fmt: skip
            hist.append(rec)
            log(
                f"step {step:6d}/{total if total < 10**9 else '?'}  {el:6.1f}s  lr {lr:.2e}  "
                f"loss {s[0]:.3f}  mtp {s[1]:.3f}  mtp2 {s[2]:.3f}  val {v1:.3f}/{vm:.3f}  "
                f"{rec['tok_s']:,.0f} tok/s"
            )
            sums.zero_()
            n_sum, last = 0, time.perf_counter()
        if done:
            break
    el = time.perf_counter() - t0
    for n, p in best[2].items():
        tensors[n] = p.float().cpu()
    log(f"kept the weights of step {best[1]} (validation loss {best[0]:.4f} = target + MTP)")
    return {
        "steps": step,
        "kept_step": best[1],
        "batch": B,
        "seq_len": T,
        "tokens_seen": step * B * T,
        "epochs": step * B * T / len(data),
        "seconds": round(el, 1),
        "tokens_per_s": round(step * B * T / el),
        "first_loss": first_loss,
        "final_loss": hist[-1]["loss"],
        "final_mtp_loss": hist[-1]["mtp"],
        "history": hist,
    }


# ---------------------------------------------------------------------------------------------
# Evaluation on held-out files, with the weights as shipped (loaded back through lumo's loader).


@torch.no_grad()
def evaluate(cfg: ModelConfig, w: ModelWeights, held: torch.Tensor, T: int, windows: int, batch: int) -> dict:
    """Target next-token loss / accuracy and MTP (h_t, x_{t+1}) -> x_{t+2} loss / top-1 / top-3 over
    non-overlapping held-out windows of T tokens."""
    dev = w.embed_tokens.device
    n = min(windows, (len(held) - 2) // (T + 2))
    wins = held[: n * (T + 2)].view(n, T + 2).to(dev)
    s = torch.zeros(6, dtype=torch.float64)  # ce, acc, mtp ce, top1, top3, count
    for i in range(0, n, batch):
        win = wins[i : i + batch]
        ids, y1, y2 = win[:, :T], win[:, 1 : T + 1], win[:, 2:]
        logits, hidden = M.forward(cfg, w, ids)
        mlog = M.mtp_forward(cfg, w, hidden, y1)[0]
        top3 = mlog.topk(3, dim=-1).indices  # [b, T, 3]
        s += torch.tensor(
            [
                F.cross_entropy(logits.flatten(0, 1), y1.flatten(), reduction="sum").item(),
                (logits.argmax(-1) == y1).sum().item(),
                F.cross_entropy(mlog.flatten(0, 1), y2.flatten(), reduction="sum").item(),
                (top3[..., 0] == y2).sum().item(),
                (top3 == y2[..., None]).any(-1).sum().item(),
                y1.numel(),
            ],
            dtype=torch.float64,
        )
    c = s[5].item()
    return {
        "tokens": int(c),
        "loss": s[0].item() / c,
        "accuracy": s[1].item() / c,
        "mtp_loss": s[2].item() / c,
        "mtp_top1": s[3].item() / c,
        "mtp_top3": s[4].item() / c,
    }


@torch.no_grad()
def speculation(
    cfg: ModelConfig,
    w: ModelWeights,
    held: torch.Tensor,
    n: int,
    ctx: int,
    batch: int,
    drafts: int,
    seed: int,
) -> dict:
    """Greedy chain speculation at n random held-out positions p, as the engine runs it: the target
    continues greedily from the true prefix x_0..x_p (tokens g_1..g_{D+1}); the MTP drafts D tokens, the
    first from (h_p, g_1), each next from its own output hidden and its previous draft; a draft counts
    while it and all before it equal the target's greedy tokens. Without caches: each step re-runs the
    prefix, which is the same causal function."""
    dev = w.embed_tokens.device
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(held) - ctx - 1, (n,), generator=gen)
    accepted = []
    for i in range(0, n, batch):
        seq = held[starts[i : i + batch, None] + torch.arange(ctx)].to(dev)  # [b, ctx] true prefix
        logits, hidden = M.forward(cfg, w, seq)
        greedy = [logits[:, -1].argmax(-1)]  # g_1 = the target's x_{p+1}
        cont = seq
        for _ in range(drafts):
            cont = torch.cat([cont, greedy[-1][:, None]], dim=1)
            greedy.append(M.forward(cfg, w, cont)[0][:, -1].argmax(-1))
        hid, nxt = hidden, torch.cat([seq[:, 1:], greedy[0][:, None]], dim=1)  # pairs (h_j, x_{j+1})
        draft = []
        for _ in range(drafts):
            mlog, out = M.mtp_forward(cfg, w, hid, nxt)
            draft.append(mlog[:, -1].argmax(-1))
            hid = torch.cat([hid, out[:, -1:]], dim=1)
            nxt = torch.cat([nxt, draft[-1][:, None]], dim=1)
        match = torch.stack(draft, 1) == torch.stack(greedy[1:], 1)  # [b, D]
        accepted.append(match.long().cumprod(1).sum(1).cpu())
    acc = torch.cat(accepted)
    hist = torch.bincount(acc, minlength=drafts + 1)
    return {
        "positions": n,
        "context": ctx,
        "drafts": drafts,
        "mean_accepted": acc.float().mean().item(),
        "tokens_per_target_step": 1 + acc.float().mean().item(),
        "accept_rate_by_depth": [(acc > k).float().mean().item() for k in range(drafts)],
        "histogram": hist.tolist(),
    }


def evaluate_dir(ckpt: Path, held: torch.Tensor, a: argparse.Namespace) -> dict:
    cfg, w = load_model(ckpt, device=a.device, dtype=torch.float32, progress=False)
    out = evaluate(cfg, w, held, a.eval_len, a.eval_windows, a.eval_batch)
    out["speculation"] = speculation(
        cfg, w, held, a.spec_positions, a.spec_context, a.eval_batch, 4, a.seed + 2
    )
    return out


# ---------------------------------------------------------------------------------------------
# Export.


def export(dst: Path, cfg_json: dict, tensors: dict[str, torch.Tensor], tok: Tokenizer) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    bf16 = {n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items()}
    save_file(bf16, str(dst / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(dst / "tokenizer.json"))
    eos, eot = cfg_json["eos_token_id"], tok.token_to_id(EOT)

    def dump(name: str, obj: dict) -> None:
        (dst / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    dump("config.json", cfg_json)
    dump(
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": EOT,  # a base model of code: it ends documents, it has never seen a chat turn
            "pad_token": EOT,
            "add_bos_token": False,
            "model_max_length": cfg_json["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
        },
    )
    dump("generation_config.json", {"eos_token_id": eos, "pad_token_id": eot, "do_sample": False})
    make_readable(dst)


def make_readable(d: Path) -> None:
    # safetensors writes 0600 files; package data must be readable by every user of an install
    for f in d.iterdir():
        f.chmod(0o644)


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())


# ---------------------------------------------------------------------------------------------
# Command line.

# Defaults per mode; any flag given on the command line wins.
FULL_RUN = dict(batch=128, seq_len=512, steps=0, warmup=200, lr=2e-3, log_every=30.0, eval_len=512,
                eval_windows=10**6, eval_batch=32, spec_positions=512, spec_context=256)  # fmt: skip
SMOKE = dict(batch=4, seq_len=64, steps=24, warmup=4, lr=3e-3, log_every=1.0, eval_len=64,
             eval_windows=8, eval_batch=8, spec_positions=4, spec_context=32)  # fmt: skip
QUANT_EVAL = dict(eval_len=512, eval_windows=48, eval_batch=8, spec_positions=64, spec_context=256)
SMOKE_CHARS = (250_000, 30_000, 50_000)  # train / validation / held-out text in the smoke corpus


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (lumo-tiny/, metrics.json, log)")
    p.add_argument("--minutes", type=float, default=8.0, help="training time budget (ignored with --steps)")
    p.add_argument(
        "--corpus-root",
        type=Path,
        default=None,
        help="a CPython Lib/ folder (default: this interpreter's stdlib)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny corpus and a few steps: the CPU CI check")
    p.add_argument("--quantize-only", action="store_true", help="make OUT/lumo-tiny-nvfp4 and evaluate it")
    p.add_argument("--quant-format", default="w4a16_nvfp4", choices=["nvfp4", "w4a16_nvfp4"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, help="fixed step count (reproducible); default: fit --minutes")
    p.add_argument("--batch", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--mtp-weight", type=float, default=0.5, help="lambda: weight of the MTP losses")
    p.add_argument("--mtp-chain", type=float, default=0.5, help="weight of MTP step 2 (0 = off)")
    p.add_argument("--compile", action="store_true", help="torch.compile the loss (off: see docs)")
    p.add_argument("--calib-steps", type=int, default=10)
    p.add_argument("--val-windows", type=int, default=64, help="validation windows per report")
    for k in ("log_every", "eval_len", "eval_windows", "eval_batch", "spec_positions", "spec_context"):
        p.add_argument("--" + k.replace("_", "-"), type=type(FULL_RUN[k]))
    a = p.parse_args(argv)
    mode = QUANT_EVAL if a.quantize_only else SMOKE if a.smoke else FULL_RUN
    for k, v in {**FULL_RUN, **mode}.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def corpus(a: argparse.Namespace, log: Callable[[str], None]) -> tuple[list, list, list, dict]:
    """(train, validation, held-out) documents; --smoke takes the first files (by path) of each split up
    to a character budget."""
    splits = split_documents(stdlib_documents(a.corpus_root))
    if a.smoke:

        def head(ds: list, chars: int) -> list:
            out, n = [], 0
            for d in ds:
                if n + len(d.text) <= chars:
                    out.append(d)
                    n += len(d.text)
            return out

        splits = tuple(head(ds, c) for ds, c in zip(splits, SMOKE_CHARS, strict=True))
    info = {"source": f"Python standard library .py files of {a.corpus_root or 'this interpreter'}"}
    info["python"] = platform.python_version()
    for name, ds in zip(("train", "validation", "held_out"), splits, strict=True):
        info[f"{name}_files"] = len(ds)
        info[f"{name}_chars"] = sum(len(d.text) for d in ds)
    log(f"corpus: {info}")
    return (*splits, info)


def run_training(a: argparse.Namespace, log: Callable[[str], None]) -> dict:
    t_start = time.perf_counter()
    torch.manual_seed(a.seed)
    train_docs, val_docs, held_docs, cinfo = corpus(a, log)
    tok = train_tokenizer((d.text for d in train_docs), VOCAB)
    data, val, held = (encode_documents(tok, ds) for ds in (train_docs, val_docs, held_docs))
    cinfo.update(train_tokens=len(data), validation_tokens=len(val), held_out_tokens=len(held))
    cinfo["chars_per_token"] = cinfo["train_chars"] / len(data)
    t_tok = time.perf_counter() - t_start
    log(
        f"tokenizer + encoding: {t_tok:.1f}s; tokens: {len(data):,} train {len(val):,} val {len(held):,} held"
    )

    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id(EOT)]
    cfg_json = hf_config(tok.get_vocab_size(), eos, tok.token_to_id(EOT))
    cfg = ModelConfig.from_hf(cfg_json)
    tensors = init_tensors(cfg, a.seed)
    n_params = sum(t.numel() for t in tensors.values())
    log(f"model: {n_params:,} parameters, {cfg.num_layers} layers {cfg.layer_types}, device {a.device}")
    while True:  # one shot on a lent GPU: an out-of-memory first step retries with half the batch
        try:
            tr = train(cfg, tensors, data, val, a, log)
            break
        except torch.OutOfMemoryError:
            if a.batch <= 8:
                raise
        a.batch //= 2
        torch.cuda.empty_cache()
        log(f"out of memory: retrying with batch {a.batch}")

    ckpt = a.out / "lumo-tiny"
    export(ckpt, cfg_json, tensors, tok)
    t_eval = time.perf_counter()
    ev = evaluate_dir(ckpt, held, a)
    sp = ev.pop("speculation")
    log(f"held-out: {json.dumps(ev)}")
    log(f"speculation: {json.dumps(sp)}")
    return {
        "model": {"parameters": n_params, "bytes": dir_bytes(ckpt), "config": cfg_json},
        "corpus": cinfo,
        "train": {
            **{k: v for k, v in tr.items() if k != "history"},
            "seed": a.seed,
            "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "lr": a.lr,
            "warmup": a.warmup,
            "weight_decay": a.weight_decay,
            "mtp_weight": a.mtp_weight,
            "mtp_chain": a.mtp_chain,
            "compile": a.compile,
            "smoke": a.smoke,
        },
        "held_out": ev,
        "speculation": sp,
        "timings": {
            "tokenizer_s": round(t_tok, 1),
            "eval_s": round(time.perf_counter() - t_eval, 1),
            "total_s": round(time.perf_counter() - t_start, 1),
        },
        "history": tr["history"],
    }


def run_quantize(a: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """OUT/lumo-tiny -> OUT/lumo-tiny-nvfp4 (lm_head quantised too, to fit the size budget; the MTP head,
    embeddings and gates stay BF16), then both evaluated on the same held-out subset."""
    from lumo.quant import DEFAULT_EXCLUDE, quantize_checkpoint

    src, dst = a.out / "lumo-tiny", a.out / "lumo-tiny-nvfp4"
    exclude = [p for p in DEFAULT_EXCLUDE if p != "lm_head"]
    err = quantize_checkpoint(src, dst, a.quant_format, exclude=exclude, progress=False, device="cpu")
    make_readable(dst)
    log(f"quantised {src} -> {dst} ({a.quant_format}); relative error per class: {json.dumps(err)}")
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    held = encode_documents(tok, split_documents(stdlib_documents(a.corpus_root))[2])
    res = {"format": a.quant_format, "exclude": exclude, "relative_error": err}
    for name, d in (("bf16", src), ("nvfp4", dst)):
        res[name] = evaluate_dir(d, held, a)
        log(f"{name} held-out subset: {json.dumps(res[name])}")
    res["bytes"] = {"lumo-tiny": dir_bytes(src), "lumo-tiny-nvfp4": dir_bytes(dst)}
    res["bytes"]["total"] = res["bytes"]["lumo-tiny"] + res["bytes"]["lumo-tiny-nvfp4"]
    log(f"sizes: {res['bytes']}")
    return res


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    logf = (a.out / "train_log.txt").open("a", encoding="utf-8")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    log(f"train_tiny {' '.join(sys.argv[1:])}")
    metrics_path = a.out / "metrics.json"
    if a.quantize_only:
        if not (a.out / "lumo-tiny" / "config.json").is_file():
            raise SystemExit(f"error: {a.out / 'lumo-tiny'} has no checkpoint; train first")
        metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
        metrics["quantized"] = run_quantize(a, log)
    else:
        metrics = run_training(a, log)
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"wrote {metrics_path}")


if __name__ == "__main__":
    main()
