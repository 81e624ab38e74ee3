"""xpress: parallel refinement for diffusion drafters in speculative decoding (arXiv 2608.02438).

Public names are imported lazily, so ``import xpress`` stays fast and light.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # config and targets
    "Config": "config", "ConfigError": "config", "load_config": "config",
    "Target": "targets", "load_target": "targets", "format_chat": "targets",
    "target_forward": "targets", "target_layer_ids": "targets",
    # data
    "load_benchmark": "data", "list_benchmarks": "data", "training_prompts": "data",
    # the drafter protocol
    "Draft": "protocol", "Drafter": "protocol",
    # models
    "DraftVocab": "vocab", "DFlashDraftModel": "drafter", "XPressRefiner": "heads",
    "MarkovHead": "heads", "jacobi_refine": "jacobi", "sequential_refine": "jacobi",
    "ModelDrafter": "proposer", "build_drafter": "proposer", "make_drafter": "methods",
    # decoding
    "generate_ar": "decoding", "generate_speculative": "decoding",
    "RandomDrafter": "reference_drafters", "OracleDrafter": "reference_drafters",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'xpress' has no attribute {name!r}")
