"""The GPU-hours estimate (:mod:`xpress.gpu_budget`): its arithmetic on hand-sized shapes, Qwen3-8B's
parameter count against its model card, how the rows scale with the preset's sizes, and that the tables
pasted in docs/gpu.md are what the command prints today."""
from __future__ import annotations

import re
import shlex

import pytest

from xpress import paths
from xpress.__main__ import main
from xpress.config import load_config
from xpress.gpu_budget import (GPU, QWEN3_8B, Dims, decode_cost, drafter_dims, estimate_gpu_hours,
                               train_step_cost)

TINY = Dims(hidden=2, layers=1, intermediate=3, heads=1, kv_heads=1, head_dim=2, vocab=5)


def test_qwen3_8b_parameters_match_its_model_card():
    # model card: 8.2B parameters, 6.95B non-embedding
    assert abs(QWEN3_8B.body_params() / 1e9 - 6.95) < 0.01
    assert abs(QWEN3_8B.params() / 1e9 - 8.19) < 0.01


def test_dims_by_hand():
    # q, o: 2 x 2*2; k, v: 2 x 2*2; MLP 3 x 2*3; norms 2*2 + q/k norms 2*2 -> 8 + 8 + 18 + 4 + 4
    assert TINY.layer_params() == 42 and TINY.body_params() == 44 and TINY.params() == 44 + 2 * 10
    assert TINY.attention_flops(7) == 4 * 1 * 1 * 2 * 7
    assert TINY.forward_flops(7) == 2 * (44 + 10) + 56 and TINY.forward_flops(7, readout=False) == 88 + 56
    assert TINY.weight_bytes() == 2 * 54 and TINY.kv_bytes_per_token() == 2 * 1 * 1 * 2 * 2


def test_decode_cost_by_hand():
    # 3 sequences, 2 at a time, 4-token prompts, 6 new tokens: 2 batches x 6 forwards, mean context 4 + 3
    c = decode_cost(TINY, sequences=3, batch=2, prompt=4, new_tokens=6)
    assert c.tokens == 18
    assert c.flops == 3 * 4 * (2 * 44 + 4 * 2 * 2)              # prefill at context 2, no readout
    assert c.decode_flops == 3 * 6 * (2 * 54 + 4 * 2 * 7)        # 18 one-token forwards at context 7
    assert c.decode_bytes == 12 * 108 + 3 * 6 * 7 * 8            # weights per forward + each row's KV
    slow_memory = GPU("m", bf16_tflops=1e-12, hbm_tb_s=1e-15)     # 1 FLOP/s, 0.001 byte/s at utilization 1
    assert c.seconds(slow_memory, 1.0) == pytest.approx(c.flops + c.decode_bytes * 1000)
    assert c.bound(slow_memory) == "memory"
    fast_memory = GPU("c", bf16_tflops=1e-12, hbm_tb_s=1.0)
    assert c.seconds(fast_memory, 0.5) == pytest.approx((c.flops + c.decode_flops) / 0.5)
    assert c.bound(fast_memory) == "compute"
    # speculative at tau = 2: 3 rounds of a B-token verify, plus a drafter block per round
    cfg = load_config("smoke")
    dr = drafter_dims(cfg, TINY)
    s = decode_cost(TINY, sequences=1, batch=1, prompt=4, new_tokens=6, drafter=dr, tau=2)
    B = cfg.drafter.block_size
    assert s.decode_flops == pytest.approx(3 * B * TINY.forward_flops(7) + 3 * (dr.block_flops(7) + B * dr.context_flops()))
    assert s.decode_bytes == 3 * (TINY.weight_bytes() + dr.block_bytes()) + 3 * 7 * 8


def test_rows_scale_with_the_preset():
    base = load_config("smoke")
    rows = {r["stage"]: r for r in estimate_gpu_hours(base, world=1, target=TINY)}
    assert rows["total"]["gpu_hours"] == pytest.approx(sum(r["gpu_hours"] for s, r in rows.items() if s != "total"))
    assert {"regenerate", "train warmstart", "train dflash", "train markov", "train xpress", "table 1"} <= set(rows)
    double = load_config("smoke", [f"data.n_train_prompts={2 * base.data.n_train_prompts + base.data.n_val_prompts}",
                                   f"train.steps={2 * base.train.steps}"])
    rows2 = {r["stage"]: r for r in estimate_gpu_hours(double, world=2, target=TINY)}
    assert rows2["regenerate"]["tokens"] == 2 * rows["regenerate"]["tokens"]
    assert rows2["regenerate"]["pflop"] == pytest.approx(2 * rows["regenerate"]["pflop"])
    step = train_step_cost(base, "xpress", TINY, drafter_dims(base, TINY))
    assert rows2["train xpress"]["tokens"] == 2 * 2 * base.train.steps * step.tokens  # 2 GPUs, twice the steps
    # the xpress head costs something, the plain drafter none; refiner_only drops the drafter's backward
    assert step.flops > train_step_cost(base, "dflash", TINY, drafter_dims(base, TINY)).flops
    frozen = load_config("smoke", ["train.refiner_only=true"])
    assert train_step_cost(frozen, "xpress", TINY, drafter_dims(frozen, TINY)).flops < step.flops
    faster = {r["stage"]: r for r in estimate_gpu_hours(base, world=1, target=TINY, tau=4)}
    assert faster["table 1"]["gpu_hours"] < rows["table 1"]["gpu_hours"]
    with pytest.raises(ValueError, match="utilization"):
        estimate_gpu_hours(base, utilization=0, target=TINY)


def test_docs_tables_are_current(capsys):
    """Each block of docs/gpu.md opened by ``<!-- gpu-hours: ARGS -->`` holds what
    ``python -m xpress gpu-hours ARGS`` prints now."""
    text = (paths.REPO_ROOT / "docs" / "gpu.md").read_text()
    blocks = re.findall(r"<!-- gpu-hours: (.*?) -->\n(.*?)\n<!-- /gpu-hours -->", text, flags=re.S)
    assert blocks, "docs/gpu.md holds no gpu-hours block"
    for args, table in blocks:
        capsys.readouterr()
        assert main(["gpu-hours", *shlex.split(args)]) == 0
        printed = capsys.readouterr().out.strip()
        assert table.strip() == printed, f"docs/gpu.md is stale for `python -m xpress gpu-hours {args}`; paste:\n{printed}"
