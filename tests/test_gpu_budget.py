"""The GPU-hours estimate (:mod:`xpress.gpu_budget`): its arithmetic on hand-sized shapes, Qwen3-8B's
parameter count against its model card, how the rows scale with the preset's sizes, that the hours follow the
measured constants (results/<gpu>/latency.json, train_memory.json) and name them, and that the tables pasted in
docs/gpu.md are what the command prints today."""
from __future__ import annotations

import json
import re
import shlex

import pytest

from xpress import paths
from xpress.__main__ import main
from xpress.config import load_config
from xpress.gpu_budget import (GPU, QWEN3_8B, Dims, Measured, _run_shapes, decode_cost, device_slug, drafter_dims,
                               estimate_gpu_hours, load_measured, measured_dir, train_step_cost)

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


# --------------------------------------------------------------------------------- measured constants
LATENCY = paths.REPO_ROOT / "results" / "h200" / "latency.json"


def test_device_slug_names_the_results_folder():
    assert device_slug("NVIDIA H200") == device_slug("H200 SXM") == "h200"
    assert device_slug("NVIDIA H100 80GB HBM3") == device_slug("H100 SXM") == "h100"
    assert device_slug("NVIDIA A100-SXM4-80GB") == device_slug("A100 80GB SXM") == "a100"
    assert device_slug("NVIDIA L40S") == "l40s" and device_slug("cpu") == "cpu"
    assert device_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert measured_dir("H200") == paths.REPO_ROOT / "results" / "h200"
    with pytest.raises(ValueError, match="device name"):
        device_slug("--")


def _scaled_latency(folder, factor: float) -> None:
    """A copy of the H200 latency.json with every median multiplied by ``factor``."""
    payload = json.loads(LATENCY.read_text())
    for t in payload["shape_sets"]["paper"]["timings"].values():
        t["median_ms"] *= factor
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "latency.json").write_text(json.dumps(payload))


def test_decoding_hours_follow_the_measured_latencies(tmp_path):
    """The decoding stages take their batch-1 passes from latency.json: the committed H200 file's step is the
    constant, and the hours move with the file (twice the timings: Table 1 grows by exactly its floor)."""
    cfg = load_config("qwen3-8b")
    timings = json.loads(LATENCY.read_text())["shape_sets"]["paper"]["timings"]
    m = load_measured(cfg)  # the repository's results/h200/
    assert m.decode["step"].seconds == timings["target step (1 token)"]["median_ms"] / 1000
    assert "results/h200/latency.json" in m.decode["step"].sources[0]
    model = {r["stage"]: r for r in estimate_gpu_hours(cfg)}
    here = {r["stage"]: r for r in estimate_gpu_hours(cfg, measured=m)}
    # the eager batch-1 step (44 ms) is longer than the roofline's (8.5 ms): the measured floor decides
    assert here["table 1"]["bound"] == here["regenerate"]["bound"] == "measured"
    assert here["table 1"]["gpu_hours"] > 3 * model["table 1"]["gpu_hours"]
    assert "'target step (1 token)'" in here["regenerate"]["source"] and model["regenerate"]["source"] == "model"
    assert here["train xpress"]["source"].startswith("steps: model; evaluations: results/h200/latency.json")

    hours = {}
    for factor in (1, 2):
        _scaled_latency(tmp_path / str(factor), factor)
        hours[factor] = {r["stage"]: r["gpu_hours"] for r in
                         estimate_gpu_hours(cfg, measured=load_measured(cfg, tmp_path / str(factor)))}
    assert hours[1]["table 1"] == pytest.approx(here["table 1"]["gpu_hours"])
    e = cfg.eval
    sequences = len(cfg.data.benchmarks) * e.prompts_per_benchmark * (e.repeats + len(e.sampling_seeds))
    per_token = sum(m.pass_time(method).seconds for method in ["ar", *e.methods])  # tau 1: one pass per token
    floor_hours = sequences * e.max_new_tokens * per_token / 3600
    assert hours[2]["table 1"] - hours[1]["table 1"] == pytest.approx(floor_hours)
    assert hours[2]["regenerate"] > 1.9 * hours[1]["regenerate"]
    # a latency.json at other shapes is not used
    other = load_measured(load_config("qwen3-8b", ["head.rank=128"]), tmp_path / "1")
    assert not other.decode and any("no shape set" in n for n in other.notes)


def _train_memory(folder, step_seconds: dict[str, float], shapes: dict | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"methods": {m: {"step_seconds": s, "peak_bytes": 1} for m, s in step_seconds.items()}}
    if shapes is not None:
        payload["shapes"] = shapes
    (folder / "train_memory.json").write_text(json.dumps(payload))


def test_training_hours_follow_the_measured_step(tmp_path):
    """train_memory.json's step seconds replace the modelled step: at the preset's own shapes one step is the
    measured one, the hours are proportional to it, and a step at fewer layers is scaled by the FLOPs."""
    cfg = load_config("qwen3-8b")
    t, world = cfg.train, 8
    full = {"hidden": 4096, "target_layers": 36, "vocab": 151936, "drafter_layers": 5, "block_size": 16,
            "batch_size": t.batch_size, "max_len": t.max_len, "anchors_per_seq": t.anchors_per_seq}
    model = {r["stage"]: r for r in estimate_gpu_hours(cfg, measured=Measured(folder=""))}
    evals = {}
    for s in (0.5, 1.5):
        _train_memory(tmp_path / str(s), {"dflash": s, "markov": s, "xpress": s}, full)
        m = load_measured(cfg, tmp_path / str(s))
        assert m.train_step["xpress"].seconds == pytest.approx(s)  # ratio 1 at the preset's shapes
        rows = {r["stage"]: r for r in estimate_gpu_hours(cfg, measured=m)}
        assert rows["train xpress"]["bound"] == "measured"
        assert rows["train xpress"]["source"].startswith(f"steps: {m.folder}/train_memory.json: methods.xpress.step_seconds")
        evals[s] = rows["train xpress"]["gpu_hours"] - world * t.steps * s / 3600  # what is not the steps
    assert evals[0.5] == pytest.approx(evals[1.5])  # the hours move with the step time, one for one
    # two target layers instead of 36: the model's FLOPs scale the step up to the preset's
    _train_memory(tmp_path / "short", {"xpress": 0.5}, {**full, "target_layers": 2})
    m = load_measured(cfg, tmp_path / "short")
    run_cfg, run_tg = _run_shapes(cfg, QWEN3_8B, {"target_layers": 2})
    ratio = (train_step_cost(cfg, "xpress", QWEN3_8B, drafter_dims(cfg, QWEN3_8B)).flops
             / train_step_cost(run_cfg, "xpress", run_tg, drafter_dims(run_cfg, run_tg)).flops)
    assert ratio > 1.2 and m.train_step["xpress"].seconds == pytest.approx(0.5 * ratio)
    rows = {r["stage"]: r for r in estimate_gpu_hours(cfg, measured=m)}
    assert rows["train dflash"]["source"].startswith("steps: model")  # not measured: the model
    assert rows["train dflash"]["gpu_hours"] == pytest.approx(model["train dflash"]["gpu_hours"])
    assert any("no methods.dflash.step_seconds" in n for n in m.notes)
    # no shapes: the step cannot be scaled, so it is not used
    _train_memory(tmp_path / "bare", {"xpress": 0.5}, None)
    m = load_measured(cfg, tmp_path / "bare")
    assert not m.train_step and any("no shapes" in n for n in m.notes)


def test_gpu_hours_command_names_its_sources(tmp_path, capsys):
    _train_memory(tmp_path, {"xpress": 1.0}, {"target_layers": 2})
    assert main(["gpu-hours", "--preset", "qwen3-8b", "--measured", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "training step, xpress:" in out and "- train xpress: steps: " in out and "train_memory.json" in out
    assert "- table 1: model" in out and "latency.json: not found" in out
    assert main(["gpu-hours", "--preset", "qwen3-8b", "--measured", "none"]) == 0
    assert "Measured constants" not in capsys.readouterr().out
    assert main(["gpu-hours", "--preset", "qwen3-8b", "--measured", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err and "none" in err
