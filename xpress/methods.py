"""Decoding methods by name, and the one place that turns a method name into a drafter.

Methods:
  ``ar``      autoregressive decoding, no drafter
  ``oracle``  the target's own greedy continuation (:class:`~xpress.reference_drafters.OracleDrafter`)
  ``random``  uniform random tokens (:class:`~xpress.reference_drafters.RandomDrafter`)
  ``dflash``, ``markov``, ``xpress``  model drafters (:mod:`xpress.proposer`): the plain dFlash drafter,
              with DSpark's Markov head, with the xPress refiner

    >>> drafter = make_drafter("xpress", cfg, target, untrained_ok=True)   # doctest: +SKIP
    >>> drafter_weights(drafter)                                          # doctest: +SKIP
    'untrained'

Nothing heavy is imported at module level: the command-line parser reads :data:`METHODS` from here.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Config
    from .protocol import Drafter
    from .targets import Target

__all__ = ["METHODS", "MODEL_METHODS", "make_drafter", "drafter_weights"]

METHODS = ("ar", "oracle", "random", "dflash", "markov", "xpress")
# Drafters with weights: the names xpress.proposer.METHODS builds, spelled out here so that the command-line
# parser does not import torch (tests/test_proposer.py checks that the two agree).
MODEL_METHODS = ("dflash", "markov", "xpress")


def make_drafter(method: str, cfg: Config, target: Target, seed: int = 0,
                 checkpoint: str | os.PathLike | None = None, untrained_ok: bool = False) -> Drafter | None:
    """The drafter for ``method``: None for ``ar``, a reference drafter for ``oracle`` / ``random`` (seeded
    with ``seed``), else a :class:`~xpress.proposer.ModelDrafter` from :func:`xpress.proposer.build_drafter`
    (``checkpoint`` folder, else ``checkpoints/<preset>/<method>/``, else for ``dflash`` a released
    checkpoint named by ``cfg.drafter.checkpoint``).

    A missing checkpoint raises :class:`~xpress.drafter.CheckpointNotFoundError` (a FileNotFoundError whose
    message says how to train one), unless ``untrained_ok``: then the drafter gets fresh, seeded weights
    (:func:`xpress.proposer.new_drafter`). :func:`drafter_weights` tells which it was. On a target that runs
    the compiled harness (``Target.compiled``) the model drafter's refinement is compiled too
    (:meth:`xpress.proposer.ModelDrafter.compile`).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: use one of {', '.join(METHODS)}")
    if method == "ar":
        return None
    if method == "oracle":
        from .reference_drafters import OracleDrafter

        return OracleDrafter(target, cfg)
    if method == "random":
        from .reference_drafters import RandomDrafter

        return RandomDrafter(target, cfg, seed=seed)
    from .proposer import CheckpointNotFoundError, build_drafter, new_drafter

    try:
        drafter = build_drafter(method, cfg, target, checkpoint=checkpoint)
    except CheckpointNotFoundError:
        if not untrained_ok:
            raise
        drafter = new_drafter(method, cfg, target, seed=seed)
    compiled = getattr(target, "compiled", None)
    return drafter if compiled is None else drafter.compile(compiled.backend)  # the compiled harness: refiner too


def drafter_weights(drafter: Drafter) -> str:
    """``"trained"`` (loaded from a checkpoint) or ``"untrained"`` (fresh weights) for a model drafter, read
    from its ``weights`` attribute; ``"reference"`` for a drafter without one (oracle, random, test doubles)."""
    return getattr(drafter, "weights", "reference")
