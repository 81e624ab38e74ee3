"""The main job: run every notebook in order with papermill on one preset.

Executed notebooks land in ``results/<preset>/executed/``; the notebooks themselves save their tables
and figures under ``results/``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from . import paths
from .config import load_config

KERNEL = "xpress"


def notebooks() -> list[Path]:
    """The pipeline's notebooks, in order (``NN_name.ipynb``)."""
    return sorted(p for p in paths.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def run_notebooks(preset: str, only: Sequence[str] = (), overrides: Sequence[str] = (),
                  kernel: str = KERNEL) -> list[Path]:
    """Execute the notebooks (all, or those whose name contains one of ``only``) on ``preset``."""
    import papermill as pm

    load_config(preset, list(overrides))  # fail early on a bad preset or key
    out_dir = paths.RESULTS / preset / "executed"
    out_dir.mkdir(parents=True, exist_ok=True)
    params: dict[str, Any] = {"PRESET": preset, "OVERRIDES": list(overrides)}
    done = []
    for nb in notebooks():
        if only and not any(o in nb.name for o in only):
            continue
        out = out_dir / nb.name
        print(f"[xpress] running {nb.name} on preset {preset} -> {out.relative_to(paths.REPO_ROOT)}")
        pm.execute_notebook(str(nb), str(out), parameters=params, kernel_name=kernel,
                            cwd=str(paths.NOTEBOOKS), progress_bar=True)
        done.append(out)
    return done
