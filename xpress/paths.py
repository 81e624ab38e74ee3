"""Repository paths, resolved from this file rather than the working directory.

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


def cache_dir() -> Path:
    """Where converted models are cached: ``$XPRESS_CACHE`` or ``<repo>/.cache`` (ignored by git)."""
    return Path(os.environ.get("XPRESS_CACHE", REPO_ROOT / ".cache")).expanduser().resolve()


def resolve(path: str | os.PathLike) -> Path:
    """A path relative to the repository root (absolute paths are kept)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p
