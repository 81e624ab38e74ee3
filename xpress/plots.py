"""Figures, drawn from result files: every notebook saves through :func:`save_fig`, PNG and PDF under
``results/<preset>/figures/`` (so a run of one preset never touches another's figures).

Notebook 07 draws every figure from ``results/<preset>/`` alone, without running a model, and shows the
few whose data no results file holds (:data:`SAVED_ONLY`) as their notebooks saved them::

    drawn, missing = draw_all("cpu")     # [Drawn(name, fig, caption)], names whose data is absent
    show_all("cpu")                      # each figure displayed once, with its caption
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from . import paths
from .utils import atomic_write


def figures_dir(preset: str) -> Path:
    return paths.RESULTS / preset / "figures"


def save_fig(fig, name: str, preset: str) -> list[Path]:
    """Write a matplotlib figure as ``results/<preset>/figures/<name>.png`` and ``.pdf`` (atomically)."""
    return [atomic_write(figures_dir(preset) / f"{name}.{ext}",
                    lambda tmp, ext=ext: fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight"))
            for ext in ("png", "pdf")]


def training_log(preset: str, stage: str) -> list[dict]:
    """The logged rows of ``results/<preset>/train_<stage>.json`` ([] if absent)."""
    f = paths.RESULTS / preset / f"train_{stage}.json"
    return json.loads(f.read_text())["log"] if f.is_file() else []


def plot_training(preset: str, stages: Sequence[str], offsets: dict[str, int] | None = None):
    """Against the step, one line per stage (``offsets`` shifts a stage's steps, e.g. by the warm-start
    length): the L1 distance of the final draft distribution (refined, or base for the plain drafter) to
    the target's, ``2 (1 - acceptance)`` by Eq. 13 and so comparable across methods; the teacher-forced
    tau; and tau by decoding validation prompts. Returns the figure."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    rows = []
    for stage in stages:
        for r in training_log(preset, stage):
            l1 = r.get("refined_l1", r.get("base_l1"))
            rows.append({"stage": stage, "step": r["step"] + (offsets or {}).get(stage, 0), "L1 to target": l1,
                         "teacher-forced tau": r["tf_tau"], "val tau (decoding)": (r.get("val") or {}).get("tau")})
    df = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, col in zip(axes, ["L1 to target", "teacher-forced tau", "val tau (decoding)"]):
        d = df.dropna(subset=[col]) if len(df) else df
        if len(d):
            sns.lineplot(data=d, x="step", y=col, hue="stage", marker="o" if col.startswith("val") else None,
                         ax=ax, legend=ax is axes[-1])
        ax.set_title(col)
    if axes[-1].get_legend():
        sns.move_legend(axes[-1], "upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


# ======================================================================= figures from result files only
@dataclass
class Drawn:
    """A figure drawn from ``results/<preset>/``: its file ``name``, the matplotlib ``fig`` and a
    ``caption`` saying what it shows and which command made its data."""

    name: str
    fig: Any
    caption: str


def load_result(preset: str, name: str) -> Any:
    """``results/<preset>/<name>.json`` parsed, or None when absent."""
    f = paths.RESULTS / preset / f"{name}.json"
    return json.loads(f.read_text()) if f.is_file() else None


RECORD_KEYS = ("summary", "table", "rows", "records", "results", "points", "data")


def records(data: Any, keys: Sequence[str] = RECORD_KEYS) -> list[dict]:
    """The table inside a result file, read defensively (files written by other notebooks): ``data``
    itself if it is a list of dicts, else the first list of dicts under one of ``keys``, else under any
    key; [] when there is none."""
    def table(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(r, dict) for r in v)

    if table(data):
        return data
    if not isinstance(data, dict):
        return []
    for k in list(keys) + list(data):
        if table(data.get(k)):
            return data[k]
    return []


def _first(row_keys: Sequence[str], *candidates: str) -> str | None:
    return next((c for c in candidates if c in row_keys), None)


def draw_training(preset: str) -> Drawn | None:
    """Training curves (:func:`plot_training`) of every stage with a ``train_<stage>.json``; the methods'
    steps continue after the warm start."""
    stages = [s for s in ("warmstart", "dflash", "markov", "xpress") if training_log(preset, s)]
    if not stages:
        return None
    warm = load_result(preset, "train_warmstart")
    offsets = {s: (warm or {}).get("step", 0) for s in stages if s != "warmstart"}
    return Drawn("training_curves", plot_training(preset, stages, offsets),
                 f"Training curves of {', '.join(stages)} against the step (methods continue after the warm start): "
                 f"L1 distance of the draft distribution to the target's, teacher-forced tau and tau by decoding "
                 f"validation prompts. Data: train_<stage>.json, from notebook 03 or "
                 f"`python -m xpress train --preset {preset} --method <method>`.")


METHODS = ("dflash", "markov", "xpress")


def acceptance_rows(preset: str, methods: Sequence[str] = METHODS) -> list[dict]:
    """Teacher-forced acceptance per block position at the last logged step of each method's training
    (``train_<method>.json``): ``{"method", "position k", "accepted up to k"}``."""
    return [{"method": m, "position k": k + 1, "accepted up to k": a}
            for m in methods for log in [training_log(preset, m)] if log
            for k, a in enumerate(log[-1].get("tf_accept", []))]


def draw_training_acceptance(preset: str, methods: Sequence[str] = METHODS) -> Drawn | None:
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    rows = acceptance_rows(preset, methods)
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    sns.lineplot(data=pd.DataFrame(rows), x="position k", y="accepted up to k", hue="method", marker="o", ax=ax)
    ax.set_title("teacher-forced acceptance per block position, end of training")
    fig.tight_layout()
    return Drawn("training_acceptance", fig, "Teacher-forced acceptance per block position at the end of training: the "
                 "fraction of training blocks whose tokens up to position k all equal the target's (its sum plus one is "
                 "the teacher-forced tau). Data: the last logged step of train_<method>.json, from notebook 03.")


def validation_rows(preset: str, methods: Sequence[str] = METHODS) -> list[dict]:
    """Per trained method (``train_<method>.json``): tau by decoding the held-out validation prompts at the
    end of training (``final_val``), on how many prompts, and the teacher-forced tau of the last logged step."""
    rows = []
    for m in methods:
        res = load_result(preset, f"train_{m}")
        if not res:
            continue
        final, log = res.get("final_val") or {}, res.get("log") or [{}]
        rows.append({"method": m, "steps": res.get("step"), "validation tau (decoding)": final.get("tau"),
                     "validation prompts": final.get("prompts"), "teacher-forced tau (last batch)": log[-1].get("tf_tau"),
                     "teacher-forced tau (held out)": final.get("val_tf_tau")})
    return rows


def draw_validation_tau(preset: str, methods: Sequence[str] = METHODS) -> Drawn | None:
    import matplotlib.pyplot as plt
    import pandas as pd

    rows = validation_rows(preset, methods)
    if not rows:
        return None
    cols = ["validation tau (decoding)", "teacher-forced tau (held out)", "teacher-forced tau (last batch)"]
    df = pd.DataFrame(rows).set_index("method")[cols].astype(float)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    df.plot.bar(ax=ax, rot=0)
    ax.set_title("tau at the end of training: by decoding vs teacher-forced")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    n = sorted({r["validation prompts"] for r in rows if r["validation prompts"]})
    return Drawn("validation_tau", fig, f"tau at the end of training per method: by decoding {'/'.join(map(str, n)) or '?'} "
                 "held-out validation prompts, teacher-forced on the held-out blocks and on the last training batch. "
                 "Data: train_<method>.json (final_val, log), from notebook 03.")


def plot_table1(result: dict):
    """Table 1 (``table1.json``) as seaborn bars: tau (top) and speedup over AR (bottom) per benchmark and on
    average, one panel per temperature, one bar per method (AR left out: 1 by definition, the dashed line).
    Whiskers: sd over seeds for tau at T > 0; the min-max spread over timed passes for the speedup."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(result["summary"])
    df = df[df["method"] != "ar"]
    temps = sorted(df["temperature"].unique())
    methods = [m for m in result.get("methods", []) if m in set(df["method"])] or sorted(df["method"].unique())
    benches = [b for b in result.get("benchmarks", []) if b in set(df["bench"])] + ["avg"]
    palette = dict(zip(methods, sns.color_palette("deep", len(methods))))
    fig, axes = plt.subplots(2, len(temps), figsize=(6.5 * len(temps), 6.4), squeeze=False)
    width = 0.8 / len(methods)  # seaborn's dodged bars: 0.8 of a category, split evenly between the methods
    for j, t in enumerate(temps):
        d = df[df["temperature"] == t]
        for i, col in enumerate(("tau", "speedup")):
            ax = axes[i, j]
            sns.barplot(data=d, x="bench", y=col, hue="method", order=benches, hue_order=methods, palette=palette,
                        errorbar=None, ax=ax, legend=i == 0 and j == len(temps) - 1)
            for k, m in enumerate(methods):
                r = d[d["method"] == m].set_index("bench").reindex(benches)
                lo, hi = ((r["tau"] - r["tau_sd"].fillna(0), r["tau"] + r["tau_sd"].fillna(0)) if col == "tau"
                          else (r["speedup_lo"].fillna(r["speedup"]), r["speedup_hi"].fillna(r["speedup"])))
                x = [b - 0.4 + width * (k + 0.5) for b in range(len(benches))]
                ax.errorbar(x, r[col], yerr=[(r[col] - lo).clip(lower=0), (hi - r[col]).clip(lower=0)], fmt="none",
                            ecolor="k", elinewidth=0.8, capsize=2)
            ax.axhline(1.0, ls="--", c="k", lw=1)
            ax.set_xlabel("")
            ax.set_ylabel("tau (tokens per verification)" if col == "tau" else "speedup over AR")
            ax.set_title(f"{'tau' if col == 'tau' else 'speedup over AR'}, T = {t:g}")
    if axes[0, -1].get_legend():
        sns.move_legend(axes[0, -1], "upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def draw_table1(preset: str) -> Drawn | None:
    result = load_result(preset, "table1")
    if not result or not result.get("summary"):
        return None
    seeds = result.get("sampling_seeds") or []
    return Drawn("table1", plot_table1(result),
                 f"Table 1 on {result.get('target', preset)}: tau (committed tokens per verification) and speedup over "
                 f"AR per benchmark and on average, batch 1; {result.get('prompts_per_benchmark')} prompts x "
                 f"{result.get('max_new_tokens')} new tokens per benchmark, {result.get('repeats')} timed passes at "
                 f"T = 0 (bars: median, whiskers: min-max) and {len(seeds)} seeds at T > 0 (mean, sd over seeds). "
                 f"Data: table1.json, from {result.get('command', 'notebook 04')}.")


BASELINE_STYLE = {"markov": ("--", "C3", "Markov head (sequential)"), "dflash": ("-.", "C7", "dFlash (no head)"),
                  "xpress sequential": (":", "C2", "xPress fixed point (sequential)")}


def plot_tau_vs_k(rows: Sequence[dict], passes: dict[str, Sequence[int]] | None = None):
    """Figure 3: tau against the Jacobi budget K, one panel per benchmark (``bench``; the average
    ``avg`` last), rows without a K (dFlash, the Markov head, the sequential fixed point) as horizontal
    lines; with ``passes`` ({budget: passes used per round}, ``tau_vs_k.json``) a last panel with their
    histogram. None when the rows hold no (K, tau) pairs."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(rows)
    k = _first(df.columns, "K", "k", "max_iters", "iters", "iterations")
    tau = _first(df.columns, "tau", "mean_tau", "acceptance_length")
    if k is None or tau is None or df[k].notna().sum() == 0:
        return None
    if "bench" not in df.columns:
        df = df.assign(bench="all")
    benches = [b for b in dict.fromkeys(df["bench"]) if b != "avg"] + (["avg"] if (df["bench"] == "avg").any() else [])
    hist = pd.DataFrame([{"budget": b, "passes": int(x)} for b, xs in (passes or {}).items() for x in xs])
    n = len(benches) + (len(hist) > 0)
    fig, axes = plt.subplots(1, n, figsize=(3.3 * n, 3.3), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        d = df[df["bench"] == bench]
        curve = d[d[k].notna()].sort_values(k)
        ax.plot(curve[k], curve[tau], marker="o", label="xPress, K passes")
        for _, r in d[d[k].isna()].iterrows():
            name = " ".join(str(r[c]) for c in ("method", "variant") if c in r and isinstance(r[c], str) and r[c])
            style, color, label = BASELINE_STYLE.get(name, ("--", "C1", name or "baseline"))
            ax.axhline(r[tau], ls=style, c=color, lw=1.2, label=label)
        ax.set_title(bench)
        ax.set_xlabel("K (Jacobi passes)")
        ax.set_ylabel("tau")
    axes[0][0].legend(fontsize=7)
    if len(hist):
        ax = axes[0][-1]
        sns.histplot(data=hist, x="passes", hue="budget", discrete=True, multiple="dodge", shrink=0.8, ax=ax)
        ax.set_title("passes adaptive K used, per round")
    fig.tight_layout()
    return fig


def draw_tau_vs_k(preset: str) -> Drawn | None:
    data = load_result(preset, "tau_vs_k")
    fig = plot_tau_vs_k(records(data), data.get("passes") if isinstance(data, dict) else None) if data else None
    if fig is None:
        return None
    return Drawn("tau_vs_k", fig, "Figure 3 analogue: tau (T = 0) against the Jacobi budget K per benchmark and on "
                 "average, with the Markov head, the sequential fixed point and dFlash as horizontal lines, and the "
                 "histogram of the passes adaptive stopping used per round. Data: tau_vs_k.json, from "
                 f"{data.get('command', 'notebook 05') if isinstance(data, dict) else 'notebook 05'}.")


LATENCY_STAGES = ("draft", "refine", "verify", "bookkeeping")


def plot_latency(rows: Sequence[dict]):
    """Time per stage per method as stacked bars (columns named ``<stage>``, ``<stage>_s`` or
    ``<stage>_ms``), else one bar per method of the first latency-like column. None when neither exists."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(rows)
    label = _first(df.columns, "method", "name", "config", "setting")
    if label is None:
        return None
    if label == "method" and "bench" in df.columns:  # one bar per method: the mean over benchmarks
        df = df.groupby("method", as_index=False, sort=False).mean(numeric_only=True)
    cols = {s: c for s in LATENCY_STAGES for c in (s, f"{s}_s", f"{s}_ms", f"{s}_ms_per_token") if c in df.columns}
    sns.set_palette("deep")
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.5 * len(df)))
    if cols:
        d = df.set_index(label)[list(cols.values())].rename(columns={v: k for k, v in cols.items()})
        d.plot.barh(stacked=True, ax=ax)
        ax.set_xlabel(f"time per round ({'ms' if any('ms' in c for c in cols.values()) else 's'}, as stored)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    else:
        value = next((c for c in df.columns if any(w in c for w in ("latency", "per_token", "ms"))
                      and pd.api.types.is_numeric_dtype(df[c])), None)
        if value is None:
            plt.close(fig)
            return None
        df.set_index(label)[value].plot.barh(ax=ax)
        ax.set_xlabel(value)
    ax.set_ylabel("")
    ax.set_title("latency by stage")
    fig.tight_layout()
    return fig


def draw_latency(preset: str) -> Drawn | None:
    """Notebook 05's own figure (:func:`xpress.studies.table3.plot_latency_vs_k`) for its ``shape_sets``
    layout, else :func:`plot_latency` of whatever table the file holds."""
    data = load_result(preset, "latency")
    if isinstance(data, dict) and data.get("shape_sets"):
        from .studies.table3 import plot_latency_vs_k as plot_sets

        return Drawn("latency", plot_sets(data), "Figure 4 analogue: refinement latency per block against K (median, "
                     "IQR bars) with the Markov head's serial decode as a dashed line, per shape set. Data: latency.json, "
                     "from notebook 05.")
    fig = plot_latency(records(data)) if data else None
    if fig is None:
        return None
    return Drawn("latency", fig, "Table 3 / Figure 4 analogue: decoding time per round split by stage (draft, refine, "
                 "verify, bookkeeping) as stored in latency.json, from "
                 f"{data.get('command', 'notebook 05') if isinstance(data, dict) else 'notebook 05'}.")


def plot_target_cost(result: dict):
    """The target's forward time split by component (stacked bars) against the new tokens, one panel per
    (dtype, context) of the lean runtime, the transformers forward's total as black dots."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(result["rows"])
    lean = df[df["runtime"] == "lean"]
    old = df[(df["runtime"] == "transformers") & (df["component"] == "forward")]
    fused = df[(df["runtime"] == "lean-fused") & (df["component"] == "forward")]
    dtypes = [d for d in result["dtypes"] if d in set(lean["dtype"])]  # not those the target skipped ("skipped")
    contexts = list(result["contexts"])
    comps = [c for c in result["components"]]
    colors = dict(zip(comps, sns.color_palette("deep", len(comps))))
    fig, axes = plt.subplots(len(dtypes), len(contexts), figsize=(3.2 * len(contexts), 2.8 * len(dtypes)),
                             squeeze=False, sharey=True)
    for i, dt in enumerate(dtypes):
        for j, L in enumerate(contexts):
            ax = axes[i][j]
            d = lean[(lean["dtype"] == dt) & (lean["context"] == L)]
            table = d.pivot(index="new_tokens", columns="component", values="median_ms").reindex(columns=comps)
            table.clip(lower=0).plot.bar(stacked=True, ax=ax, color=[colors[c] for c in comps], legend=False, width=0.7)
            o = old[old["context"] == L].set_index("new_tokens")["median_ms"].reindex(table.index)
            ax.plot(range(len(o)), o.values, "ko", label="transformers float32 (total)")
            fz = fused[(fused["dtype"] == dt) & (fused["context"] == L)]
            if len(fz):
                fz = fz.set_index("new_tokens")["median_ms"].reindex(table.index)
                ax.plot(range(len(fz)), fz.values, "r^", label="lean, fused C++ layer (total)")
            ax.set_title(f"lean {dt}, context {L}", fontsize=9)
            ax.set_xlabel("new tokens")
            ax.set_ylabel("ms per forward" if j == 0 else "")
            ax.tick_params(axis="x", rotation=0)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.0, 0.95), frameon=False)
    fig.suptitle("where a target forward spends its time (batch 1)")
    fig.tight_layout()
    return fig


def draw_target_cost(preset: str) -> Drawn | None:
    data = load_result(preset, "target_cost")
    if not isinstance(data, dict) or not data.get("rows"):
        return None
    return Drawn("target_cost", plot_target_cost(data),
                 "The target's forward per component for 1-16 new tokens after 64-1000 tokens of context, per dtype of "
                 "the lean runtime; black dots: the transformers forward in float32; red triangles: the lean forward with each layer one C++ call "
                 "(float32 where built, bf16 where its products run on AMX tiles). verify / step at B is the break-even "
                 "tau with free drafting. Data: target_cost.json (python -m xpress bench target-cost).")


def plot_refiner_cost(result: dict):
    """Notebook 02's counted cost per block (``refiner_cost.json``): FLOPs and parameter elements streamed per
    block, per setting and method (log scale)."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    cost = pd.DataFrame(result["table"])
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.2))
    for ax, col in zip(axes, ["GFLOP / block", "weights read (M elem)"]):
        sns.barplot(data=cost, x="setting", y=col, hue="method", ax=ax, palette="viridis")
        ax.set_yscale("log")
        ax.set_xlabel("")
        ax.set_xticks(ax.get_xticks(), [t.get_text().replace(" (", "\n(") for t in ax.get_xticklabels()], fontsize=8)
        ax.legend(fontsize=8)
    axes[0].set_title("Refinement FLOPs per block")
    axes[1].set_title("Parameter elements streamed per block")
    fig.tight_layout()
    return fig


def draw_refiner_cost(preset: str) -> Drawn | None:
    result = load_result(preset, "refiner_cost")
    if not isinstance(result, dict) or not result.get("table"):
        return None
    return Drawn("refiner_cost", plot_refiner_cost(result),
                 "FLOPs and parameter elements streamed per block of the xPress refiner at K passes and of the Markov "
                 "head's serial decode, at the paper's shapes, SmolLM2's and the cpu preset's (counted, not timed). "
                 "Data: refiner_cost.json, from notebook 02.")


def plot_batched(result: dict):
    """Throughput (tokens/s) and speedup over AR against the batch size, one line per method."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(result["table"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, col, title in ((axes[0], "tokens_per_s", "throughput (tokens/s)"), (axes[1], "speedup", "speedup over AR")):
        sns.lineplot(data=df, x="batch_size", y=col, hue="method", marker="o", ax=ax, legend=ax is axes[-1])
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(df["batch_size"].unique()), [str(b) for b in sorted(df["batch_size"].unique())])
        ax.set_title(title)
    axes[1].axhline(1.0, ls="--", c="k", lw=1)
    if axes[-1].get_legend():
        sns.move_legend(axes[-1], "upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def draw_batched(preset: str) -> Drawn | None:
    result = load_result(preset, "batched")
    if not result or not result.get("table"):
        return None
    return Drawn("batched", plot_batched(result),
                 f"Table 2 analogue: throughput and speedup over AR at batch sizes {result.get('batch_sizes')}, greedy, "
                 f"{result.get('n_prompts')} prompts x {result.get('max_new_tokens')} new tokens, the same prompts at "
                 f"every batch size in one run. Data: batched.json, from {result.get('command', 'notebook 06')}.")


def plot_resolution(result: dict):
    """tau(xPress) / tau(baseline) per benchmark and on average with its 95% interval, one panel per
    temperature, one colour per baseline; lines at 1 (no difference) and 1 +- ``rel`` (the difference to
    resolve)."""
    import matplotlib.pyplot as plt
    import pandas as pd

    df = pd.DataFrame(result["table"])
    rel = result.get("rel", 0.05)
    benches = list(dict.fromkeys(df["bench"]))
    temps = sorted(df["temperature"].unique())
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 0.5 * len(benches) + 2.2), squeeze=False,
                             sharey=True)
    for ax, t in zip(axes[0], temps):
        for i, (base, d) in enumerate(df[df["temperature"] == t].groupby("baseline", sort=False)):
            y = [benches.index(b) + (i - 0.5) * 0.25 for b in d["bench"]]
            ax.errorbar(d["tau_ratio"], y, xerr=[d["tau_ratio"] - d["lo"], d["hi"] - d["tau_ratio"]], fmt="o",
                        c=f"C{i}", capsize=3, label=f"xPress / {base}")
        ax.axvline(1.0, c="k", lw=1)
        for x in (1 - rel, 1 + rel):
            ax.axvline(x, c="grey", ls=":", lw=1)
        ax.set_yticks(range(len(benches)), benches)
        ax.invert_yaxis()
        ax.set_title(f"T = {t:g}")
        ax.set_xlabel("tau ratio (95% interval over prompts)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def draw_resolution(preset: str) -> Drawn | None:
    result = load_result(preset, "resolution")
    if not result or not result.get("table"):
        return None
    return Drawn("resolution", plot_resolution(result),
                 f"tau(xPress) / tau(baseline) on {result.get('prompts_per_benchmark')} prompts per benchmark "
                 f"(x {result.get('max_new_tokens')} new tokens, tau only, batched) with paired bootstrap 95% intervals "
                 f"over prompts; dotted lines at 1 +- {result.get('rel', 0.05):.0%}, the difference to resolve. "
                 f"Data: resolution.json, from {result.get('command', 'notebook 04')}.")


def data_scaling_rows(levers: dict | None) -> list[dict]:
    """The data-scaling curve in ``levers.json``: rows of the preset as is (``base``) and of
    ``train.train_sequences=N`` that share a recipe (steps, block size, anchors per sequence, target dtype;
    rows older than those fields share theirs), at the largest number of steps that has at least three data
    sizes and, among those, the latest run; sorted by training tokens ([] when there is no such curve yet:
    ``make studies`` runs it)."""
    rows = [r for r in (levers or {}).get("rows", []) if r.get("train_response_tokens") and not r.get("init")
            and (r["lever"] == "base" or r["lever"].startswith("train.train_sequences="))]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["steps"], r.get("block_size"), r.get("anchors_per_seq"), r.get("target_dtype"))
        groups.setdefault(key, []).append(r)
    full = [k for k, rs in groups.items() if len({r["train_response_tokens"] for r in rs}) >= 3]
    latest = max(full, key=lambda k: (k[0], max(r.get("date") or "" for r in groups[k])), default=None)
    return sorted(groups[latest], key=lambda r: r["train_response_tokens"]) if full else []


def plot_data_scaling(rows: Sequence[dict], break_even: float | None = None):
    """tau (teacher-forced, and by decoding where measured) against the regenerated response tokens
    trained on (log scale), with the break-even tau of this machine as a dashed line."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(rows)
    long = df.melt(id_vars=["train_response_tokens"], value_vars=[c for c in ("val_tf_tau", "val_tau") if c in df],
                   var_name="score", value_name="tau").dropna()
    long["score"] = long["score"].map({"val_tf_tau": "teacher-forced (held out)", "val_tau": "by decoding (held out)"})
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    sns.lineplot(data=long, x="train_response_tokens", y="tau", hue="score", marker="o", ax=ax)
    if break_even:
        ax.axhline(break_even, ls="--", color="grey", label=f"break-even tau {break_even:.2f}")
        ax.legend(frameon=False)
    ax.set_xscale("log")
    ax.set_xlabel("regenerated response tokens trained on")
    ax.set_title(f"data scaling: the plain drafter after {df['steps'].iloc[0]} steps")
    fig.tight_layout()
    return fig


def break_even_tau(rows: Sequence[dict]) -> float | None:
    """The tau at which speculative decoding matches AR at the stage costs the rows measured: the median over
    rows of (speculative round time / AR step time); None where no row timed both."""
    import statistics

    ratios = [r["round_ms"] / r["ar_step_ms"] for r in rows if r.get("round_ms") and r.get("ar_step_ms")]
    return statistics.median(ratios) if ratios else None


def lever_rows(levers: dict | None) -> list[dict]:
    """The full-length lever comparison in ``levers.json``: the one-key levers from scratch (not the
    data-scaling prefixes, not the co-training rows) decoded on the validation prompts, at the largest number
    of steps where ``base`` and at least one other lever ran with the same target dtype (rows of another
    machine class do not compare), ``base`` first, then by implied speedup ([] when there is none yet:
    ``make studies`` runs them)."""
    rows = [r for r in (levers or {}).get("rows", []) if r.get("val_tau") is not None and not r.get("init")
            and not r["lever"].startswith("train.train_sequences=")]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["steps"], r.get("target_dtype")), []).append(r)
    full = [k for k, rs in groups.items() if len(rs) >= 2 and any(r["lever"] == "base" for r in rs)]
    if not full:
        return []
    best = groups[max(full, key=lambda k: (k[0], len(groups[k])))]
    return sorted(best, key=lambda r: (r["lever"] != "base", -(r.get("implied_speedup") or 0)))


def plot_levers(rows: Sequence[dict]):
    """Per lever: tau by decoding the validation prompts, and the speedup over AR it implies at that run's
    own stage costs (bars) beside the one measured end to end (dots); dashed: the preset (``base``) and 1x."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.45 * len(df) + 1.4), sharey=True)
    sns.barplot(data=df, y="lever", x="val_tau", ax=axes[0], color="C0")
    axes[0].axvline(float(df.loc[df["lever"] == "base", "val_tau"].iloc[0]), ls="--", color="grey")
    axes[0].set_xlabel("tau by decoding (held-out prompts)")
    sns.barplot(data=df, y="lever", x="implied_speedup", ax=axes[1], color="C1", label="implied by tau")
    if "measured_speedup" in df:
        axes[1].scatter(df["measured_speedup"], range(len(df)), color="k", zorder=3, label="measured")
    axes[1].axvline(1.0, ls="--", color="grey")
    axes[1].set_xlabel("speedup over AR")
    axes[1].legend(frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0].set_ylabel("")
    dtype = df["target_dtype"].iloc[0] if "target_dtype" in df else None
    fig.suptitle(f"levers, one at a time: the plain drafter after {int(df['steps'].iloc[0])} steps"
                 + (f" ({dtype} target)" if isinstance(dtype, str) and dtype else ""))
    fig.tight_layout()
    return fig


def cotraining_steps_rows(levers: dict | None) -> list[dict]:
    """The co-training-steps curve in ``levers.json``: the ``base`` rows co-trained from the warm start
    (``init``), per method, of one run's data and recipe (training tokens, block size, anchors per sequence,
    target dtype), the group with the most step counts (at least two; then the latest); sorted by method
    and steps ([] when there is none yet: ``make studies`` runs them, HEAD_LEVERS and HEAD_STEPS)."""
    rows = [r for r in (levers or {}).get("rows", []) if r.get("init") and r["lever"] == "base"
            and r.get("val_tf_tau") is not None]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r.get("train_response_tokens"), r.get("block_size"), r.get("anchors_per_seq"), r.get("target_dtype"))
        groups.setdefault(key, []).append(r)
    full = [k for k, rs in groups.items() if len({r["steps"] for r in rs}) >= 2]
    best = max(full, key=lambda k: (len({r["steps"] for r in groups[k]}), max(r.get("date") or "" for r in groups[k])),
               default=None)
    return sorted(groups[best], key=lambda r: (r["method"], r["steps"])) if best else []


def plot_cotraining_steps(rows: Sequence[dict]):
    """Per method: tau against the co-training steps from the warm start (log scale), teacher-forced on the
    held-out blocks (solid) and by decoding the held-out prompts (dashed, where measured)."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(rows)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    order = sorted(df["method"].unique())
    sns.lineplot(data=df, x="steps", y="val_tf_tau", hue="method", hue_order=order, marker="o", ax=ax)
    if "val_tau" in df and df["val_tau"].notna().any():
        sns.lineplot(data=df.dropna(subset=["val_tau"]), x="steps", y="val_tau", hue="method", hue_order=order,
                     marker="s", linestyle="--", ax=ax, legend=False)
    ax.set_xscale("log")
    ax.set_xticks(sorted(df["steps"].unique()), [str(int(s)) for s in sorted(df["steps"].unique())])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())  # the steps run, not the log axis's own labels
    ax.set_xlabel("co-training steps from the warm start")
    ax.set_ylabel("tau: teacher-forced (solid), by decoding (dashed)")
    ax.set_title("co-training longer: each method from one warm start")
    fig.tight_layout()
    return fig


def draw_levers(preset: str) -> Drawn | None:
    rows = lever_rows(load_result(preset, "levers"))
    if not rows:
        return None
    return Drawn("levers", plot_levers(rows), "levers trained to the same steps from scratch, one config key each, "
                 "scored by tau by decoding and by speedup over AR. Data: levers.json (make studies).")


def draw_data_scaling(preset: str) -> Drawn | None:
    rows = data_scaling_rows(load_result(preset, "levers"))
    if not rows:
        return None
    return Drawn("data_scaling", plot_data_scaling(rows, break_even_tau(rows)),
                 "tau of the plain drafter against the training data (the first N regenerated sequences), same steps. "
                 "Data: levers.json (make studies).")


def draw_cotraining_steps(preset: str) -> Drawn | None:
    rows = cotraining_steps_rows(load_result(preset, "levers"))
    if not rows:
        return None
    return Drawn("cotraining_steps", plot_cotraining_steps(rows),
                 "tau of each method co-trained from one warm start for more steps, held-out scores. "
                 "Data: levers.json (make studies: HEAD_LEVERS, HEAD_STEPS).")


def plot_gain_strength(result: dict):
    """Three panels from ``gain_vs_strength.json``: (a) tau(xPress) / tau(dFlash) against tau(dFlash), one point
    per configuration and benchmark (filled: the average over benchmarks), colour by configuration, marker by
    temperature, 95% intervals; (b) acceptance at each draft position given the previous one accepted, per
    method, for the weakest and the strongest configuration at T = 0; (c) the ratio against the Jacobi
    budget K at T = 0, per configuration."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(result["points"])
    configs = [c["name"] for c in result["configurations"]]
    colours = dict(zip(configs, sns.color_palette("viridis", len(configs))))
    markers = {t: m for t, m in zip(sorted(df["temperature"].unique()), ("o", "^", "s"))}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    ax = axes[0]
    for (name, t), d in df.groupby(["configuration", "temperature"], sort=False):
        for avg, dd in d.groupby(d["bench"] == "avg"):
            ax.errorbar(dd["tau_dflash"], dd["ratio_dflash"],
                        yerr=[dd["ratio_dflash"] - dd["lo_dflash"], dd["hi_dflash"] - dd["ratio_dflash"]],
                        fmt=markers[t], ms=8 if avg else 5, mfc=colours[name] if avg else "none", c=colours[name],
                        capsize=2, lw=0.8, label=f"{name}, T = {t:g}" if avg else None)
    ax.axhline(1.0, c="k", lw=1)
    ax.set_xlabel("tau(dFlash), full block")
    ax.set_ylabel("tau(xPress) / tau(dFlash)")
    ax.set_title("(a) the gain against the drafter's strength\n(filled: average; hollow: one benchmark)")
    ax.legend(fontsize=7, loc="best", frameon=False)
    strength = {c["name"]: next((r["tau"] for r in c["taus"] if r["temperature"] == 0.0 and r["method"] == "dflash"
                                 and r["bench"] == "avg"), 0.0) for c in result["configurations"]}
    ends = sorted(strength, key=strength.get)
    ends = [ends[0], ends[-1]] if len(ends) > 1 else ends
    pos = [{"configuration": c["name"], "method": p["method"], "position": q["position"], "rate": q["rate"]}
           for c in result["configurations"] if c["name"] in ends for p in c["positions"]
           if p["temperature"] == 0.0 and p.get("bench", "all") == "all" for q in p["positions"] if q["rate"] is not None]
    if pos:
        sns.lineplot(data=pd.DataFrame(pos), x="position", y="rate", hue="method", style="configuration",
                     style_order=ends, markers=True, ax=axes[1])
        axes[1].legend(fontsize=7, frameon=False)
    axes[1].set_xlabel("draft position j")
    axes[1].set_ylabel("P(j accepted | j - 1 accepted)")
    axes[1].set_title("(b) where the refiner gains, T = 0\n(weakest and strongest configuration)")
    ks = [{"configuration": c["name"], **k} for c in result["configurations"] for k in c.get("k_sweep", [])]
    if ks:
        kd = pd.DataFrame(ks)
        for name, d in kd.groupby("configuration", sort=False):
            axes[2].errorbar(d["K"], d["ratio_dflash"], yerr=[d["ratio_dflash"] - d["lo"], d["hi"] - d["ratio_dflash"]],
                             marker="o", c=colours[name], capsize=2, label=name)
        axes[2].set_xticks(sorted(kd["K"].unique()))
        axes[2].legend(fontsize=7, frameon=False)
    axes[2].axhline(1.0, c="k", lw=1)
    axes[2].set_xlabel("Jacobi budget K")
    axes[2].set_ylabel("tau(xPress) / tau(dFlash), average")
    axes[2].set_title("(c) the ratio against K, T = 0")
    fig.tight_layout()
    return fig


def draw_gain_strength(preset: str) -> Drawn | None:
    result = load_result(preset, "gain_vs_strength")
    if not result or not result.get("points"):
        return None
    return Drawn("gain_vs_strength", plot_gain_strength(result),
                 f"The refiner's gain against the drafter's strength: {len(result['configurations'])} trained "
                 f"configurations x {len(result['benchmarks'])} benchmarks, {result['prompts_per_benchmark']} prompts "
                 f"each, full block ({result['draft_tokens']} drafts), T = 0 (replayed) and T = "
                 f"{result['temperatures'][-1]:g} (decoded), paired bootstrap 95% intervals over prompts. "
                 f"Data: gain_vs_strength.json, from {result.get('command', 'make studies')}.")


DRAWERS = {"refiner_cost": draw_refiner_cost, "training_curves": draw_training, "training_acceptance": draw_training_acceptance,
           "validation_tau": draw_validation_tau, "table1": draw_table1, "resolution": draw_resolution,
           "tau_vs_k": draw_tau_vs_k, "latency": draw_latency, "batched": draw_batched,
           "target_cost": draw_target_cost, "data_scaling": draw_data_scaling, "levers": draw_levers,
           "cotraining_steps": draw_cotraining_steps, "gain_vs_strength": draw_gain_strength}
# Figures no results file holds the data of: notebook 07 shows the copy the notebook saved.
SAVED_ONLY = {"regeneration": "notebook 01, from the regenerated data under data/<preset>/ (not committed)",
              "refiner_dependency": "notebook 02, from the Jacobians of random refiners built in the notebook"}
MADE_BY = {"training_curves": "notebook 03", "training_acceptance": "notebook 03", "validation_tau": "notebook 03",
           "table1": "notebook 04", "resolution": "notebook 04", "target_cost": "notebook 04", "tau_vs_k": "notebook 05",
           "latency": "notebook 05", "batched": "notebook 06", "data_scaling": "make studies", "levers": "make studies",
           "cotraining_steps": "make studies", "gain_vs_strength": "make studies", "refiner_cost": "notebook 02", **{k: v.split(",")[0] for k, v in SAVED_ONLY.items()}}


def draw_all(preset: str, save: bool = True) -> tuple[list[Drawn], list[str]]:
    """Every figure whose data exists under ``results/<preset>/`` (saved with :func:`save_fig` unless
    ``save`` is false), and the names of those whose data is missing."""
    drawn, missing = [], []
    for name, draw in DRAWERS.items():
        d = draw(preset)
        if d is None:
            missing.append(name)
            continue
        if save:
            save_fig(d.fig, d.name, preset)
        drawn.append(d)
    return drawn, missing


def show_all(preset: str, save: bool = True) -> dict[str, list[str]]:
    """Notebook 07: every figure of :data:`DRAWERS` drawn from ``results/<preset>/`` (saved unless ``save`` is
    false) and every :data:`SAVED_ONLY` figure as its notebook saved it, each displayed ONCE with its caption
    (a drawn figure is closed after display, so the inline backend does not show it again at the cell's end).
    Returns ``{"shown": names, "missing": names}`` (a figure whose data or saved file is absent)."""
    import matplotlib.pyplot as plt
    from IPython.display import Image, Markdown, display

    drawn, missing = draw_all(preset, save)
    for d in drawn:
        display(d.fig)
        plt.close(d.fig)
        display(Markdown(f"**{d.name}** (`{paths.portable(figures_dir(preset) / d.name)}.png`, `.pdf`): {d.caption}"))
    shown = [d.name for d in drawn]
    for name, source in SAVED_ONLY.items():
        png = figures_dir(preset) / f"{name}.png"
        if not png.is_file():
            missing.append(name)
            continue
        display(Image(filename=str(png)))
        display(Markdown(f"**{name}** (`{paths.portable(png)}`): as saved by {source}."))
        shown.append(name)
    return {"shown": shown, "missing": missing}
