"""Figures: every notebook saves through :func:`save_fig`, PNG and PDF under ``results/figures/``."""
from __future__ import annotations

from pathlib import Path

from . import paths
from .utils import atomic_write


def save_fig(fig, name: str) -> list[Path]:
    """Write a matplotlib figure as ``results/figures/<name>.png`` and ``.pdf`` (atomically)."""
    return [atomic_write(paths.FIGURES / f"{name}.{ext}",
                    lambda tmp, ext=ext: fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight"))
            for ext in ("png", "pdf")]
