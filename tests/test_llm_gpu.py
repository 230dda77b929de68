"""The LLM on a GPU (reference model in torch, bf16): speculation exact, and close to the CPU fp32 model."""

from __future__ import annotations

import pytest
import torch

from lumo import model as M
from lumo.engine.llm import LLM, embedded_model_path
from lumo.weights import load_model

pytestmark = pytest.mark.gpu

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):",
    "    def __repr__(self):\n        return",
    "try:\n    import json\nexcept ImportError:",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "with open(filename) as f:",
    "if __name__ == '__main__':",
    "    @property\n    def name(self):",
    "def test_basic(self):\n        self.assertEqual(",
    "raise ValueError(",
]


def assets(variant: str) -> str:
    path = embedded_model_path().parent / variant
    if not (path / "config.json").exists():
        pytest.skip(f"{variant} is not in lumo/assets")
    return str(path)


@pytest.mark.parametrize("variant", ["lumo-tiny", "lumo-tiny-nvfp4"])
def test_tree_and_chain_equal_plain_on_gpu(variant):
    """Through the public API on the default GPU backend (the kernels: batch invariant, so bitwise). The
    torch backend on a GPU is not compared: cuBLAS picks kernels by shape and alignment, so the reference
    event's single-row forwards need not reproduce plain decoding's bits there (one NVFP4 prompt parted on
    the H200); on the CPU it is exact (tests/test_spec_ref.py)."""
    path = assets(variant)
    plain = LLM(path, device="cuda", spec="off")
    tree = LLM(path, device="cuda")  # the default on the kernels: tree speculation, events replay graphs
    chain = LLM(path, device="cuda", spec="chain")
    assert plain.backend == tree.backend == chain.backend == "kernels"
    assert tree.spec == "tree" and tree._gpu.use_graph
    accepted = []
    for i, prompt in enumerate(PROMPTS):
        want = plain.generate(prompt, max_tokens=64, temperature=0).token_ids
        assert tree.generate(prompt, max_tokens=64, temperature=0).token_ids == want, prompt
        accepted += tree.last_decoder.stats.accepted
        if i < 3:
            assert chain.generate(prompt, max_tokens=64, temperature=0).token_ids == want, prompt
            kw = dict(max_tokens=48, temperature=0.8, top_p=0.95, top_k=40, seed=i)
            assert tree.generate(prompt, **kw).token_ids == plain.generate(prompt, **kw).token_ids
    mean = sum(accepted) / len(accepted)
    print(f"{variant}: {mean:.2f} accepted drafts per event over {len(accepted)} events")


def test_gpu_logits_close_to_cpu_reference():
    path = assets("lumo-tiny")
    cfg, w_cpu = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    _, w_gpu = load_model(path, device="cuda", dtype=torch.bfloat16, progress=False)
    ids = torch.randint(0, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    ref, _ = M.forward(cfg, w_cpu, ids)
    got, _ = M.forward(cfg, w_gpu, ids.cuda())
    err = float((got.cpu() - ref).norm() / ref.norm())
    print(f"bf16 GPU vs fp32 CPU logits: rel err {err:.2e}")
    assert err < 3e-2


def test_block_fp8_checkpoint_on_the_kernels(tmp_path):
    """The embedded model rewritten as a block-FP8 checkpoint (quant_method fp8, 128 x 128 blocks, as Qwen's
    -FP8 releases): it loads, runs on the kernels (FP8 dequantised to bf16 at load), tree speculation equals
    plain decoding token for token, and its greedy text starts like the BF16 model's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = assets("lumo-tiny")
    d = tmp_path / "fp8"
    shutil.copytree(src, d)
    out = {}
    for name, t in load_file(d / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and t.ndim == 2 and "embed" not in name and "lm_head" not in name:
            N, K = t.shape
            nb, kb = -(-N // 128), -(-K // 128)
            scale = torch.empty(nb, kb)
            q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
            for i in range(nb):
                for j in range(kb):
                    blk = t[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
                    scale[i, j] = max(blk.abs().max().item() / 448.0, 1e-12)
                    q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (blk / scale[i, j]).to(q.dtype)
            out |= {name: q, f"{module}.weight_scale_inv": scale}
        else:
            out[name] = t
    save_file(out, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))

    tree, plain = LLM(d, device="cuda"), LLM(d, device="cuda", spec="off")
    assert tree.backend == "kernels" and tree.spec == "tree"
    bf16 = LLM(src, device="cuda", spec="off")
    same_start = 0
    for p in PROMPTS[:6]:
        want = plain.generate(p, max_tokens=48, temperature=0).token_ids
        assert tree.generate(p, max_tokens=48, temperature=0).token_ids == want
        same_start += want[:4] == bf16.generate(p, max_tokens=4, temperature=0).token_ids
    assert same_start >= 3  # FP8 (3 mantissa bits) may part from BF16 at a near-tie, not everywhere


def test_check_and_bench_on_the_kernels():
    """`lumo check` on the kernels (every kernel compiled for this GPU, tree == plain, the fp32 reference)
    and `lumo bench`'s plain and tree rows, with the embedded model."""
    from types import SimpleNamespace

    from lumo import check
    from lumo.benchmark import format_table, run_bench

    llm = LLM(device="cuda")
    assert llm.backend == "kernels" and llm.spec == "tree"
    out = []
    args = SimpleNamespace(skip_kernels=False, arch=None, tokens=48, reference=None)
    code = check.run_check(args, lambda: llm, out.append)
    print("\n" + "\n".join(out))
    assert code == 0 and out[-1] == "lumo check: 6 ok, 0 failed, 0 skipped"
    rows = run_bench(llm, [128, 1024], gen=128, repeats=3)
    print(format_table(rows))
    assert [r.mode for r in rows] == ["plain", "plain", "tree", "tree"] and rows[2].accepted > 1


def test_the_context_fits_the_gpus_free_memory(monkeypatch, capsys):
    """LLM on the kernels checks max_model_len against the GPU's free memory after packing: the real
    figure on this GPU (the tiny model's whole context fits); with less memory (patched), the model's own
    context is lowered with a notice and still serves, one asked for is a ConfigError naming what fits."""
    import lumo.engine.gpu_decode as gd
    from lumo.config import ConfigError

    free, total = torch.cuda.mem_get_info()
    assert 0 < gd.free_gpu_bytes("cuda") <= total
    path = assets("lumo-tiny")
    needs = []  # the backend's bytes for n positions (its caches, prefix parking included), as it fits them
    fit = gd.fit_context
    monkeypatch.setattr(gd, "fit_context", lambda need, *a, **kw: needs.append(need) or fit(need, *a, **kw))
    full = LLM(path, device="cuda")
    assert full.max_model_len == full.config.max_position_embeddings
    del full
    # memory for exactly 2048 positions (the plan grows with every position: 2304 would not fit)
    need = needs[-1]
    assert need(2048) < need(2304)
    monkeypatch.setattr(gd, "free_gpu_bytes", lambda device: gd.GPU_MEMORY_MARGIN + need(2048))
    small = LLM(path, device="cuda")
    assert small.max_model_len == 2048 < small.config.max_position_embeddings
    assert f"context limited to {small.max_model_len} tokens" in capsys.readouterr().err
    out = small.generate("def fibonacci(n):", max_tokens=16, temperature=0)
    assert len(out.token_ids) == 16
    with pytest.raises(ConfigError, match=f"at most {small.max_model_len} tokens fit"):
        LLM(path, device="cuda", max_model_len=small.config.max_position_embeddings)


def test_warm_up_captures_before_the_first_request_and_changes_nothing():
    """LLM.warm_up (lumo serve's, on the main thread): the runner, sized for the whole context, and the
    speculative engine's graphs exist before the first request, which runs on another thread as the server's
    engine worker does and whose tokens and logprobs are bitwise those of an LLM that was not warmed up (its
    runner the first capacity, 4096 positions; a long prompt too: the chunked GDN prefill); adaptive
    speculation starts afresh, and no request replaces the engine."""
    import threading

    path = assets("lumo-tiny")
    cold, warm = LLM(path, device="cuda"), LLM(path, device="cuda")
    assert warm.warm_up() > 0 and warm._gpu.engine.graphs is not None
    engine = warm._gpu.engine
    assert engine.runner.max_len == warm.max_model_len + warm._gpu.extra_positions
    assert warm._gpu.policy == cold._gpu.policy  # a dataclass: every field, the measurements too
    prompts = [*PROMPTS[:3], " ".join(PROMPTS) * 4]
    kw = dict(max_tokens=40, temperature=0, logprobs=2)
    got = []
    worker = threading.Thread(target=lambda: got.extend(warm.generate(p, **kw) for p in prompts))
    worker.start()
    worker.join()
    assert len(got) == len(prompts)
    for prompt, b in zip(prompts, got, strict=True):
        a = cold.generate(prompt, **kw)
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs), prompt
    assert warm._gpu.engine is engine and cold._gpu.engine.runner.max_len == 4096
