"""The README's measured numbers, generated from the result files (never typed by hand).

    python -m xpress report --preset cpu          # rewrites the marked section of README.md
    python -m xpress report --preset cpu --check  # exit 1 if README.md and results/ disagree

The section between ``<!-- results:<preset>:begin -->`` and ``<!-- results:<preset>:end -->`` is
:func:`results_markdown` of ``results/<preset>/``; a test fails when they differ.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import paths

README = paths.REPO_ROOT / "README.md"


def _markers(preset: str) -> tuple[str, str]:
    return f"<!-- results:{preset}:begin -->", f"<!-- results:{preset}:end -->"


def _load(folder: Path, name: str) -> dict | None:
    f = folder / name
    return json.loads(f.read_text()) if f.is_file() else None


def _where(prov: dict) -> str:
    m = prov.get("machine", {})
    return (f"{m.get('cpu_model') or m.get('gpu') or m.get('processor', '?')}, {m.get('torch_threads', '?')} torch threads; "
            f"git {prov.get('git_revision', '?')[:7]}{' (dirty)' if prov.get('git_dirty') else ''}, {prov.get('date', '?')[:10]}")


def results_markdown(preset: str, folder: Path | None = None) -> str:
    """The README section for ``preset`` from the repository's ``results/<preset>/`` (what exists of it;
    the README describes the committed results, whatever ``$XPRESS_RESULTS`` says)."""
    folder = folder or paths.REPO_ROOT / "results" / preset
    out: list[str] = []
    methods = _load(folder, "methods_t0.json")
    if methods:
        rows = {(r["method"], r["bench"]): r for r in methods["summary"]}
        benches = list(methods["benchmarks"]) + ["avg"]
        out += [f"Tau by decoding held-out benchmark prompts and speedup over AR, T = 0, batch 1 "
                f"(`methods_t0.json`, notebook 03; {methods['prompts_per_benchmark']} prompts x "
                f"{methods['max_new_tokens']} new tokens per benchmark, every output equal to greedy decoding: "
                f"{all(r['lossless'] for r in methods['summary'])}; {_where(methods['provenance'])}):", "",
                "| method | " + " | ".join(f"{b} tau" for b in benches) + " | speedup (avg) |",
                "|---|" + "---|" * (len(benches) + 1)]
        for m in methods["methods"]:
            taus = " | ".join(f"{rows[(m, b)]['tau']:.2f}" for b in benches)
            out.append(f"| {m} | {taus} | {rows[(m, 'avg')]['speedup']:.2f}x |")
        ar = rows.get(("ar", "avg"))
        if ar:
            out.append(f"| ar | " + " | ".join("1.00" for _ in benches) + f" | 1.00x ({ar['tokens_per_s']:.1f} tokens/s) |")
        avg = {m: rows[(m, "avg")]["tau"] for m in methods["methods"]}
        if {"xpress", "dflash", "markov"} <= set(avg):
            out += ["", f"tau(xPress) / tau(dFlash) = {avg['xpress'] / avg['dflash']:.2f}; "
                        f"tau(xPress) / tau(Markov) = {avg['xpress'] / avg['markov']:.2f} "
                        f"(the paper, Qwen3-8B, T = 0: 8.02 / 6.25 = 1.28 and 8.02 / 7.64 = 1.05)."]
        out.append("")
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
    ceiling = _load(folder, "oracle_ceiling.json")
    if ceiling:
        out += [f"Oracle drafter ceiling (`oracle_ceiling.json`, `python -m xpress bench oracle-ceiling --preset {preset}`): "
                f"AR {ceiling['ar_tokens_per_s']:.1f} tokens/s, oracle {ceiling['oracle_tokens_per_s']:.1f} tokens/s, "
                f"speedup {ceiling['speedup']:.2f}x at tau {ceiling['tau']:.1f}; a {ceiling['block_size']}-token verify "
                f"costs {ceiling['verify_cost']['loop_ratio']:.2f}x a 1-token step ({_where(ceiling['provenance'])}).", ""]
    run = _load(folder, "run.json")
    if run:
        times = ", ".join(f"{k} {v / 60:.1f} min" for k, v in run["notebook_seconds"].items())
        out += [f"`make reproduce` wall time (`run.json`): {run['total_seconds'] / 60:.1f} min in all; {times}.", ""]
    return "\n".join(out).strip() + "\n"


def render(preset: str, text: str | None = None) -> str:
    """README text with the preset's section replaced (the markers must exist)."""
    text = README.read_text() if text is None else text
    begin, end = _markers(preset)
    if begin not in text or end not in text:
        raise ValueError(f"README.md has no {begin} ... {end} section")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{results_markdown(preset)}{end}{tail}"


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
