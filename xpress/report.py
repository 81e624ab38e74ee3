"""The README's measured numbers, generated from the result files (never typed by hand).

    python -m xpress report --preset cpu          # rewrites the marked section of README.md
    python -m xpress report --preset cpu --check  # exit 1 if README.md and results/ disagree

The section between ``<!-- results:<preset>:begin -->`` and ``<!-- results:<preset>:end -->`` is
:func:`results_markdown` of ``results/<preset>/``, and the one between ``<!-- durations:<preset>:begin -->``
and ``<!-- durations:<preset>:end -->`` (in "Two commands") is :func:`durations_markdown` of its
``run.json``; a test fails when they differ.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import paths
from .utils import cpu_class

README = paths.REPO_ROOT / "README.md"


def _markers(preset: str, kind: str = "results") -> tuple[str, str]:
    return f"<!-- {kind}:{preset}:begin -->", f"<!-- {kind}:{preset}:end -->"


def _load(folder: Path, name: str) -> dict | None:
    f = folder / name
    return json.loads(f.read_text()) if f.is_file() else None


def _where(prov: dict, dtype: bool = True) -> str:
    """Machine, threads, git revision and date of a provenance block, in words (``dtype``: name the target's
    compute dtype; off for files that time several dtypes)."""
    m = prov.get("machine", {})
    tag = "" if m.get("gpu") else cpu_class(prov, dtype)
    read = [x for x in prov.get("memory_read_gb_per_s") or [] if x is not None]  # LoadRecord's, where recorded
    memory = f", memory read {' then '.join(f'{x:.0f}' for x in read)} GB/s" if read else ""
    return (f"{m.get('gpu') or m.get('cpu_model') or m.get('processor', '?')}{f' ({tag})' if tag else ''}, "
            f"{m.get('torch_threads', '?')} torch threads{memory}; "
            f"git {prov.get('git_revision', '?')[:7]}{' (dirty)' if prov.get('git_dirty') else ''}, {prov.get('date', '?')[:10]}")


def _num(x, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def _table1_section(t1: dict) -> list[str]:
    """Table 1 (``table1.json``): per temperature, tau and speedup per benchmark and on average, xPress's
    gains with their bootstrap intervals, the paper's averages beside them, flags and warnings."""
    from .studies.table1 import PAPER_AVG

    cells = {(r["temperature"], r["method"], r["bench"]): r for r in t1["summary"]}
    benches = list(t1["benchmarks"]) + ["avg"]
    methods = ["ar"] + [m for m in t1["methods"] if m != "ar"]
    seeds = t1.get("sampling_seeds") or []
    out = [f"**Table 1** (`table1.json`, notebook 04 or `python -m xpress.studies.table1 --preset {t1['preset']}`): "
           f"tau and speedup over AR per benchmark, batch 1, {t1['prompts_per_benchmark']} prompts x "
           f"{t1['max_new_tokens']} new tokens per benchmark, "
           + ("" if "draft_tokens" not in t1 else
              f"block size {t1['block_size']}, each round verifying the anchor and {t1['draft_tokens']} drafted tokens "
              f"(`decode.draft_tokens`), ")
           + f"AR and the methods interleaved per prompt; T = 0: median "
           f"of {t1['repeats']} timed passes (speedup range in brackets), every output equal to AR's: {t1['lossless_t0']}; "
           f"T > 0: mean over seeds {seeds} (tau +- sd); drafters {', '.join(f'{m} {w}' for m, w in t1['weights'].items() if m != 'ar')}; "
           f"{_where(t1['provenance'])}.", ""]
    flagged = False
    for t in t1["temperatures"]:
        out += [f"T = {t:g}:", "", "| method | " + " | ".join(f"{b} tau / speedup" for b in benches) + " |",
                "|---|" + "---|" * len(benches)]
        for m in methods:
            row = []
            for b in benches:
                c = cells.get((t, m, b))
                if c is None:
                    row.append("-")
                    continue
                sd = f" +- {c['tau_sd']:.2f}" if t > 0 and c.get("seeds", 1) > 1 else ""
                rng = (f" [{c['speedup_lo']:.2f}-{c['speedup_hi']:.2f}]" if t == 0 and c.get("repeats", 1) > 1
                       and m != "ar" else "")
                mark = " (!)" if c.get("flag") else ""
                flagged = flagged or bool(mark)
                row.append(f"{c['tau']:.2f}{sd} / {c['speedup']:.2f}x{rng}{mark}")
            out.append(f"| {m} | " + " | ".join(row) + " |")
        out.append("")
        gains = {(g["baseline"], g["bench"]): g for g in t1["gains"] if g["temperature"] == t}
        boot = t1.get("bootstrap_tau_ratio", {})
        parts = []
        for base, name in (("dflash", "dFlash"), ("markov", "Markov")):
            g = gains.get((base, "avg"))
            if g:
                ci = boot.get(base, {}).get(str(float(t)), {}).get("avg")
                ci_s = f" (95% bootstrap interval over prompts {ci['lo']:.2f}-{ci['hi']:.2f})" if ci else ""
                parts.append(f"tau(xPress) / tau({name}) = {g['tau_ratio']:.2f}{ci_s}, speedup ratio "
                             f"{g['speedup_ratio']:.2f}")
        paper = PAPER_AVG.get(float(t))
        if parts:
            line = "; ".join(parts) + "."
            if paper:
                line += (f" The paper's Table 1 (Qwen3-8B, average of seven benchmarks, T = {t:g}): tau dFlash "
                         f"{paper['dflash']['tau']:.2f}, Markov {paper['markov']['tau']:.2f}, xPress "
                         f"{paper['xpress']['tau']:.2f} (xPress / dFlash = {paper['xpress']['tau'] / paper['dflash']['tau']:.2f}); "
                         f"speedup {paper['dflash']['speedup']:.1f}x, {paper['markov']['speedup']:.1f}x, "
                         f"{paper['xpress']['speedup']:.1f}x.")
            out += [line, ""]
    needed = [r for r in t1.get("prompts_needed", []) if r["kind"] == "paired" and r["method"] == "xpress/dflash"
              and r["needed"] is not None]
    if needed:
        worst = max(needed, key=lambda r: r["needed"])
        out += [f"Prompts per benchmark for a 5% tau difference between xPress and dFlash to fall outside the spread "
                f"(paired, from the per-prompt variance): up to {worst['needed']} ({worst['bench']}, T = "
                f"{worst['temperature']:g}); this run used {t1['prompts_per_benchmark']}.", ""]
    if flagged:
        out += ["(!) the speedup contradicts its own tau (above tau, or above tau / verify cost): "
                "not a result; rerun on an idle machine.", ""]
    for w in t1.get("warnings", []):
        out += [f"Warning: {w}", ""]
    return out


def _cpu_engine_section(preset: str, cost: dict | None, ceiling: dict | None) -> list[str]:
    """The target's step and verify per runtime and dtype (``target_cost.json``) and the project's AR against
    the path before the lean runtime and against transformers' ``generate()`` (``oracle_ceiling.json``)."""
    out: list[str] = []
    if cost:
        out += [f"Target forward cost (`target_cost.json`, `python -m xpress bench target-cost --preset {preset}`; "
                f"median ms, batch 1, {_where(cost['provenance'], dtype=False)}):", "",
                "| runtime | dtype | context | 1-token step | verify of B | verify / step (break-even tau) |",
                "|---|---|---|---|---|---|"]
        for b in cost["break_even"]:
            out.append(f"| {b['runtime']} | {b['dtype']} | {b['context']} | {b['step_ms']:.1f} | {b['verify_ms']:.1f} "
                       f"(B = {b['block']}) | {b['verify_over_step']:.2f} |")
        out.append("")
    cmp = (ceiling or {}).get("compare")
    if cmp:
        rt = ceiling.get("runtime") or {}
        out += [f"Autoregressive decoding, same prompts, same run (`oracle_ceiling.json`): the project's AR "
                f"({rt.get('runtime', '?')} runtime, {rt.get('dtype', '?')}"
                f"{', ' + rt['kernels'] + ' layers' if rt.get('kernels') else ''}) {ceiling['ar_tokens_per_s']:.1f} tokens/s; "
                f"before the lean runtime (transformers forward, float32) {cmp['ar_old']['tokens_per_s']:.1f} "
                f"({cmp['ar_over_old']:.2f}x); transformers' `generate()` in {rt.get('dtype', '?')} "
                f"{cmp['generate']['tokens_per_s']:.1f} (dynamic cache) and {cmp['generate_static']['tokens_per_s']:.1f} "
                f"(static cache): ours / the faster = {cmp['ar_over_generate']:.2f}x. Speculative output equals "
                f"greedy AR on {'every' if ceiling['lossless'] else 'NOT every'} prompt "
                f"({len(ceiling['mismatched_prompts'])} of {ceiling['n_prompts']} differ).", ""]
    return out


def roofline_line(roof: dict) -> str:
    """The README's line on the floor of a step and a verify (``oracle_ceiling.json``'s ``roofline``)."""
    peak = roof.get("peak_macs_per_s")
    peak_text = f" (the instruction's peak {peak / 1e9:.0f} G/s)" if peak else ""
    return (f"- the floor (`oracle_ceiling.json`, `roofline`): the products read {roof['weight_bytes'] / 1e6:.0f} MB "
            f"of {roof['product_dtype']} weights per forward and this machine's {roof['threads']} threads read "
            f"{roof['read_gb_per_s']:.1f} GB/s, so no step or verify takes under {roof['memory_floor_s'] * 1e3:.2f} ms; "
            f"the product kernel multiplies {roof['product_macs_per_s'] / 1e9:.0f} G/s at {roof['rows']} rows on cached "
            f"weights{peak_text}, so a {roof['rows']}-token verify needs at least {roof['compute_floor_s'] * 1e3:.2f} ms. "
            f"Floor of the verify: {roof['floor_ratio']:.2f} one-token steps ({roof['step_1_s'] * 1e3:.2f} ms, itself "
            f"{roof['step_over_memory_floor']:.2f}x its memory floor); attention, norms and dispatch are not in it.")


def _verify_contexts(ceiling: dict) -> str:
    """``" after 114 tokens of context, 1.38x after 300"``: the contexts of ``verify_cost`` and
    ``verify_cost_long`` (files before the latter have only the first)."""
    first, long = ceiling["verify_cost"].get("context_tokens"), ceiling.get("verify_cost_long")
    out = f" after {first} tokens of context" if first else ""
    return out + (f", {long['loop_ratio']:.2f}x after {long['context_tokens']}" if long else "")


def _break_even_section(folder: Path, t1: dict | None, ceiling: dict | None) -> list[str]:
    """The tau at which speculative decoding breaks even on this machine, next to the measured tau."""
    out = []
    if ceiling:
        out.append(f"- verify of {ceiling['block_size']} tokens / 1-token step = {ceiling['verify_cost']['loop_ratio']:.2f} "
                   f"(`oracle_ceiling.json`, timed forwards): the break-even tau of a drafter that costs nothing "
                   f"at that block size.")
        roof = ceiling.get("roofline")
        if roof and "memory_floor_s" in roof:
            out.append(roofline_line(roof))
        elif roof:  # an oracle_ceiling.json written before the memory floor was measured (a float32 bound only)
            out.append(f"- the arithmetic floor (`oracle_ceiling.json`, `roofline`): this machine's {roof['threads']} threads "
                       f"sustain {roof['fma_per_s'] / 1e9:.1f} G float32 multiply-adds/s together (8-lane FMA chains in "
                       f"registers; one thread alone {roof['fma_per_s_one_thread'] / 1e9:.1f}); a "
                       f"{roof['rows']}-token verify needs {roof['macs_per_token'] / 1e6:.0f} M of them per token, at least "
                       f"{roof['verify_floor_s'] * 1e3:.1f} ms = {roof['floor_ratio']:.2f} one-token steps "
                       f"({roof['step_1_s'] * 1e3:.1f} ms, reading {roof['step_weight_gb_per_s']:.1f} GB/s of float32 weights) "
                       f"for a float32 kernel of 8-lane FMAs.")
            dtype = (ceiling.get("runtime") or {}).get("dtype", "float32")
            if dtype != "float32":
                out[-1] += (f" This target computes in {dtype}, so that floor does not bind it, and its step reads "
                            f"half those bytes.")
    if t1:
        for c in t1.get("stage_costs", []):
            if c["temperature"] == 0:
                out.append(f"- {c['method']}: verify / AR step = {_num(c['verify_ratio'])}, break-even tau with its "
                           f"drafting = {_num(c['break_even_tau'])} (`table1.json`, its own stage timings at T = 0); "
                           f"measured tau {c['tau']:.2f}.")
    if not out:
        return []
    return ["**Break-even tau on this machine** (a method is faster than AR once its tau exceeds it):", ""] + out + [""]


def _draft_length_section(dl: dict) -> list[str]:
    """Speed against the drafted tokens a round verifies (``draft_length.json``), one row per (method, k)."""
    B = dl["block_size"]
    out = [f"**Verify length** (`draft_length.json`, `{dl['command']}`; T = 0, batch 1, "
           f"{dl['prompts_per_benchmark']} prompts per benchmark x {dl['max_new_tokens']} new tokens, AR and every "
           f"(method, k) interleaved per prompt, {dl['repeats']} pass(es); {_where(dl['provenance'])}): a round "
           f"verifies the anchor and the drafter's first k tokens (`decode.draft_tokens`; k = {B - 1} is the whole "
           f"block, as the paper verifies). Every output equal to AR's: {dl['lossless_t0']}.", "",
           "| method | k | tau | speedup over AR (pooled) | per-prompt quartiles | verify / AR step | drafting ms a round |",
           "|---|---|---|---|---|---|---|"]
    for r in dl["table"]:
        if r["method"] == "ar":
            continue
        out.append(f"| {r['method']} | {r['k']} | {r['tau']:.2f} | {r['speedup']:.2f}x | {r['speedup_q1']:.2f}-"
                   f"{r['speedup_q3']:.2f} | {r['verify_steps']:.2f} | {r['draft_ms']:.1f} |")
    b = dl["best"]
    ar = next(r for r in dl["table"] if r["method"] == "ar")
    best = next(r for r in dl["table"] if (r["method"], r["k"]) == (b["method"], b["k"]))
    out += ["", f"Fastest: {b['method']} at k = {b['k']}, {b['speedup']:.2f}x AR ({best['tokens_per_s']:.1f} tokens/s "
                f"against AR's {ar['tokens_per_s']:.1f}) with tau {b['tau']:.2f}.", ""]
    return out


def _anchor_bias_section(ab: dict) -> list[str]:
    """Teacher forcing against decoding at the same anchors (``anchor_bias.json``), one row per (method, k)."""
    out = [f"**Teacher forcing against decoding** (`anchor_bias.json`, `{ab['command']}`; T = 0, batch 1, the first "
           f"{ab['n_prompts']} {ab.get('split', 'val')} prompts decoded to the end of their regenerated answers; "
           f"{_where(ab['provenance'])}): the teacher-forced acceptance at the anchors decoding used, the share of "
           f"rounds where it equals what the verify accepted, and the teacher-forced acceptance at every anchor of "
           f"the same answers (what training's random anchors estimate). Every output equal to the regenerated "
           f"answer: {all(r['output_is_regenerated'] for r in ab['table'])}.", "",
           "| method | k | rounds | tau by decoding | teacher-forced, its anchors | agreement | teacher-forced, every anchor |",
           "|---|---|---|---|---|---|---|"]
    for r in ab["table"]:
        out.append(f"| {r['method']} | {r['k']} | {r['rounds']} | {r['decode_tau']:.3f} | {r['tf_tau_decode_anchors']:.3f} | "
                   f"{r['agreement']:.3f} | {r['tf_tau_every_anchor']:.3f} |")
    return out + [""]


def _draft_temperature_section(dt: dict) -> list[str]:
    """tau at T > 0 with the drafters drawing at other temperatures (``draft_temperature.json``)."""
    out = [f"**The drafters' own temperature at T = {dt['temperature']:g}** (`draft_temperature.json`, `{dt['command']}`; "
           f"{dt['prompts_per_benchmark']} prompts per benchmark x {dt['max_new_tokens']} new tokens, batched, every "
           f"drafter on the same prompts and random streams; {_where(dt['provenance'])}): tau when the drafters draw at "
           f"t_d (0: greedy drafts, q one-hot), and its ratio to drawing at T with the paired bootstrap 95% interval; "
           f"every row is lossless, since q is what each draft was drawn from.", "",
           "| method | " + " | ".join(f"t_d = {t:g}" for t in dt["draft_temperatures"]) + " |",
           "|---|" + "---|" * len(dt["draft_temperatures"])]
    for m in dt["methods"]:
        cells = {r["draft_temperature"]: r for r in dt["table"] if r["method"] == m}
        out.append(f"| {m} | " + " | ".join(
            f"{cells[t]['tau']:.3f} (x{cells[t]['ratio']:.3f} [{cells[t]['lo']:.3f}, {cells[t]['hi']:.3f}])"
            for t in dt["draft_temperatures"]) + " |")
    return out + [""]


def _regen_speed_section(rs: dict) -> list[str]:
    """Regeneration's two engines timed in one run (``regen_speed.json``), one row per engine and batch size."""
    out = [f"**Regeneration engines** (`regen_speed.json`, `{rs['command']}`; the first {rs['prompts']} regeneration "
           f"prompts, at most {rs['max_new_tokens']} new tokens, states captured, engines interleaved, "
           f"{rs['repeats']} repeat(s); {_where(rs['provenance'])}): the continuous engine's answers equal batch-1 AR's "
           f"({rs['checked_against_ar']} prompts checked): {rs['continuous_equals_batch1_ar']}; equal across its batch "
           f"sizes: {rs['continuous_equal_across_batch_sizes']}.", "",
           "| engine | batch | response tokens/s (median) | vs ragged batches | answers equal to the continuous engine's |",
           "|---|---|---|---|---|"]
    for r in rs["table"]:
        out.append(f"| {r['engine']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['ratio_to_batched']:.2f}x | "
                   f"{r['answers_equal_to_continuous']}/{rs['prompts']} |")
    return out + [""]


def _train_speed_section(ts: dict) -> list[str]:
    """A co-training step, the path before against the kernels (``train_speed.json``), one row per method and arm."""
    out = [f"**A co-training step** (`train_speed.json`, `{ts['command']}`; {ts['batch_size']} sequences x "
           f"{ts['anchors_per_seq']} blocks of {ts['block_size']}, the arms interleaved step by step on the same batches, "
           f"{ts['steps']} timed steps each; {_where(ts['provenance'])}): `before` runs the loss and the drafter's "
           "attention as PyTorch operations, the others the C++ kernels (`train.loss_kernel`, `train.attention_kernel`); "
           "the gradients are those of one batch at the same weights, against the path before's.", "",
           "| method | arm | ms a step (median) | vs before | tokens/s | gradient difference, float32 | under the run's autocast |",
           "|---|---|---|---|---|---|---|"]
    for r in ts["table"]:
        f32 = r.get("same_grad_rel_diff_float32")
        out.append(f"| {r['method']} | {r['arm']} | {1e3 * r['step_s']:.1f} | {r['ratio_to_before']:.3f}x | "
                   f"{r['tokens_per_s']:.0f} | {'-' if f32 is None else f'{f32:.1e}'} | {r['same_grad_rel_diff']:.1e} |")
    return out + [""]


def _latency_section(lat: dict) -> list[str]:
    """``latency.json`` (notebook 05) read defensively: its table's columns as stored."""
    from .plots import records

    if isinstance(lat, dict) and lat.get("shape_sets"):  # notebook 05's layout (xpress.studies.latency)
        from .studies.latency import latency_rows

        rows = [r for r in latency_rows(lat) if r["component"].startswith(
                ("markov", "xpress K=", "xpress readout", "target", "drafter forward"))]
    else:
        rows = records(lat)
    if not rows:
        return []
    cols = [k for k in rows[0] if isinstance(rows[0][k], (int, float, str)) and not isinstance(rows[0][k], bool)][:8]
    where = f"; {_where(lat['provenance'])}" if isinstance(lat, dict) and isinstance(lat.get("provenance"), dict) else ""
    cmd = lat.get("command", "notebook 05") if isinstance(lat, dict) else "notebook 05"
    out = [f"**Latency** (`latency.json`, {cmd}{where}):", "", "| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for r in rows:
        out.append("| " + " | ".join(_num(r.get(c), ".4g") if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                     for c in cols) + " |")
    out.append("")
    for name, s in (lat.get("shape_sets") or {}).items() if isinstance(lat, dict) else ():
        if s.get("markov_over_xpress_k4"):
            paired = s.get("paired") or {}

            def ratio(key: str) -> str:
                p = paired.get(key)
                spread = f" (range {p['min']:.2f}-{p['max']:.2f} over {len(p['rounds'])} rounds)" if p else ""
                return f"{s[key]:.2f}x{spread}"
            line = (f"- {name}: Markov decode / xPress K=4 = {ratio('markov_over_xpress_k4')} "
                    f"(readout: {s.get('readout', 'float32')})")
            if s.get("markov_float32_over_xpress_k4"):
                line += f"; with the Markov head on its float32 readout, {ratio('markov_float32_over_xpress_k4')}"
            if s.get("readout_only_k4"):
                line += (f"; the readouts alone (1 row per step, P rows per pass) would allow "
                         f"{ratio('readout_only_k4')}")
            out.append(line)
    if isinstance(lat, dict) and lat.get("shape_sets"):
        from .studies.table3 import PAPER_MARKOV_DRAFT_SHARE, PAPER_TABLE3_US as us

        line = (f"- the paper's Table 3 (one H200, its numbers): Markov head {us['markov']} us, xPress K=4 "
                f"{us['xpress K=4']} us, so Markov / xPress K=4 = {us['markov'] / us['xpress K=4']:.2f}x; K=1..8: "
                + ", ".join(str(v) for k, v in us.items() if k != "markov") + " us. Its Figure 4: the Markov decode "
                f"is about {PAPER_MARKOV_DRAFT_SHARE:.0%} of the draft side (drafter forward + base readout + refinement)")
        for name, s in lat["shape_sets"].items():
            m = (s.get("composition") or {}).get("markov")
            if m:
                line += f"; here, {name} shapes: {100 * m['refine_ms'] / m['draft_side_ms']:.0f}%"
        out.append(line)
    return out + [""]


def _gpu_section(folder: Path) -> list[str]:
    """The GPU latency script's results (``results/h200/latency.json``) beside the paper's Table 3, or a
    line saying they have not been measured."""
    h200 = _load(folder.parent / "h200", "latency.json")
    cmd = "`python scripts/gpu_latency.py`"
    if not h200:
        return [f"**GPU latency (H200)**: not measured yet; {cmd} on one H200 writes `results/h200/latency.json`, "
                "shown here and in notebook 05 when present.", ""]
    from .studies.table3 import beside_paper_table3

    out = [f"**GPU latency (H200)** (`results/h200/latency.json`, {cmd}; {_where(h200['provenance'])}): per block, "
           "beside the paper's Table 3 (its numbers, labelled paper):", "",
           "| shapes | component | measured as | median_ms | ratio_to_markov | paper us | paper ratio_to_markov |",
           "|---|---|---|---|---|---|---|"]
    for r in beside_paper_table3(h200):
        out.append(f"| {r['shapes']} | {r['component']} | {r['measured_as']} | {r['median_ms']:.4g} | "
                   f"{r['ratio_to_markov']:.3f} | {r['paper_us']} | {r['paper_ratio_to_markov']:.3f} |")
    out.append("")
    for name, s in h200["shape_sets"].items():
        t, eager = s["timings"], (s.get("paired") or {}).get("markov_over_xpress_k4")
        line = f"- {name} shapes, eager (no graphs):"
        if eager:
            line += f" Markov / xPress K=4 = {eager['median']:.2f}x (range {eager['min']:.2f}-{eager['max']:.2f} over paired rounds);"
        b = (s.get("shapes") or {}).get("block_size")
        step, verify = t.get("target step (1 token)"), t.get(f"target verify ({b} tokens)")
        if step and verify:
            line += (f" the random bf16 target (transformers forward, batch 1): a 1-token step {step['median_ms']:.1f} ms, "
                     f"a {b}-token verify {verify['median_ms']:.1f} ms ({verify['median_ms'] / step['median_ms']:.2f}x)")
        framed = [(k, v) for k, v in t.items() if k.startswith("target step (1 token, frames of")]
        for k, fstep in framed:  # target.frame_rows (exact T = 0 on the GPU)
            frames = k.removeprefix("target step (1 token, frames of ").removesuffix(")")
            fverify = t.get(f"target verify ({b} tokens, frames of {frames})")
            if fverify:
                line += (f"; on frames of {frames} positions (`target.frame_rows`): step {fstep['median_ms']:.1f} ms, "
                         f"verify {fverify['median_ms']:.1f} ms ({fverify['median_ms'] / fstep['median_ms']:.2f}x)")
        out.append(line.rstrip(";") + ".")
    exact = _load(folder.parent / "h200", "oracle_ceiling.json")
    if exact:
        c, frames = exact["compare"], exact["runtime"].get("frame_rows")
        out.append(f"- lossless on the GPU (`results/h200/oracle_ceiling.json`, `bash scripts/device_check.sh`; "
                   f"{_where(exact['provenance'])}): the {exact['preset']} stand-in target in {exact['runtime']['dtype']}, "
                   f"transformers forward{f' on {frames}-position frames' if frames else ''}: "
                   f"{exact['n_prompts'] - len(exact['mismatched_prompts'])} of {exact['n_prompts']} prompts equal to greedy "
                   f"AR with the oracle drafter (tau {exact['tau']:.1f}); a {exact['verify_cost']['block_size']}-token verify "
                   f"{exact['verify_cost']['loop_ratio']:.2f}x a step; AR {exact['ar_tokens_per_s']:.0f} tokens/s, "
                   f"transformers' generate() {c['generate']['tokens_per_s']:.0f} (dynamic cache) and "
                   f"{c['generate_static']['tokens_per_s']:.0f} (static cache).")
    return out + [""]


def _resolution_section(res: dict, t1: dict | None = None) -> list[str]:
    """tau ratios on many prompts (``resolution.json``): per temperature and baseline, the average and
    per-benchmark intervals, and which are resolved at ``rel``; a note when its block size is not Table 1's
    (``t1``): the study then scored drafters of an earlier preset."""
    benches = list(res["benchmarks"]) + ["avg"]
    cells = {(r["temperature"], r["baseline"], r["bench"]): r for r in res["table"]}
    out = [f"**tau on more prompts** (`resolution.json`, `python -m xpress.studies.resolution --preset {res['preset']}` "
           f"or notebook 04, section 4): {res['prompts_per_benchmark']} prompts per benchmark x {res['max_new_tokens']} "
           f"new tokens, tau only (batched, no clock); tau(xPress) / tau(baseline) with its paired bootstrap 95% interval; "
           f"resolved (*) when the interval's half-width is at most {res['rel']:.0%}"
           + (f"; {res['seconds'] / 60:.0f} min" if res.get("seconds") else "") + f"; {_where(res['provenance'])}.", "",
           "| T | baseline | " + " | ".join(benches) + " |", "|---" * (len(benches) + 2) + "|"]
    for t in res["temperatures"]:
        for base in ("dflash", "markov"):
            row = [cells.get((float(t), base, b)) for b in benches]
            if not any(row):
                continue
            out.append(f"| {t:g} | {base} | " + " | ".join(
                "-" if c is None else f"{c['tau_ratio']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]{' *' if c['resolved'] else ''}"
                for c in row) + " |")
    if t1 and res.get("block_size") and t1.get("block_size") and res["block_size"] != t1["block_size"]:
        out += ["", f"These ratios are of drafters with block size {res['block_size']}, Table 1's have "
                    f"{t1['block_size']}: the study ran at another setting; `make studies` runs it at the preset's."]
    return out + [""]


def _batched_section(b: dict) -> list[str]:
    rows = {(r["batch_size"], r["method"]): r for r in b["table"]}
    methods = list(b["methods"])
    out = [f"**Batched throughput** (`batched.json`, notebook 06 or `python -m xpress.studies.batched --preset "
           f"{b['preset']}`): tokens/s (speedup over AR, tau), greedy, the same {b['n_prompts']} prompts x "
           f"{b['max_new_tokens']} new tokens at every batch size; {_where(b['provenance'])}.", "",
           "| batch | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for bs in b["batch_sizes"]:
        cells = []
        for m in methods:
            r = rows.get((bs, m))
            cells.append("-" if r is None else f"{r['tokens_per_s']:.1f} ({r['speedup']:.2f}x, tau {r['tau']:.2f})")
        out.append(f"| {bs} | " + " | ".join(cells) + " |")
    from .studies.batched import PAPER_TABLE2 as paper

    per_batch = "; ".join(f"batch {bs}: " + ", ".join(f"{bench} {paper[bs]['dflash'][bench]}x / {paper[bs]['xpress'][bench]}x"
                                                     for bench in paper[bs]["dflash"]) for bs in (16, 32))
    taus = ", ".join(f"{bench} {paper['tau']['dflash'][bench]} / {paper['tau']['xpress'][bench]}" for bench in paper["tau"]["dflash"])
    out += ["", f"The paper's Table 2 (vLLM on one H200, Qwen3-8B, greedy; its numbers): speedup over AR, dFlash / "
                f"xPress, {per_batch}; tau, dFlash / xPress: {taus}."]
    for w in b.get("warnings", []):
        out += ["", f"Warning: {w}"]
    return out + [""]


# Files that `make studies` (or the command each names) writes, not `make reproduce`: each keeps its own revision.
STUDY_FILES = ("oracle_ceiling.json", "levers.json", "generalisation.json", "resolution.json", "draft_length.json",
               "regen_speed.json", "anchor_bias.json", "train_speed.json", "vocab_reach.json", "draft_temperature.json")


def _study_files(preset: str) -> tuple[str, ...]:
    """:data:`STUDY_FILES` for ``preset``: ``resolution.json`` is a notebook file where the preset runs it in
    notebook 04 (``eval.resolution_in_run``)."""
    from .config import ConfigError, load_config

    try:
        in_run = load_config(preset).eval.resolution_in_run
    except ConfigError:  # results of no preset by that name (tests): every study file is a study's
        in_run = False
    return tuple(n for n in STUDY_FILES if not (in_run and n == "resolution.json"))


# Files that decode with the trained drafters (and name them by their weights' fingerprints).
DECODING_FILES = ("table1.json", "tau_vs_k.json", "batched.json", "resolution.json", "draft_length.json",
                  "anchor_bias.json", "draft_temperature.json")


def _origin_section(preset: str, folder: Path) -> list[str]:
    """Where the files come from: the ``make reproduce`` that wrote ``run.json`` (revision, machine, minutes),
    every notebook file whose provenance names another revision (so a mixed set cannot pass for one run),
    and each study file with its own revision."""
    provs: dict[str, dict] = {}
    for f in sorted(folder.glob("*.json")):
        data = json.loads(f.read_text())
        prov = data.get("provenance") if isinstance(data, dict) else None
        if isinstance(prov, dict) and f.name != "run.json":
            provs[f.name] = prov
    run = _load(folder, "run.json")
    study_files = _study_files(preset)
    out: list[str] = []
    if run:
        rp = run["provenance"]
        rev = rp.get("git_revision")
        if run.get("total_seconds") is not None:
            out.append(f"**Where these numbers come from.** One `make reproduce` (`python -m xpress run --preset "
                       f"{preset}`, {run['total_seconds'] / 60:.0f} min of notebooks; `run.json`) on {_where(rp)} "
                       f"wrote the notebooks' files.")
        else:
            revs = sorted({(r.get("git_revision") or "?")[:7] for r in run.get("notebooks", [])
                           if r.get("seconds") is not None})
            out.append(f"**Where these numbers come from.** No single `make reproduce` wrote the notebooks' files: "
                       f"their last runs are at git {', '.join(revs)} (`run.json`).")
        others = [f"`{n}` (git {(p.get('git_revision') or '?')[:7]}{', dirty' if p.get('git_dirty') else ''})"
                  for n, p in provs.items()
                  if n not in study_files and (p.get("git_revision") != rev or p.get("git_dirty"))]
        if run.get("total_seconds") is not None:
            out.append(f"Notebook files from another revision or a dirty tree: {', '.join(others)}." if others
                       else "Every notebook file is from that revision, with a clean tree.")
    studies = [f"`{n}` ({_where(provs[n])})" for n in study_files if n in provs]
    if studies:
        out.append("Studies outside `make reproduce` (`make studies` or their own command), each at its own revision: "
                   + "; ".join(studies) + ".")
    out += _drafters_sentence(folder)
    return [" ".join(out), ""] if out else []


def _drafters_sentence(folder: Path) -> list[str]:
    """Which trained drafters the decoding files decoded: their ``fingerprints``
    (:func:`xpress.proposer.checkpoint_fingerprint`) against the weights ``train_<method>.json`` says its stage
    saved. Nothing when no training file records a fingerprint (runs before fingerprints)."""
    trained = {m: (_load(folder, f"train_{m}.json") or {}).get("fingerprint") for m in ("dflash", "markov", "xpress")}
    trained = {m: f for m, f in trained.items() if f}
    if not trained:
        return []
    same, other, unnamed = [], [], []
    for name in DECODING_FILES:
        data = _load(folder, name)
        if data is None:
            continue
        prints = data.get("fingerprints")
        if prints is None:
            unnamed.append(f"`{name}`")
        elif not prints:  # no drafter from a checkpoint (untrained or reference drafters only)
            continue
        elif all(trained.get(m) == fp for m, fp in prints.items()):
            same.append(f"`{name}`")
        else:
            other.append(f"`{name}` ({', '.join(m for m, fp in prints.items() if trained.get(m) != fp)})")
    out = []
    if same:
        out.append(f"{', '.join(same)} decoded the drafters this run trained (the weight fingerprints that "
                   "`train_<method>.json` records).")
    if other:
        out.append(f"Other drafters than this run's: {', '.join(other)}.")
    if unnamed:
        out.append(f"No fingerprint recorded (written before studies named their drafters): {', '.join(unnamed)}.")
    return out


def results_markdown(preset: str, folder: Path | None = None) -> str:
    """The README section for ``preset`` from the repository's ``results/<preset>/`` (what exists of it;
    the README describes the committed results, whatever ``$XPRESS_RESULTS`` says)."""
    folder = folder or paths.REPO_ROOT / "results" / preset
    out: list[str] = _origin_section(preset, folder)
    t1 = _load(folder, "table1.json")
    if t1:
        out += _table1_section(t1)
    res = _load(folder, "resolution.json")
    if res:
        out += _resolution_section(res, t1)
    ceiling = _load(folder, "oracle_ceiling.json")
    out += _break_even_section(folder, t1, ceiling)
    dl = _load(folder, "draft_length.json")
    if dl:
        out += _draft_length_section(dl)
    ab = _load(folder, "anchor_bias.json")
    if ab:
        out += _anchor_bias_section(ab)
    dtemp = _load(folder, "draft_temperature.json")
    if dtemp:
        out += _draft_temperature_section(dtemp)
    out += _cpu_engine_section(preset, _load(folder, "target_cost.json"), ceiling)
    lat = _load(folder, "latency.json")
    if lat:
        out += _latency_section(lat)
    out += _gpu_section(folder)
    batched = _load(folder, "batched.json")
    if batched:
        out += _batched_section(batched)
    stages = [s for s in ("warmstart", "dflash", "markov", "xpress") if (folder / f"train_{s}.json").is_file()]
    if stages:
        out += ["Training (`train_<stage>.json`; tau by decoding on held-out regenerated prompts at the end):", "",
                "| stage | method | steps | seconds | final loss | teacher-forced tau | validation tau |", "|---|---|---|---|---|---|---|"]
        for s in stages:
            t = _load(folder, f"train_{s}.json")
            last = t["log"][-1] if t["log"] else {}
            val = (t.get("final_val") or {}).get("tau")
            out.append(f"| {s} | {t['method']} | {t['step']} | {t['seconds']:.0f} | {last.get('loss', float('nan')):.3f} | "
                       f"{last.get('tf_tau', float('nan')):.2f} | {'-' if val is None else f'{val:.2f}'} |")
        out.append("")
    speed = _load(folder, "train_speed.json")
    if speed:
        out += _train_speed_section(speed)
    regen = _load(folder, "regen_speed.json")
    if regen:
        out += _regen_speed_section(regen)
    if ceiling:
        out += [f"Oracle drafter ceiling (`oracle_ceiling.json`, `python -m xpress bench oracle-ceiling --preset {preset}`): "
                f"AR {ceiling['ar_tokens_per_s']:.1f} tokens/s, oracle {ceiling['oracle_tokens_per_s']:.1f} tokens/s, "
                f"speedup {_num(ceiling.get('speedup'))}x at tau {ceiling['tau']:.1f}; a verify of {ceiling['block_size']} tokens "
                f"costs {ceiling['verify_cost']['loop_ratio']:.2f}x a 1-token step{_verify_contexts(ceiling)} "
                f"({_where(ceiling['provenance'], dtype=False)}).", ""]
    run = _load(folder, "run.json")
    if run:
        times = ", ".join(f"{k} {v / 60:.1f} min" for k, v in run["notebook_seconds"].items())
        if run.get("total_seconds") is not None:
            out += [f"`make reproduce` wall time (`run.json`): {run['total_seconds'] / 60:.1f} min in all; {times}.", ""]
        else:  # notebooks last run at different revisions (python -m xpress run --only ...)
            revs = sorted({(r.get("git_revision") or "?")[:7] for r in run.get("notebooks", []) if r.get("seconds") is not None})
            out += [f"Wall time of each notebook's last run (`run.json`, runs at git {', '.join(revs)}): {times}.", ""]
    return "\n".join(out).strip() + "\n"


# What each notebook does, in the words of the durations table (run.json's keys are the notebook names).
STAGES = {"00_environment": "environment check", "01_data_regeneration": "the target regenerates the training data",
          "02_refiner_and_theorems": "refiner and theorems", "03_cotraining": "warm start + three methods trained",
          "04_speculative_decoding": "losslessness, Table 1, target cost", "05_jacobi_and_latency": "tau vs K, latency",
          "06_batched_decoding": "batched table", "07_figures": "figures"}


def durations_markdown(preset: str, folder: Path | None = None) -> str:
    """How long ``make reproduce`` took, stage by stage, from ``results/<preset>/run.json`` (the lines under
    "Two commands"), so a new user knows before starting."""
    folder = folder or paths.REPO_ROOT / "results" / preset
    run = _load(folder, "run.json")
    if not run:
        return f"`make reproduce` has not been timed on the {preset} preset yet (no `results/{preset}/run.json`).\n"
    secs = run["notebook_seconds"]
    rows = [f"| {name} | {STAGES.get(name, '')} | {v / 60:.1f} |" for name, v in secs.items()]
    where = _where(run["provenance"])
    if run.get("total_seconds") is not None:
        head = (f"`make reproduce` on the {preset} preset took **{run['total_seconds'] / 60:.0f} min** for the notebooks "
                f"({where}; `run.json`), plus the set-up of `.venv` on a fresh machine, which `run.json` does not time:")
    else:
        revs = sorted({(r.get("git_revision") or "?")[:7] for r in run.get("notebooks", []) if r.get("seconds") is not None})
        head = (f"No single `make reproduce` on the {preset} preset is recorded: each notebook's last run "
                f"(`run.json`, runs at git {', '.join(revs)}) took:")
    lines = [head, "", "| notebook | what | minutes |", "|---|---|---|", *rows]
    applied = run.get("on_bf16", run.get("on_amx"))  # on_amx: runs before the section took AVX512-BF16 too
    if applied:
        lines += ["", f"That run's CPU multiplies bf16 natively, so the preset's `on_bf16` overrides applied "
                      f"({', '.join(f'`{o}`' for o in applied)}); a CPU with neither AMX-BF16 nor AVX512-BF16 "
                      f"runs the preset's base sizes (`configs/{preset}.yaml`), as `run.json` records."]
    return "\n".join(lines) + "\n"


SECTIONS = {"results": results_markdown, "durations": durations_markdown}


def render(preset: str, text: str | None = None) -> str:
    """README text with the preset's generated sections replaced (the results markers must exist; the
    durations markers are optional)."""
    text = README.read_text() if text is None else text
    for kind, make in SECTIONS.items():
        begin, end = _markers(preset, kind)
        if begin not in text or end not in text:
            if kind == "results":
                raise ValueError(f"README.md has no {begin} ... {end} section")
            continue
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{make(preset)}{end}{tail}"
    return text


def main(preset: str, check: bool = False) -> int:
    from .utils import atomic_write_text

    text = README.read_text()
    new = render(preset, text)
    if check:
        if new != text:
            print(f"README.md's results section for {preset} disagrees with results/{preset}/; run "
                  f"`python -m xpress report --preset {preset}`")
            return 1
        return 0
    if new != text:
        atomic_write_text(README, new)
        print(f"README.md: results section for {preset} rewritten from results/{preset}/")
    return 0
