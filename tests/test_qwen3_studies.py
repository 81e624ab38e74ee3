"""A Qwen3-architecture target through the studies at smoke size (the smoke preset's target is a Llama).

The target and its released drafter are written by the rehearsal writer (:mod:`xpress.rehearsal`, as
``python -m xpress rehearsal-assets`` writes qwen3-tiny's) at the smoke preset's widths, and run on two CPU
classes: this machine's own, and the AVX2-only class (``XPRESS_CPU_CLASS=avx2``, :mod:`xpress.cpu`: float32,
the fused layer where it runs). The fused C++ layer runs Llama targets only, so each study must ask
:func:`xpress.runtime.lean_support` before it picks a runtime and record what it skipped.
"""
from __future__ import annotations

import json

import pytest
import torch

from xpress import kernels, paths
from xpress.config import load_config
from xpress.rehearsal import ensure_rehearsal_assets
from xpress.runtime import LeanModel, RuntimeUnsupported, lean_support
from xpress.targets import load_target

SMOKE_QWEN3 = ["target.random_layers=6", "target.random_hidden=64", "target.random_heads=4",
               "target.random_kv_heads=2", "target.random_intermediate=128", "drafter.block_size=8",
               "drafter.num_layers=1", "drafter.num_target_features=2", "head.rank=16", "head.markov_rank=16",
               "head.max_iters=4", "data.benchmarks=[gsm8k]", "eval.prompts_per_benchmark=1", "eval.max_new_tokens=8",
               "eval.repeats=1",
               "eval.sampling_seeds=[]", "eval.bootstrap=20", "eval.batch_sizes=[1,2]", "eval.batched_prompts=2",
               "eval.batched_max_new_tokens=8"]
METHODS = ["dflash", "xpress"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3") / "rehearsal"
    overrides = [f"target.model={root / 'Qwen3-smoke'}", f"drafter.checkpoint={root / 'Qwen3-smoke-DFlash-b8'}",
                 *SMOKE_QWEN3]
    ensure_rehearsal_assets(load_config("qwen3-tiny", overrides))
    return overrides


@pytest.fixture(scope="module", params=["native", "avx2"])
def qwen3(request, folders):
    """(overrides, config, target) on this CPU's class or the simulated AVX2-only one."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "native":
            mp.delenv("XPRESS_CPU_CLASS", raising=False)
        else:
            mp.setenv("XPRESS_CPU_CLASS", request.param)
        cfg = load_config("qwen3-tiny", folders)
        yield folders, cfg, load_target(cfg)
    kernels.use_bf16_products(False)


def test_the_target_asks_what_the_lean_runtime_supports(qwen3):
    _, cfg, target = qwen3
    assert target.model.config.model_type == "qwen3" and target.meta["rehearsal"]
    assert target.meta["runtime"] == "lean" and target.meta["kernels"] == "torch"  # the fused layer is Llama's
    assert lean_support(target.model, target.compute_dtype) == (True, "")
    if cfg.target.dtype == "auto" and "simulated_class" in target.meta["cpu_features"]:
        assert target.compute_dtype == torch.float32  # AVX2 only: no native bf16
    fused = kernels.fused_cpu()
    if fused is not None:  # where the kernels build: the query refuses, and LeanModel with the same reason
        ok, why = lean_support(target.model, torch.float32, kernels=fused)
        assert not ok and "Llama" in why and "qwen3" in why
        with pytest.raises(RuntimeUnsupported, match="Llama"):
            LeanModel(target.model, torch.float32, kernels=fused)


def test_target_cost_times_what_runs_and_records_what_it_skipped(qwen3, tmp_path):
    """The study that stopped the rehearsal (notebook 04): the Qwen3 target's fused layer is skipped, with why."""
    from xpress.studies.target_cost import run_target_cost

    overrides, cfg, _ = qwen3
    res = run_target_cost(cfg.preset, contexts=(8,), new_tokens=(1, 2), repeats=2, warmup=0, dtypes=["float32"],
                          overrides=overrides, out_dir=tmp_path, progress=False)
    assert {r["runtime"] for r in res["rows"]} == {"lean", "transformers"}
    if kernels.fused_cpu() is not None:
        assert [(s["runtime"], s["dtype"]) for s in res["skipped"]] == [("lean-fused", "float32")]
        assert "Llama" in res["skipped"][0]["reason"]
    written = json.loads((tmp_path / "target_cost.json").read_text())
    assert written["skipped"] == res["skipped"] and written["break_even"]


def test_the_decoding_studies_run_the_qwen3_target_losslessly(qwen3, monkeypatch, tmp_path):
    """Table 1, the batched table and tau versus K on untrained drafters: every speculative output at T = 0
    (batch 1) equals the target's greedy one."""
    from xpress.studies.batched import run_batched
    from xpress.studies.table1 import run_table1
    from xpress.studies.tau_k import tau_vs_k

    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    monkeypatch.setattr(paths, "CHECKPOINTS", tmp_path / "checkpoints")  # no trained drafters: fresh weights
    _, cfg, target = qwen3
    table = run_table1(cfg, target, methods=METHODS, untrained_ok=True, progress=False, save=False)
    assert table["lossless_t0"] and {r["method"] for r in table["rows"]} == {"ar", *METHODS}
    batched = run_batched(cfg, target, methods=["xpress"], untrained_ok=True, progress=False, save=False)
    one = [r for r in batched["runs"] if r["batch_size"] == 1]
    assert one and all(r["same_as_ar_b1"] == r["sequences"] for r in one)  # batch 1: every answer equals AR's
    tau = tau_vs_k(cfg, target, methods=["xpress"], ks=[1], save=False, progress=False)
    assert tau["rows"] and all(r["tau"] >= 1 for r in tau["rows"])
