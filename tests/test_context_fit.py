"""The start-up check of max_model_len against the GPU's free memory (lumo.engine.gpu_decode.fit_context,
runner.cache_bytes): the model's own context is lowered to what fits, one the user asked for that does not
fit is a one-line error naming what does. CPU: the byte counts are plain arithmetic; the GPU side
(free_gpu_bytes, LLM) is tests/test_llm_gpu.py's."""

from __future__ import annotations

import pytest

from lumo.config import ConfigError
from lumo.engine.gpu_decode import GPU_MEMORY_MARGIN, _mem_available, fit_context
from lumo.engine.gpu_weights import config_27b
from lumo.engine.runner import cache_bytes, memory_plan

GB = 10**9


def linear(per_token: int, fixed: int):
    return lambda n: fixed + per_token * n


def test_a_context_that_fits_is_kept(capsys):
    need = linear(1000, 5 * GB)
    free = need(262144) + GPU_MEMORY_MARGIN
    assert fit_context(need, free, 262144, explicit=False) == 262144
    assert fit_context(need, free, 262144, explicit=True) == 262144
    assert capsys.readouterr().err == ""


def test_the_models_own_context_is_lowered_to_what_fits(capsys):
    need = linear(80_000, 2 * GB)  # 27B-like: ~80 KB per position
    free = 12 * GB + GPU_MEMORY_MARGIN
    fit = fit_context(need, free, 262144, explicit=False)
    assert fit % 256 == 0 and need(fit) <= 12 * GB < need(fit + 256)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"context limited to {fit} tokens" in err and "262144" in err
    # a budget that is exactly a multiple of 256's need: that multiple fits (the comparisons are <=)
    assert fit_context(need, need(fit) + GPU_MEMORY_MARGIN, 262144, explicit=False) == fit
    assert fit_context(need, need(262144) + GPU_MEMORY_MARGIN, 262144, explicit=True) == 262144


def test_a_context_the_user_asked_for_that_does_not_fit_is_an_error():
    need = linear(80_000, 2 * GB)
    free = 12 * GB + GPU_MEMORY_MARGIN
    fit = fit_context(need, free, 262144, explicit=False)
    with pytest.raises(ConfigError, match=f"max_model_len 200000 needs .* at most {fit} tokens fit"):
        fit_context(need, free, 200000, explicit=True)
    assert fit_context(need, free, fit, explicit=True) == fit


def test_no_room_at_all_is_an_error():
    with pytest.raises(ConfigError, match="even a 256-token context"):
        fit_context(linear(1000, 4 * GB), 3 * GB, 4096, explicit=False)
    with pytest.raises(ConfigError, match="even a 256-token context"):
        fit_context(linear(1000, 0), GPU_MEMORY_MARGIN // 2, 4096, explicit=True)


def test_cache_bytes_is_the_plan_without_weights_plus_the_drafter_cache():
    cfg = config_27b()
    for n in (4096, 131072):
        plan = memory_plan(cfg, n)
        assert cache_bytes(cfg, n) == sum(plan.values()) - plan["weights"]
        kv = n * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
        assert cache_bytes(cfg, n, mtp_layers=1) == cache_bytes(cfg, n) + kv
    # the 27B's caches at its full context: what docs/runner.md states (~20 GB with the drafter)
    assert 19 * GB < cache_bytes(cfg, 262144 + 44, mtp_layers=1) < 21 * GB


def test_mem_available_reads_the_os_figure():
    assert _mem_available() > 0  # Linux: /proc/meminfo
