"""Figures, drawn from result files: every notebook saves through :func:`save_fig`, PNG and PDF under
``results/<preset>/figures/`` (so a run of one preset never touches another's figures)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

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
