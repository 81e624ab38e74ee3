"""The notebooks' "What this run found" text (xpress.findings), computed from small result files."""
import json

import pytest

from xpress import findings

from test_plots import results, table1_file, write  # noqa: F401  (results: the fixture of a results folder "p")


def train_file(folder, method, tau, prompts=4):
    write(folder, f"train_{method}", {"step": 30, "final_val": {"tau": tau, "prompts": prompts, "val_tf_tau": tau + 0.4},
                                      "log": [{"step": 30, "tf_tau": tau + 0.1, "tf_accept": [0.5, 0.2]}]})


def test_absent_files_are_said_absent(results):
    assert findings.cotraining("p") == "No train_<method>.json under results/p/: run notebook 03."
    assert findings.batched("p") == "No results/p/batched.json: run notebook 06."
    assert "No results/p/tau_vs_k.json" in findings.jacobi_and_latency("p")
    assert "No results/p/table1.json" in findings.speculative_decoding("p")


@pytest.mark.parametrize("xpress, verdict", [(2.4, "beats the plain drafter"), (2.01, "ties with the plain drafter"),
                                             (1.5, "trails the plain drafter")])
def test_cotraining_compares_tau_by_decoding(results, xpress, verdict):
    train_file(results, "dflash", 2.0, prompts=6)
    train_file(results, "markov", 2.0, prompts=6)
    train_file(results, "xpress", xpress, prompts=6)
    text = findings.cotraining("p")
    assert verdict in text and f"xpress: tau by decoding {xpress:.2f} on 6 held-out validation prompts" in text
    assert f"tau(xPress)/tau(dFlash) = {xpress / 2:.2f}" in text and text.count("\n- ") == 3  # 3 methods + the ratio


def batched_file(folder, same, runs=()):
    sizes = [1, 4]
    table = [{"batch_size": b, "method": m, "tau": t, "tokens_per_s": v * b, "same_as_ar_b1": 1.0 if b == 1 else same[m]}
             for b in sizes for m, t, v in (("ar", 1.0, 10.0), ("dflash", 1.5, 12.0), ("xpress", 1.6, 13.0))]
    write(folder, "batched", {"methods": ["ar", "dflash", "xpress"], "n_prompts": 8, "max_new_tokens": 16,
                              "reference_batch_size": 1, "table": table, "runs": list(runs), "warnings": []})


def test_batched_says_plainly_which_fraction_of_rows_equals_ar(results):
    batched_file(results, {"ar": 0.75, "dflash": 0.625, "xpress": 1.0})
    text = findings.batched("p")
    assert "**Exactness at batch 4: ar 75%, dflash 62%, xpress 100% of the 8 rows equal batch-1 AR's greedy output**" in text
    assert "NOT token-for-token lossless" in text
    assert "speedup over AR 1.30x, 1.30x" in text and "xPress / dFlash throughput: 1.08 at batch 1" in text
    assert "top-2 logit margin" not in text  # no divergences recorded (a file written before they were)
    runs = [{"batch_size": 4, "method": "ar", "divergences": [{"row": 1, "position": 3, "top2_margin": 0.03125},
                                                               {"row": 2, "position": None}]},
            {"batch_size": 4, "method": "dflash", "divergences": [{"row": 0, "position": 7, "top2_margin": 0.0}]}]
    batched_file(results, {"ar": 0.75, "dflash": 0.625, "xpress": 1.0}, runs)
    assert "top-2 logit margin where rows first differ: at most 0.0312" in findings.batched("p")
    batched_file(results, {"ar": 1.0, "dflash": 1.0, "xpress": 1.0})
    assert "NOT token-for-token lossless" not in findings.batched("p")


def test_speculative_decoding_reads_losslessness_table1_and_intervals(results):
    table1_file(results)
    t1 = json.loads((results / "table1.json").read_text())
    t1.update(block_size=4, prompts_per_benchmark=3, max_new_tokens=16)
    write(results, "table1", t1)
    write(results, "decoding_t0", {"table": [{"method": "oracle", "tau": 4.0, "lossless": True},
                                             {"method": "random", "tau": 1.0, "lossless": False}],
                                   "prompts": ["a", "b"], "max_new_tokens": 16})
    text = findings.speculative_decoding("p", {"oracle": 0.4, "xpress": 1e-5}, 1.0)
    assert "NOT every drafter (oracle, random)" in text and "on 2 prompts x 16 new tokens" in text
    assert "did not pass the chi-square test" in text and "oracle tau" not in text
    avg = next(r for r in t1["summary"] if r["bench"] == "avg" and r["temperature"] == 0.0 and r["method"] == "xpress")
    assert f"xpress tau {avg['tau']:.2f} ({avg['speedup']:.2f}x AR)" in text
    b = t1["bootstrap_tau_ratio"]["dflash"]["0.0"]["avg"]
    assert f"95% interval over prompts {b['lo']:.2f}-{b['hi']:.2f}" in text
    assert "Table 1 at T = 0, 3 prompts x 16 new tokens on each of 2 benchmarks" in text


def test_jacobi_findings_follow_the_tau_curve(results):
    summary = ([{"method": "xpress", "variant": f"K={k}", "K": k, "bench": "avg", "tau": t}
                for k, t in ((1, 1.5), (2, 1.9), (3, 2.0))]
               + [{"method": m, "variant": v, "K": None, "bench": "avg", "tau": t}
                  for m, v, t in (("dflash", "", 1.2), ("markov", "", 1.95), ("xpress", "sequential", 2.0))])
    write(results, "tau_vs_k", {"block_size": 4, "max_iters": 2, "prompts_per_benchmark": 5, "max_new_tokens": 32,
                                "benchmarks": ["a"], "weights": {"xpress": "trained"}, "summary": summary,
                                "passes": {"K=2": [1, 2, 2, 1], "K=3": [2, 3]}})
    text = findings.jacobi_and_latency("p")
    assert "average tau rises from 1.50 at K=1 to 2.00 at K=3, against the sequential decode's 2.00" in text
    assert "99% of it is reached at K=3" in text and "dFlash 1.20" in text
    assert "Adaptive stopping at K=2 used 1.50 passes per round on average (max 2, 4 rounds); with K=3, 2.50." in text
    assert "No H200 run yet" in text
    write(results, "latency", {"config": {"ks": [1, 4]}, "provenance": {"torch_threads": 2, "load_average_before": [0.5],
                                                                         "load_average_after": [0.7]},
                               "shape_sets": {"paper": {"shapes": {"name": "paper: X", "block_size": 4}, "readout": "float32",
                                                        "timings": {"markov": {"median_ms": 2.0}, "xpress K=1": {"median_ms": 0.5},
                                                                    "xpress K=4": {"median_ms": 1.0}},
                                                        "paired": {"markov_over_xpress_k4": {"median": 2.0, "min": 1.8,
                                                                                             "max": 2.2, "rounds": [1, 2, 3]}}}}})
    text = findings.jacobi_and_latency("p")
    assert ("Markov head 2.00 ms per block (3 serial steps); xPress K=1 0.50 ms, K=4 1.00 ms, so Markov / xPress K=4 = "
            "2.00x (range 1.80-2.20 over 3 paired rounds") in text and "load average 0.5 -> 0.7" in text


def test_theorems_reads_the_checks_and_the_counted_cost(results):
    write(results, "theorems", {"refiners": 3, "blocks": 4, "P": 5, "token_perturbations": 48, "hidden_nonzero": 25,
                                "local_nonzero": 15, "jacobi_passes": {"random": {"mean": 3.25, "max": 5}},
                                "changed_fraction": 0.4, "sampled_blocks": 24, "fold_max_rel_error": 3e-7,
                                "uniqueness": [{"V_d": 3, "P": 4, "blocks enumerated": 81, "refiners": 2, "fixed points": 1}]})
    text = findings.theorems("p")
    assert "all 48 perturbations of later tokens (3 random refiners x 4 blocks x 4 cut points)" in text
    assert "25 of 25 entries nonzero" in text and "lower-triangular (15 nonzeros), not the diagonal (5)" in text
    assert "from random seeds every Jacobi run reached the sequential decode in 3.25 passes on average (max 5, P = 5)" in text
    assert "V_d = 3, P = 4: 81 blocks x 2 refiners, 1 fixed point" in text and "3.0e-07" in text
    assert "Cost at the paper's shapes" not in text                         # no refiner_cost.json: not said
    write(results, "refiner_cost", {"table": [
        {"setting": "paper: Qwen3-8B", "method": m, "GFLOP / block": g, "weights read (M elem)": w, "serial steps": s}
        for m, g, w, s in (("xPress K=1", 1.0, 40.0, 1), ("xPress K=4", 4.0, 160.0, 4), ("Markov (15 steps)", 1.02, 600.0, 15))]})
    assert ("one Jacobi pass costs 1.00 GFLOP per block against the Markov head's whole serial decode's 1.02 (15 steps), "
            "but K = 4 passes stream 160M weight elements against its 600M") in findings.theorems("p")


def test_environment_names_what_the_code_chose():
    from types import SimpleNamespace

    import torch

    target = SimpleNamespace(name="tiny", num_layers=8, layer_ids=[1, 3, 5], compute_dtype=torch.bfloat16,
                             meta={"runtime": "lean", "kernels": "fused", "kernels_reason": "AVX512-BF16"})
    text = findings.environment("cpu", target, "Capital?", "Paris.")
    assert "tiny, 8 layers, computing in bfloat16 on the lean runtime with fused layers (AVX512-BF16)" in text
    assert "layers [1, 3, 5] (evenly spread from 1 to L-3 = 5)" in text and "it answered 'Paris.'" in text


def test_regeneration_and_figures(results):
    write(results, "regen_manifest", {"sequences": {"train": 10, "val": 2}, "response_tokens": {"train": 900, "val": 80},
                                      "finish_reasons": {"stop": 3, "length": 9}, "signature": {"regen_max_new_tokens": 64},
                                      "skipped_long_prompts": 1, "max_prompt_tokens": 32, "feature_bytes_per_token": 10,
                                      "disk_bytes": 2e6})
    check = {"sequence": "gsm8k-3", "answer_tokens": 40, "greedy_agreement": 1.0, "has_states": False}
    text = findings.regeneration("p", check, 512, 0.9)
    assert "25% ended by themselves, the rest were cut at 64 tokens" in text and "No target states were cached" in text
    assert "512 tokens (drafter.draft_vocab_size) covers 90.0%" in text
    text = findings.figures("p", {"shown": ["table1"], "missing": ["levers", "regeneration"]})
    assert "Showed 1 of 3 figures" in text and "levers (run make studies)" in text and "regeneration (run notebook 01)" in text
