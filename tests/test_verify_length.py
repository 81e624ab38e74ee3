"""``decode.draft_tokens=auto`` (xpress.verify_length): each row's verify length from the drafter's
confidence and the measured cost of a round. The rule's arithmetic, the config switch, the per-row lengths
in greedy verification, the calibration, and the output at T = 0 equal to greedy AR for every method, batch
1 and ragged batches. The T > 0 distribution tests are in tests/test_sampling.py (a length chosen from each
position's distribution passes; one that reads the drawn token fails)."""
from __future__ import annotations

import dataclasses

import pytest
import torch


from xpress.config import ConfigError, load_config
from xpress.decoding import generate_ar, generate_speculative, generate_speculative_batch, greedy_accept
from xpress.methods import MODEL_METHODS, make_drafter
from xpress.targets import encode_chat
from xpress.verify_length import VerifyCosts, calibrate, draft_lengths

MAX_NEW = 12

pytestmark = pytest.mark.usefixtures("no_checkpoints")


def test_the_stopping_rule():
    """E_j = 1 + sum_{i <= j} prod_{l <= i} c_l: rows [1, 1, 1] -> 2, 3, 4; [0, 1, 1] -> 1, 1, 1; [.5, .5, .5] ->
    1.5, 1.75, 1.875."""
    c = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    free = VerifyCosts(0.0, (1.0,) * 4)  # every verify costs the same: verify everything worth anything
    assert draft_lengths(c, free).tolist() == [3, 1, 3]
    assert draft_lengths(torch.full((1, 3), 1e-9), free).tolist() == [3]  # gains below E's float32 rounding count
    # r_j = E_j / (1 + 0.1 j): row 3 climbs 1.5/1.1 = 1.36 -> 1.75/1.2 = 1.46, then 1.875/1.3 = 1.44: stop at 2
    steeper = VerifyCosts(0.0, tuple(1.0 + 0.1 * i for i in range(4)))
    assert draft_lengths(c, steeper).tolist() == [3, 1, 2]
    assert draft_lengths(c, VerifyCosts(0.0, (1.0, 1.0))).tolist() == [1, 1, 1]  # the costs cover one draft
    # refining costs 0.1 per position and verifies are free: the same as the steeper verifies above
    assert draft_lengths(c, VerifyCosts((0.1, 0.2, 0.3), (0.9,) * 4)).tolist() == [3, 1, 2]
    with pytest.raises(ValueError, match="verify_s"):
        VerifyCosts(0.0, (1.0, 0.0))


def test_the_config_switch():
    cfg = load_config("smoke", ["decode.draft_tokens=auto"])
    assert cfg.decode.draft_tokens == "auto"
    assert load_config("smoke", ["decode.draft_tokens=2"]).decode.draft_tokens == 2
    for bad in ("often", "-1", str(cfg.drafter.block_size), "1.5"):
        with pytest.raises(ConfigError, match="decode.draft_tokens=.* must be auto or lie in"):
            load_config("smoke", [f"decode.draft_tokens={bad}"])


def test_greedy_acceptance_stops_at_each_rows_length():
    logits = torch.nn.functional.one_hot(torch.tensor([[5, 6, 7, 8]] * 3), 10).float()  # the target's argmaxes
    draft = torch.tensor([[5, 6, 7]] * 3)
    n_acc, nxt = greedy_accept(draft, logits, torch.tensor([3, 1, 0]))
    assert n_acc.tolist() == [3, 1, 0] and nxt.tolist() == [8, 6, 5]


def _auto(cfg, target, method, costs=None):
    auto = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, draft_tokens="auto"))
    drafter = make_drafter(method, auto, target, seed=0, untrained_ok=True)
    if costs is not None:
        drafter.verify_costs = costs
    return drafter


def test_calibration_measures_every_verify_length(cfg, target):
    drafter = _auto(cfg, target, "xpress")
    c = drafter.verify_costs  # make_drafter calibrated it
    B = cfg.drafter.block_size
    assert isinstance(c, VerifyCosts) and len(c.verify_s) == B and len(c.draft_s) == B - 1 and min(c.draft_s) > 0
    assert all(v > 0 for v in c.verify_s) and c.source.startswith("calibrate")
    again = calibrate(target, drafter, repeats=1)
    assert again.verify_s == c.verify_s  # the verify times are measured once per target and block size


@pytest.fixture(scope="module")
def prompts(target):
    from xpress.data import load_benchmark

    return [encode_chat(target.tokenizer, rec["turns"][:1]) for rec in load_benchmark("gsm8k", limit=4)]


@pytest.mark.parametrize("method", MODEL_METHODS)
def test_auto_stays_greedy_single_and_in_batches(method, cfg, target, prompts):
    """Free verifies (every length costs the same: each row verifies the whole block) and steep ones (one draft a
    round): every output equals greedy AR's, batch 1 and in a ragged batch."""
    reference = [generate_ar(target, p, MAX_NEW).token_ids for p in prompts]
    B = cfg.drafter.block_size
    for costs, length in ((VerifyCosts(0.0, (1.0,) * B), B - 1),
                          (VerifyCosts(0.0, tuple(10.0 ** i for i in range(B))), 1)):
        drafter = _auto(cfg, target, method, costs)
        for p, ref in zip(prompts, reference):
            g = generate_speculative(target, drafter, p, MAX_NEW)
            assert g.token_ids == ref
            assert {k for ks in g.stats["draft_k"] for k in (ks if isinstance(ks, list) else [ks])} == {length}
        gens = generate_speculative_batch(target, drafter, prompts, MAX_NEW)
        assert [g.token_ids for g in gens] == reference


class RaggedLengths:
    """A model drafter whose rows offer seeded random prefixes of its block (``Draft.lengths``), to check the
    engine's per-row acceptance at T = 0 whatever lengths a rule picks."""

    def __init__(self, drafter, seed: int = 0) -> None:
        self.inner, self.block_size = drafter, drafter.block_size
        self.g = torch.Generator().manual_seed(seed)
        self.seen: set[int] = set()

    def reset(self, prompt_ids):
        self.inner.reset(prompt_ids)

    def extend(self, *args):
        self.inner.extend(*args)

    def propose(self, anchor, anchor_pos, temperature, generator=None):
        draft = self.inner.propose(anchor, anchor_pos, temperature, generator)
        k = draft.tokens.shape[1]
        draft.lengths = torch.randint(1, k + 1, (anchor.shape[0],), generator=self.g)
        self.seen |= set(draft.lengths.tolist())
        return draft


def test_rows_that_verify_different_lengths_stay_greedy(cfg, target, prompts):
    reference = [generate_ar(target, p, MAX_NEW).token_ids for p in prompts]
    drafter = RaggedLengths(make_drafter("xpress", cfg, target, seed=0, untrained_ok=True))
    gens = generate_speculative_batch(target, drafter, prompts, MAX_NEW)
    assert [g.token_ids for g in gens] == reference
    assert len(drafter.seen) > 1
    assert all(a <= B for g in gens for a in g.accept_lengths for B in [cfg.drafter.block_size])
