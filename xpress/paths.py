"""Repository paths, resolved from this file rather than the working directory: owns every folder the
project reads or writes (configs, data, results, checkpoints, the cache) and which folders are rehearsal
stand-ins.

papermill and nbval start notebook kernels in different folders, so every path in the project goes
through here.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"
# ``$XPRESS_DATA`` and ``$XPRESS_CHECKPOINTS`` redirect regenerated data and checkpoints (tests that run
# ``python -m xpress regenerate/train`` in a subprocess point them at a temporary folder)
DATA = Path(os.environ.get("XPRESS_DATA", REPO_ROOT / "data")).expanduser().resolve()
# ``$XPRESS_RESULTS`` redirects results (``make test`` does, so test runs never touch the committed ones)
RESULTS = Path(os.environ.get("XPRESS_RESULTS", REPO_ROOT / "results")).expanduser().resolve()
FIGURES = RESULTS / "figures"
CHECKPOINTS = Path(os.environ.get("XPRESS_CHECKPOINTS", REPO_ROOT / "checkpoints")).expanduser().resolve()
NOTEBOOKS = REPO_ROOT / "notebooks"
REHEARSAL_DIR = "rehearsal"  # a folder of this name holds project-written stand-ins (xpress.rehearsal)


def cache_dir() -> Path:
    """Where converted models are cached: ``$XPRESS_CACHE`` or ``<repo>/.cache`` (ignored by git)."""
    return Path(os.environ.get("XPRESS_CACHE", REPO_ROOT / ".cache")).expanduser().resolve()


def resolve(path: str | os.PathLike) -> Path:
    """A path relative to the repository root (absolute paths are kept)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def portable(path: str | os.PathLike) -> str:
    """``path`` as result files and notebooks show it, without this machine's folders: relative to the
    repository root inside it, else relative to the redirected root it is under (``$XPRESS_CHECKPOINTS/...``,
    ``$XPRESS_DATA/...``, ``$XPRESS_RESULTS/...``), else as given (a hub name, a folder elsewhere)."""
    p = Path(path).expanduser()
    if not p.is_absolute():
        return str(path)
    for root, name in ((CHECKPOINTS, "XPRESS_CHECKPOINTS"), (DATA, "XPRESS_DATA"), (RESULTS, "XPRESS_RESULTS")):
        if p.is_relative_to(root) and not root.is_relative_to(REPO_ROOT):
            return f"${name}/{p.relative_to(root).as_posix()}"
    return p.relative_to(REPO_ROOT).as_posix() if p.is_relative_to(REPO_ROOT) else str(path)


def is_rehearsal_path(name: str | os.PathLike) -> bool:
    """Whether ``name`` (relative paths: from the repository root) is a rehearsal asset folder, one that
    ``python -m xpress rehearsal-assets`` writes (:mod:`xpress.rehearsal`): its parent folder is named
    :data:`REHEARSAL_DIR` and is not the repository root (a clone may itself be named ``rehearsal``). A hub id
    such as ``Qwen/Qwen3-8B`` is not."""
    folder = resolve(name)
    return bool(str(name)) and folder.parent.name == REHEARSAL_DIR and folder.parent != REPO_ROOT
