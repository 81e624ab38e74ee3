"""What a run found, as Markdown text computed from the result files the notebooks wrote under
``results/<preset>/``: each notebook ends with one line, e.g. ``Markdown(findings.cotraining(cfg.preset))``.

One function per notebook. Each reads the files (the in-notebook values no file holds are arguments) and
says the finding plainly, with the number of prompts it rests on; a file that is absent is said to be
absent, never guessed.
"""
from __future__ import annotations

from typing import Any, Sequence

from .plots import (METHODS, MADE_BY, break_even_tau, cotraining_steps_rows, data_scaling_rows, lever_rows,
                    load_result, validation_rows)
from .studies.table1 import PAPER_AVG

FIRST_TOKEN_ALPHA = 1e-4  # notebook 04 asserts every first-token p-value above it
PAPER_TAU_T0 = {m: PAPER_AVG[0.0][m]["tau"] for m in ("dflash", "xpress")}  # the paper: Qwen3-8B, T = 0, average


def _bullets(lines: Sequence[str]) -> str:
    return "\n".join(f"- {line}" for line in lines if line)


def _num(x: Any, fmt: str = ".2f") -> str:
    return "not measured" if x is None or x != x else format(x, fmt)


def _n(count: Any, word: str) -> str:
    """``3 prompts``, ``1 prompt``."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def versus(ratio: float, name: str, tie: float = 0.02) -> str:
    """How a tau ratio reads: within ``tie`` of 1 a tie at this number of prompts."""
    return f"ties with {name}" if abs(ratio - 1) < tie else (f"beats {name}" if ratio > 1 else f"trails {name}")


def environment(preset: str, target: Any, prompt: str, answer: str) -> str:
    """Notebook 00: the loaded ``target`` (an :class:`xpress.targets.Target`: name, layers, the runtime, dtype and
    layer the code chose for this machine) and its ``answer`` to the chat ``prompt``."""
    meta = target.meta
    return _bullets([
        f"Preset `{preset}`: {target.name}, {target.num_layers} layers, computing in "
        f"{str(target.compute_dtype).removeprefix('torch.')} on the {meta.get('runtime')} runtime with "
        f"{meta.get('kernels', 'PyTorch')} layers ({meta.get('kernels_reason') or 'no reason recorded'}).",
        f"The drafter reads target layers {list(target.layer_ids)} (evenly spread from 1 to L-3 = "
        f"{max(1, target.num_layers - 3)}).",
        f"Asked {prompt!r} under its chat template with thinking off, it answered {answer!r}."])


def regeneration(preset: str, check: dict, draft_vocab: int, coverage: float) -> str:
    """Notebook 01: ``regen_manifest.json``, with the notebook's check of one sequence (``check_sequence``)
    and the held-out ``coverage`` of a draft vocabulary of ``draft_vocab`` tokens."""
    m = load_result(preset, "regen_manifest")
    if m is None:
        return f"No results/{preset}/regen_manifest.json: run notebook 01."
    fin = m.get("finish_reasons") or {}
    stopped = fin.get("stop", 0) / max(1, sum(fin.values()))
    lines = [f"The target regenerated {m['sequences']['train']} training and {m['sequences']['val']} held-out answers "
             f"({m['response_tokens']['train']} and {m['response_tokens']['val']} tokens); {stopped:.0%} ended by "
             f"themselves, the rest were cut at {m['signature']['regen_max_new_tokens']} tokens. "
             f"{m['skipped_long_prompts']} prompts longer than {m['max_prompt_tokens']} tokens were skipped."]
    if check.get("has_states"):
        lines.append(f"The captured features matched a teacher-forced forward to "
                     f"{check['feature_error'] / check['feature_scale']:.1e} of their largest value (float16 storage), so "
                     f"training can use them instead of running the target; they cost {m['feature_bytes_per_token']} "
                     f"bytes per token ({m['disk_bytes'] / 1e6:.0f} MB on disk).")
    else:
        lines.append("No target states were cached (data.cache_features is off): training runs the target on every batch.")
    lines.append(f"The checked answer ({check['sequence']}, {check['answer_tokens']} tokens) was the target's greedy "
                 f"continuation at {check['greedy_agreement']:.1%} of its positions.")
    lines.append(f"A draft vocabulary of {draft_vocab} tokens (drafter.draft_vocab_size) covers {coverage:.1%} of the "
                 f"held-out answer tokens.")
    return _bullets(lines)


def theorems(preset: str) -> str:
    """Notebook 02: ``theorems.json`` (the property checks it ran on random refiners, every one asserted)
    and ``refiner_cost.json`` (counted cost per block)."""
    th = load_result(preset, "theorems")
    if th is None:
        return f"No results/{preset}/theorems.json: run notebook 02."
    P, n = th["P"], th["refiners"]
    lines = [f"**Proposition 1, tokens:** all {th['token_perturbations']} perturbations of later tokens ({n} random "
             f"refiners x {th['blocks']} blocks x {P - 1} cut points) left every earlier correction bit-identical, and "
             f"the token Jacobian of each of {n} refiners has exactly the strictly causal zero pattern ($\\delta_k$ "
             f"reads $x_0 \\dots x_{{k-1}}$): the property Theorem 1 needs holds.",
             f"**Proposition 1, hidden states:** the dependency on the drafter states is dense ({th['hidden_nonzero']} of "
             f"{P * P} entries nonzero, through the mean $g$); without $g$ it is lower-triangular "
             f"({th['local_nonzero']} nonzeros), not the diagonal ({P}) that \"only through $(h_k, g)$\" would give.",
             "**Theorem 1:** " + "; ".join(f"from {seed} seeds every Jacobi run reached the sequential decode in "
                                            f"{v['mean']:.2f} passes on average (max {v['max']:.0f}, P = {P})"
                                            for seed, v in th["jacobi_passes"].items())
             + f", with Eq. 12 held along the way; the correction changed {th['changed_fraction']:.0%} of the drafter's "
               f"argmax tokens, so the check is not vacuous.",
             "**Uniqueness:** " + "; ".join(f"V_d = {r['V_d']}, P = {r['P']}: {r['blocks enumerated']} blocks x "
                                            f"{r['refiners']} refiners, {r['fixed points']} fixed point"
                                            for r in th["uniqueness"])
             + " each, equal to the sequential decode.",
             f"**Sampling:** on all {th['sampled_blocks']} sampled blocks the Jacobi fixed point equals the sequential "
             f"sample under the same Gumbel noise, with the same $q$.",
             f"**Folding** is exact to float32 rounding: maximum relative error {th['fold_max_rel_error']:.1e}."]
    cost = load_result(preset, "refiner_cost")
    paper = {r["method"]: r for r in (cost or {}).get("table", []) if r["setting"].startswith("paper")}
    markov = next((r for m, r in paper.items() if m.startswith("Markov")), None)
    if markov and "xPress K=1" in paper and "xPress K=4" in paper:
        lines.append(f"**Cost at the paper's shapes:** one Jacobi pass costs {paper['xPress K=1']['GFLOP / block']:.2f} "
                     f"GFLOP per block against the Markov head's whole serial decode's {markov['GFLOP / block']:.2f} "
                     f"({markov['serial steps']} steps), but K = 4 passes stream "
                     f"{paper['xPress K=4']['weights read (M elem)']:.0f}M weight elements against its "
                     f"{markov['weights read (M elem)']:.0f}M: a pass saves dependency depth and weight traffic, not "
                     f"arithmetic, which is why a few passes can be faster than the serial decode at batch 1 "
                     f"(Table 3, notebook 05).")
    return _bullets(lines)


def cotraining(preset: str, methods: Sequence[str] = METHODS) -> str:
    """Notebook 03: ``train_<method>.json`` (tau by decoding and teacher-forced) and ``levers.json`` (data
    scaling, levers, co-training steps, from ``make studies``)."""
    from .studies.levers import scaling_fit

    rows = validation_rows(preset, methods)
    if not rows:
        return f"No train_<method>.json under results/{preset}/: run notebook 03."
    lines = [f"{r['method']}: tau by decoding {_num(r['validation tau (decoding)'])} on "
             f"{_n(r['validation prompts'], 'held-out validation prompt')}, teacher-forced tau "
             f"{_num(r['teacher-forced tau (held out)'])} on the held-out blocks "
             f"({_num(r['teacher-forced tau (last batch)'])} on the last training batch), after {r['steps']} steps."
             for r in rows]
    v = {r["method"]: r["validation tau (decoding)"] for r in rows}
    if {"xpress", "dflash", "markov"} <= set(v) and all(v[m] for m in ("xpress", "dflash", "markov")):
        n = rows[0]["validation prompts"]
        a, b = v["xpress"] / v["dflash"], v["xpress"] / v["markov"]
        lines.append(f"By decoding, tau(xPress)/tau(dFlash) = {a:.2f} and tau(xPress)/tau(Markov) = {b:.2f}: xPress "
                     f"{versus(a, 'the plain drafter')} and {versus(b, 'the Markov head')} on {n} validation prompts "
                     f"(the paper's Table 1, Qwen3-8B, T = 0: {PAPER_TAU_T0['xpress']} / {PAPER_TAU_T0['dflash']} = "
                     f"{PAPER_TAU_T0['xpress'] / PAPER_TAU_T0['dflash']:.2f} over dFlash). Table 1 on the benchmarks: "
                     f"notebook 04.")
    levers = load_result(preset, "levers")
    scaling = data_scaling_rows(levers)
    fit = scaling_fit(scaling) if scaling else None
    if fit:
        need = fit["tokens_for_goal"]
        lines.append(f"Data scaling ({fit['points']} sizes, {scaling[0]['steps']} steps each): held-out teacher-forced "
                     f"tau grows by {fit['per_decade']:.2f} per tenfold data; "
                     + (f"the line reaches tau {fit['goal']} at about {need:,.0f} training tokens, "
                        f"{need / scaling[-1]['train_response_tokens']:.0f}x the largest size here." if need
                        else "it does not grow with data."))
        by_decoding, even = scaling_fit(scaling, key="val_tau"), break_even_tau(scaling)
        if by_decoding and even:
            lines.append(f"By decoding, held-out tau grows by {by_decoding['per_decade']:.2f} per tenfold data, from "
                         f"{scaling[0]['val_tau']:.2f} to {scaling[-1]['val_tau']:.2f}; break-even at the stage costs "
                         f"those runs measured is tau {even:.2f}, so the largest size runs at "
                         f"{scaling[-1]['implied_speedup']:.2f}x AR (implied by tau).")
    lev = lever_rows(levers)
    if lev:
        best, base = max(lev, key=lambda r: r.get("implied_speedup") or 0), lev[0]
        lines.append(f"Levers at {base['steps']} steps ({len(lev) - 1} beside the preset): the best by implied speedup is "
                     f"{best['lever']} (tau by decoding {best['val_tau']:.2f}, {best['implied_speedup']:.2f}x AR implied) "
                     f"against the preset's {base['val_tau']:.2f} and {base['implied_speedup']:.2f}x.")
    steps = cotraining_steps_rows(levers)
    for m in sorted({r["method"] for r in steps}):
        rs = [r for r in steps if r["method"] == m]
        if len(rs) >= 2:
            a, b = rs[0], rs[-1]
            dec = f", by decoding {a['val_tau']:.2f} -> {b['val_tau']:.2f}" if a.get("val_tau") and b.get("val_tau") else ""
            lines.append(f"{m} co-trained {a['steps']} -> {b['steps']} steps from the warm start: teacher-forced tau "
                         f"{a['val_tf_tau']:.2f} -> {b['val_tf_tau']:.2f}{dec} (held out).")
    return _bullets(lines)


def _later_gain(result_conf: dict, bench: str, t: float) -> tuple[float | None, float | None, float | None]:
    """(dFlash's acceptance at position 1, and xPress's and dFlash's pooled acceptance at positions 2..B-1
    given the previous one accepted) of one configuration's ``bench`` at temperature ``t``."""
    pos = {p["method"]: p["positions"] for p in result_conf["positions"]
           if p["temperature"] == t and p.get("bench", "all") == bench}
    if not {"dflash", "xpress"} <= set(pos):
        return None, None, None

    def later(m):
        reached = sum(q["reached"] for q in pos[m][1:])
        return sum(q["accepted"] for q in pos[m][1:]) / reached if reached else None

    return pos["dflash"][0]["rate"], later("xpress"), later("dflash")


def gain_strength(preset: str) -> str:
    """``gain_vs_strength.json`` (``make studies``): whether tau(xPress) / tau(dFlash) grows with tau(dFlash),
    where along the block the refiner gains, and the benchmark whose drafter is strongest against the one
    with the largest gain."""
    r = load_result(preset, "gain_vs_strength")
    if not r or not r.get("points"):
        return f"No results/{preset}/gain_vs_strength.json: run `make studies` (xpress.studies.gain_strength)."
    return gain_strength_text(r)


def gain_strength_text(r: dict) -> str:
    """:func:`gain_strength`'s text from the file's contents ``r`` (also the report's, under its table)."""
    confs = r["configurations"]
    lines = [f"{_n(len(confs), 'trained configuration')}, each decoded on {_n(r['prompts_per_benchmark'], 'prompt')} of each of "
             f"{', '.join(r['benchmarks'])} with the full block ({r['draft_tokens']} drafts): "
             + "; ".join(f"{c['name']} ({c['made']['domain']} answers, "
                         f"{_num(c['made']['train_response_tokens'], ',')} tokens, {c['made']['cotrain_steps']} "
                         f"co-training steps)" for c in confs) + "."]
    avg = [p for p in r["points"] if p["bench"] == "avg"]
    for t in r["temperatures"]:
        pts = sorted((p for p in avg if p["temperature"] == t), key=lambda p: p["tau_dflash"])
        if not pts:
            continue
        lo, hi = pts[0], pts[-1]
        tr = next((x for x in r["trend"] if x["temperature"] == t and x["baseline"] == "dflash"), None)
        if tr is None or tr["spearman"] is None:
            how = "no trend can be computed"
        else:
            word = ("grows with" if tr["spearman"] > 0 else "falls with") if tr["p_value"] < 0.05 else \
                "shows no resolved trend with"
            how = (f"over the {tr['points']} per-benchmark points the ratio {word} tau(dFlash) (Spearman "
                   f"{tr['spearman']:+.2f}, p = {tr['p_value']:.2g}; {tr['slope_per_tau']:+.3f} per unit of tau)")
        lines.append(f"T = {t:g}: from the weakest configuration ({lo['configuration']}, tau(dFlash) {lo['tau_dflash']:.2f}) "
                     f"to the strongest ({hi['configuration']}, {hi['tau_dflash']:.2f}), tau(xPress) / tau(dFlash) moves "
                     f"{lo['ratio_dflash']:.3f} [{lo['lo_dflash']:.3f}, {lo['hi_dflash']:.3f}] -> {hi['ratio_dflash']:.3f} "
                     f"[{hi['lo_dflash']:.3f}, {hi['hi_dflash']:.3f}] and / tau(Markov) {lo.get('ratio_markov', float('nan')):.3f} "
                     f"-> {hi.get('ratio_markov', float('nan')):.3f}; {how}.")
    paper = PAPER_AVG[0.0]
    strongest = max((p for p in avg if p["temperature"] == 0.0), key=lambda p: p["tau_dflash"], default=None)
    if strongest:
        lines.append(f"The paper (Qwen3-8B, T = 0) has tau(dFlash) {paper['dflash']['tau']} and a ratio of "
                     f"{paper['xpress']['tau'] / paper['dflash']['tau']:.2f}; the strongest drafter here reaches tau "
                     f"{strongest['tau_dflash']:.2f} with {strongest['ratio_dflash']:.3f}, so "
                     + ("the trend points the paper's way but the drafters stay far weaker than its." if
                        strongest["ratio_dflash"] < paper["xpress"]["tau"] / paper["dflash"]["tau"] else
                        "this repository's gain matches or passes the paper's."))
    conf = next((c for c in reversed(confs) if strongest and c["name"] == strongest["configuration"]), confs[-1])
    first, later_x, later_d = _later_gain(conf, "all", 0.0)
    if first is not None and later_x is not None and later_d is not None:
        lines.append(f"Where it gains ({conf['name']}, T = 0): dFlash accepts its first draft in {first:.0%} of rounds; "
                     f"at positions 2..{r['draft_tokens']}, given the previous one accepted, xPress accepts "
                     f"{later_x:.0%} against dFlash's {later_d:.0%}, so the refiner's gain is in the later positions, "
                     f"which a round reaches only after the first ones are accepted.")
    benches = [p for p in r["points"] if p["configuration"] == conf["name"] and p["temperature"] == 0.0
               and p["bench"] != "avg"]
    if len(benches) >= 2:
        strong = max(benches, key=lambda p: p["tau_dflash"])
        gain = max(benches, key=lambda p: p["ratio_dflash"])
        if strong["bench"] != gain["bench"]:
            parts = []
            for p in (strong, gain):
                f1, lx, ld = _later_gain(conf, p["bench"], 0.0)
                parts.append(f"{p['bench']}: tau(dFlash) {p['tau_dflash']:.2f}, ratio {p['ratio_dflash']:.3f}, first "
                             f"draft accepted {_num(f1, '.0%')}, later positions {_num(ld, '.0%')} -> {_num(lx, '.0%')}")
            lines.append("The benchmark with the strongest drafter is not the one with the largest gain (" +
                         "; ".join(parts) + "): tau rises with the first positions' acceptance, the ratio with how "
                         "much the refiner adds at the later ones.")
    return _bullets(lines)


def _verdict(lo: float, hi: float) -> str:
    return "beats" if lo > 1 else ("trails" if hi < 1 else "cannot be told apart from")


def speculative_decoding(preset: str, first_token_p: dict[str, float] | None = None,
                         temperature: float | None = None) -> str:
    """Notebook 04: ``decoding_t0.json`` (losslessness), ``table1.json``, ``resolution.json`` and
    ``target_cost.json``; ``first_token_p``: the notebook's chi-square p-value per drafter of the first sampled
    token at ``temperature`` (no file holds it)."""
    lines = []
    t0 = load_result(preset, "decoding_t0")
    t1 = load_result(preset, "table1")
    if t0:
        tab = {r["method"]: r for r in t0["table"]}
        lossless = all(r.get("lossless") for r in tab.values())
        lines.append(f"{'Every' if lossless else 'NOT every'} drafter ({', '.join(tab)}) produced exactly the target's "
                     f"greedy tokens at T = 0 on {_n(len(t0['prompts']), 'prompt')} x {t0['max_new_tokens']} new tokens"
                     + (f"; the oracle committed tau = {tab['oracle']['tau']:.1f} tokens per verification"
                        + (f" (B = {t1['block_size']})" if t1 else "") + f", random drafts {tab['random']['tau']:.2f}."
                        if {"oracle", "random"} <= set(tab) else "."))
    if first_token_p:
        passed = [m for m, p in first_token_p.items() if p > FIRST_TOKEN_ALPHA]
        lines.append(f"At T = {temperature:g} the first sampled token "
                     f"{'passed' if len(passed) == len(first_token_p) else 'did not pass'} the chi-square test "
                     f"(p > {FIRST_TOKEN_ALPHA:g}) "
                     f"against the target's own distribution for {', '.join(first_token_p)} (p-values "
                     f"{', '.join(f'{p:.2f}' for p in first_token_p.values())}).")
    if not t1:
        lines.append(f"No results/{preset}/table1.json: run notebook 04.")
    else:
        avg = {(r["temperature"], r["method"]): r for r in t1["summary"] if r["bench"] == "avg"}
        for t in t1.get("temperatures") or sorted({r["temperature"] for r in t1["summary"]}):
            parts = [f"{m} tau {avg[(t, m)]['tau']:.2f} ({avg[(t, m)]['speedup']:.2f}x AR"
                     + (", flagged)" if avg[(t, m)]["flag"] else ")") for m in t1["methods"] if (t, m) in avg]
            line = (f"Table 1 at T = {t:g}, {_n(t1['prompts_per_benchmark'], 'prompt')} x {t1['max_new_tokens']} new tokens on "
                    f"each of {len(t1['benchmarks'])} benchmarks, averaged: " + "; ".join(parts) + ".")
            for g in (r for r in t1["gains"] if r["temperature"] == t and r["bench"] == "avg"):
                b = t1["bootstrap_tau_ratio"].get(g["baseline"], {}).get(str(float(t)), {}).get("avg")
                if b:
                    line += (f" tau(xPress)/tau({g['baseline']}) = {g['tau_ratio']:.2f} (95% interval over prompts "
                             f"{b['lo']:.2f}-{b['hi']:.2f}: xPress {_verdict(b['lo'], b['hi'])} {g['baseline']} on this "
                             f"many prompts).")
            lines.append(line)
        flags = t1.get("flags") or []
        named = ", ".join(f"{f['method']} {f['bench']} at T = {f['temperature']:g}" for f in flags)
        lines.append(f"Speedups flagged as contradicting their own tau: {len(flags)}"
                     + (f" ({named}): timing noise or a busy machine, not a result; rerun on an idle machine." if flags else "."))
        lines.append("Load: " + (" ".join(t1["warnings"]) if t1.get("warnings") else
                                 "the machine was quiet at the start and the end of Table 1."))
    res = load_result(preset, "resolution")
    if res:
        prov = res.get("provenance", {})
        groups: dict[tuple, list[dict]] = {}
        for r in res["table"]:
            groups.setdefault((r["temperature"], r["baseline"]), []).append(r)
        for (t, base), d in groups.items():
            a = next(r for r in d if r["bench"] == "avg")
            per = [r for r in d if r["bench"] != "avg"]
            unresolved = [r["bench"] for r in per if not r["resolved"]]
            lines.append(f"On {_n(res['prompts_per_benchmark'], 'prompt')} per benchmark (resolution.json, git "
                         f"{str(prov.get('git_revision'))[:7]}, {str(prov.get('date'))[:10]}), T = {t:g}: "
                         f"tau(xPress)/tau({base}) = {a['tau_ratio']:.3f} on average ({a['lo']:.3f}-{a['hi']:.3f}, "
                         f"{a['verdict']}); a 5% difference is resolved on average: {a['resolved']}, and on "
                         f"{len(per) - len(unresolved)} of {len(per)} benchmarks"
                         + (f" (not on {', '.join(unresolved)})." if unresolved else "."))
    lines.append(f"The paper (Qwen3-8B, T = 0): tau {PAPER_TAU_T0['dflash']} for dFlash and {PAPER_TAU_T0['xpress']} for "
                 f"xPress on average, a ratio of {PAPER_TAU_T0['xpress'] / PAPER_TAU_T0['dflash']:.2f}.")
    cost = load_result(preset, "target_cost")
    if cost:
        dtype = (((t1 or {}).get("provenance") or {}).get("target_runtime") or {}).get("dtype")
        ours = [r for r in cost["break_even"] if r["runtime"] == "lean" and (dtype is None or r["dtype"] == dtype)]
        old = {r["context"]: r for r in cost["break_even"] if r["runtime"] == "transformers"}
        for a in ours:
            o = old.get(a["context"])
            lines.append(f"Context {a['context']}: a {a['block']}-token verify costs {a['verify_over_step']:.2f} one-token "
                         f"steps in the lean runtime ({a['dtype']}: step {a['step_ms']:.1f} ms, verify {a['verify_ms']:.1f} ms)"
                         + (f", {o['verify_over_step']:.2f} in the transformers forward ({o['dtype']}: step "
                            f"{o['step_ms']:.1f} ms)" if o else "") + ": the break-even tau with free drafting.")
    return _bullets(lines)


def jacobi_and_latency(preset: str) -> str:
    """Notebook 05: ``tau_vs_k.json`` (Figure 3), ``latency.json`` (Table 3 / Figure 4) and, when committed,
    ``results/h200/latency.json``."""
    from .studies.table3 import PAPER_TABLE3_US, beside_paper_table3

    lines = []
    tk = load_result(preset, "tau_vs_k")
    if tk:
        P, K = tk["block_size"] - 1, tk["max_iters"]
        avg = {r["K"]: r["tau"] for r in tk["summary"] if r["bench"] == "avg" and str(r["variant"]).startswith("K=")}
        line = {(r["method"] + (f" ({r['variant']})" if r["variant"] else "")): r["tau"]
                for r in tk["summary"] if r["bench"] == "avg" and not str(r["variant"]).startswith("K=")}
        seq = line.get("xpress (sequential)")
        ks = sorted(avg)
        last = P if P in avg else ks[-1]
        reach = min((k for k in ks if seq and avg[k] >= 0.99 * seq), default=None)
        lines.append(f"Figure 3 ({preset}, {tk['weights'].get('xpress')} xPress weights, "
                     f"{_n(tk['prompts_per_benchmark'], 'prompt')} x {tk['max_new_tokens']} new tokens on each of "
                     f"{len(tk['benchmarks'])} benchmarks): average tau rises from {avg[ks[0]]:.2f} at K={ks[0]} to "
                     f"{avg[last]:.2f} at K={last}, "
                     f"against the sequential decode's {_num(seq)} (Theorem 1: equal at K = P = {P}); 99% of it is "
                     f"reached at K={reach}; the Markov head reaches {_num(line.get('markov'))}, dFlash "
                     f"{_num(line.get('dflash'))}.")
        used = tk.get("passes", {}).get(f"K={K}") or []
        full = tk.get("passes", {}).get(f"K={P}") or []
        if used:
            lines.append(f"Adaptive stopping at K={K} used {sum(used) / len(used):.2f} passes per round on average "
                         f"(max {max(used)}, {len(used)} rounds)"
                         + (f"; with K={P}, {sum(full) / len(full):.2f}." if full and P != K else "."))
    else:
        lines.append(f"No results/{preset}/tau_vs_k.json: run notebook 05.")
    lat = load_result(preset, "latency")
    if lat:
        for name, s in lat["shape_sets"].items():
            t, b = s["timings"], s["shapes"]["block_size"]
            p = s["paired"]["markov_over_xpress_k4"]
            lines.append(f"Latency, {s['shapes']['name']} shapes: Markov head {t['markov']['median_ms']:.2f} ms per block "
                         f"({b - 1} serial steps); xPress K=1 {t['xpress K=1']['median_ms']:.2f} ms, K=4 "
                         f"{t['xpress K=4']['median_ms']:.2f} ms, so Markov / xPress K=4 = {p['median']:.2f}x (range "
                         f"{p['min']:.2f}-{p['max']:.2f} over {len(p['rounds'])} paired rounds; above 1: four passes are "
                         f"faster than the serial decode); readout of both heads: {s.get('readout', 'float32')}.")
            if s.get("markov_float32_over_xpress_k4"):
                q = s["paired"]["markov_float32_over_xpress_k4"]
                lines.append(f"Against the Markov head with its float32 readout "
                             f"({t['markov (float32 readout)']['median_ms']:.2f} ms), xPress K=4 is {q['median']:.2f}x "
                             f"faster (range {q['min']:.2f}-{q['max']:.2f}); tokens equal: "
                             f"{s['checks'].get('certified readout equals float32 (Markov, K=4 tokens)')}.")
            ro, row = s["paired"].get("readout_only_k4"), t.get(f"xpress readout ({b - 1} rows)")
            if ro and row:
                lines.append(f"The readouts alone ({s['shapes']['name']}): the Markov head's "
                             f"{t['markov readout (1 row)']['median_ms']:.2f} ms for one row, xPress's "
                             f"{row['median_ms']:.2f} ms for {b - 1} rows, so {b - 1} serial steps against 4 passes would "
                             f"be {ro['median']:.2f}x if nothing but the readouts cost time; the full decodes reach "
                             f"{s['markov_over_xpress_k4']:.2f}x.")
            verify = t.get(f"target verify ({b} tokens)")
            comp = s.get("composition", {}).get(f"xpress K={min(K, max(lat['config']['ks']))}") if tk else None
            if verify and comp:
                lines.append(f"With the target ({name} shapes): a {b}-token verify takes {verify['median_ms']:.1f} ms vs a "
                             f"1-token step {t['target step (1 token)']['median_ms']:.1f} ms; the draft side is "
                             f"{100 * comp['draft_share']:.0f}% of a round (refinement {100 * comp['refine_share']:.0f}%).")
        prov = lat["provenance"]
        before, after = (prov[k][0] if isinstance(prov[k], list) else prov[k]
                         for k in ("load_average_before", "load_average_after"))
        lines.append(f"Latencies measured with {prov['torch_threads']} torch threads at load average {before:.1f} -> "
                     f"{after:.1f}.")
    us = PAPER_TABLE3_US
    h200 = load_result("h200", "latency")
    ours = None
    if h200:
        ours = next((1 / r["ratio_to_markov"] for r in beside_paper_table3(h200)
                     if r["component"] == "xpress K=4" and r["shapes"] == "paper"), None)
    lines.append(f"The paper's Table 3 (one H200): Markov head {us['markov']} us, xPress K=4 {us['xpress K=4']} us, so "
                 f"Markov / xPress K=4 = {us['markov'] / us['xpress K=4']:.2f}x. "
                 + ("No H200 run yet (results/h200/latency.json is absent)." if h200 is None
                    else f"Our H200 run: {_num(ours)}x."))
    return _bullets(lines)


def batched(preset: str) -> str:
    """Notebook 06: ``batched.json``: tau and throughput per batch size, and the fraction of batched rows
    whose output equals batch-1 AR's."""
    r = load_result(preset, "batched")
    if not r:
        return f"No results/{preset}/batched.json: run notebook 06."
    rows = {(x["batch_size"], x["method"]): x for x in r["table"]}
    sizes = sorted({x["batch_size"] for x in r["table"]})
    lines = [f"{_n(r['n_prompts'], 'prompt')} x {r['max_new_tokens']} new tokens, greedy, at batch sizes "
             f"{', '.join(map(str, sizes))}, the same prompts at every size."]
    for m in (m for m in r["methods"] if m != "ar"):
        taus = [rows[(b, m)]["tau"] for b in sizes]
        spread = (max(taus) - min(taus)) / (sum(taus) / len(taus))
        speedups = [rows[(b, m)]["tokens_per_s"] / rows[(b, "ar")]["tokens_per_s"] for b in sizes]
        lines.append(f"{m}: tau {', '.join(f'{x:.2f}' for x in taus)} (spread {spread:.1%}); speedup over AR "
                     f"{', '.join(f'{x:.2f}x' for x in speedups)}.")
    ar = [rows[(b, "ar")]["tokens_per_s"] for b in sizes]
    lines.append(f"AR throughput grows {ar[-1] / ar[0]:.1f}x from batch {sizes[0]} to {sizes[-1]} "
                 f"({ar[0]:.0f} -> {ar[-1]:.0f} tokens/s).")
    if {"xpress", "dflash"} <= set(r["methods"]):
        lines.append("xPress / dFlash throughput: " + ", ".join(
            f"{rows[(b, 'xpress')]['tokens_per_s'] / rows[(b, 'dflash')]['tokens_per_s']:.2f} at batch {b}" for b in sizes)
            + " (the paper, vLLM on an H200: 1.2-1.4).")
    ref = r.get("reference_batch_size", sizes[0])
    for b in (b for b in sizes if b != ref):
        same = {m: rows[(b, m)]["same_as_ar_b1"] for m in r["methods"] if (b, m) in rows}
        lines.append(f"**Exactness at batch {b}: {', '.join(f'{m} {v:.0%}' for m, v in same.items())} of the "
                     f"{r['n_prompts']} rows equal batch-{ref} AR's greedy output**"
                     + ("; the rest differ." if min(same.values()) < 1 else "."))
    if any(rows[(b, m)]["same_as_ar_b1"] < 1 for b in sizes if b != ref for m in r["methods"] if (b, m) in rows):
        margins = [d["top2_margin"] for run in r.get("runs", []) for d in run.get("divergences", [])
                   if d.get("top2_margin") is not None]
        lines.append(f"So batched decoding here is NOT token-for-token lossless against batch-{ref} AR, AR itself "
                     f"included: batched rows run the target's products in another reduction order, and a near-tie "
                     f"argmax can flip" + (f" (the target's top-2 logit margin where rows first differ: at most "
                                           f"{max(margins):.3g})." if margins else ".")
                     + " Batched rows are exact only on the lean runtime with the fused CPU kernels (one cache "
                       "row per sequence).")
    lines.append("Load: " + (" ".join(r["warnings"]) if r.get("warnings") else
                             "the machine was quiet at the start and the end."))
    return _bullets(lines)


def figures(preset: str, shown: dict[str, list[str]]) -> str:
    """Notebook 07: which figures :func:`xpress.plots.show_all` showed and which it could not (and what makes
    their data)."""
    lines = [f"Showed {len(shown['shown'])} of {len(shown['shown']) + len(shown['missing'])} figures of "
             f"results/{preset}/: {', '.join(shown['shown']) or 'none'}."]
    if shown["missing"]:
        lines.append("No data yet for: " + ", ".join(f"{m} (run {MADE_BY.get(m, 'its notebook')})"
                                                     for m in shown["missing"]) + ".")
    return _bullets(lines)
