"""T > 0: speculative sampling is lossless (distributionally equal to autoregressive sampling).

A MICRO target (a tiny LlamaForCausalLM with an 8-token vocabulary, no tokenizer) gives exact target
probabilities for every 3-token continuation of a fixed prompt. A drafter proposes from known random
distributions q (not p). The joint distribution of the first 3 generated tokens, over 20k independent
sequences decoded as ONE ragged batch, must pass a chi-square goodness-of-fit test against the exact
probabilities -- and the same test must FAIL when the rejection residual is deliberately wrong (drawing
the replacement from p instead of norm(max(p - q, 0))).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from xpress import decoding
from xpress.config import TargetConfig
from xpress.decoding import (generate_ar_batch, generate_speculative_batch, greedy_accept, rejection_accept,
                             residual_distribution)
from xpress.protocol import Draft
from xpress.targets import Target

V = 8
PROMPT = [1, 5, 2, 7]
TEMPERATURE = 0.8
N = 20_000
N_TOKENS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def _wrong_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A classic bug: on rejection, resample from p itself (biased towards tokens q over-proposes)."""
    return p


@pytest.fixture(scope="module")
def micro() -> Target:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False, initializer_range=0.6, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, cfg=TargetConfig(source="random", max_context=64),
                  hidden_size=16, vocab_size=V, num_layers=2, layer_ids=[0], eos_token_ids=[], name="micro")


@pytest.fixture(scope="module")
def exact(micro: Target) -> np.ndarray:
    """Exact joint target probabilities of the first 3 tokens after PROMPT at TEMPERATURE: [V, V, V]."""
    x1, x2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    seqs = torch.cat([torch.tensor(PROMPT).expand(V * V, -1), x1.reshape(-1, 1), x2.reshape(-1, 1)], 1)
    with torch.inference_mode():
        logits = micro.model(input_ids=seqs).logits.double()
    p = torch.softmax(logits / TEMPERATURE, -1)
    L = len(PROMPT)
    p1 = p[0, L - 1]  # [V]
    p2 = p[:, L].reshape(V, V, V)[:, 0]  # [x1, V] (independent of x2)
    p3 = p[:, L + 1].reshape(V, V, V)  # [x1, x2, V]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    assert abs(float(joint.sum()) - 1) < 1e-9
    assert float(p1.max()) > 0.3, "the micro target should be far from uniform"
    return joint.numpy()


class FixedQDrafter:
    """Drafts position k from a fixed random distribution q_k (ignores the context), q_k != p."""

    def __init__(self, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.q = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((block_size - 1,)).float()

    def reset(self, prompt_ids):
        pass

    def extend(self, tokens, features, positions, valid):
        pass

    def propose(self, anchor, anchor_pos, temperature, generator=None):
        b, n = anchor.shape[0], self.block_size - 1
        tokens = torch.multinomial(self.q, b, replacement=True, generator=generator).T  # [b, n]
        return Draft(tokens=tokens.contiguous(), q=self.q.expand(b, n, V))


def _joint_counts(token_lists: list[list[int]]) -> np.ndarray:
    t = np.asarray([g[:N_TOKENS] for g in token_lists])
    assert t.shape == (len(token_lists), N_TOKENS)
    return np.bincount(t[:, 0] * V * V + t[:, 1] * V + t[:, 2], minlength=V ** 3)


def _gof_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells with expected count < min_expected are pooled into one."""
    expected = probs.reshape(-1) / probs.sum() * counts.sum()  # float32 probabilities sum to 1 only to ~1e-7
    small = expected < min_expected
    obs, exp = counts[~small], expected[~small]
    if expected[small].sum() > 0:
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
    elif counts[small].sum() > 0:
        return 0.0  # draws where the exact probability is 0
    return float(chisquare(obs, exp).pvalue)


def _speculative_counts(micro: Target, block_size: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    gens = generate_speculative_batch(micro, FixedQDrafter(block_size, seed), [PROMPT] * N, N_TOKENS,
                                      TEMPERATURE, generator=g)
    return _joint_counts([x.token_ids for x in gens])


# ----------------------------------------------------------------------------------------- end to end
def test_autoregressive_sampling_matches_exact(micro, exact):
    g = torch.Generator().manual_seed(11)
    gens = generate_ar_batch(micro, [PROMPT] * N, N_TOKENS, TEMPERATURE, generator=g)
    assert _gof_pvalue(_joint_counts([x.token_ids for x in gens]), exact) > 1e-3


@pytest.mark.parametrize("block_size", [3, 4])
def test_speculative_sampling_matches_exact(micro, exact, block_size):
    """B = 3 puts the all-accepted bonus token inside the first 3; B = 4 puts rejections at every slot."""
    assert _gof_pvalue(_speculative_counts(micro, block_size, seed=block_size), exact) > 1e-3


def test_wrong_residual_is_detected(micro, exact, monkeypatch):
    monkeypatch.setattr(decoding, "residual_distribution", _wrong_residual)
    assert _gof_pvalue(_speculative_counts(micro, 3, seed=3), exact) < 1e-6


# ------------------------------------------------------------------------------------ acceptance rules
def _first_token_counts(p: torch.Tensor, q: torch.Tensor, residual=None, n_rows: int = 200_000) -> np.ndarray:
    """One verification round with fixed p [n + 1, V] and q [n, V]: counts of the first committed token."""
    g = torch.Generator().manual_seed(0)
    n = q.shape[0]
    draft = torch.multinomial(q, n_rows, replacement=True, generator=g).T.contiguous()  # [rows, n]
    n_acc, nxt = rejection_accept(draft, q.expand(n_rows, n, V), p.expand(n_rows, n + 1, V), g, residual)
    first = torch.where(n_acc > 0, draft[:, 0], nxt)
    return np.bincount(first.numpy(), minlength=V)


def test_rejection_accept_first_token_is_p():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        d = torch.distributions.Dirichlet(torch.full((V,), 0.5))
        p, q = d.sample((4,)), d.sample((3,))
    assert _gof_pvalue(_first_token_counts(p, q), p[0].double().numpy()) > 1e-3
    assert _gof_pvalue(_first_token_counts(p, q, _wrong_residual), p[0].double().numpy()) < 1e-6


def test_rejection_accept_with_greedy_drafts_is_p():
    """Greedy drafts at T > 0 (xpress.studies.draft_temperature, t_d = 0): q one-hot on each drafted token, which
    is then accepted with probability p(d); the first committed token is still distributed as p, and the wrong
    residual is caught here too."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        p = torch.distributions.Dirichlet(torch.full((V,), 0.5)).sample((4,))
    q = torch.nn.functional.one_hot(torch.tensor([2, 5, 5]), V).float()  # [3, V]: the drafter's argmaxes
    assert _gof_pvalue(_first_token_counts(p, q), p[0].double().numpy()) > 1e-3
    assert _gof_pvalue(_first_token_counts(p, q, _wrong_residual), p[0].double().numpy()) < 1e-6


def test_rejection_accept_bonus_when_q_equals_p():
    """q == p: every draft is accepted and the bonus comes from the last target distribution."""
    p = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(0)), -1)
    draft = torch.tensor([[1, 2]] * 1000)
    n_acc, _ = rejection_accept(draft, p[:2].expand(1000, 2, V), p.expand(1000, 3, V))
    assert bool((n_acc == 2).all())


def test_rejection_of_impossible_token():
    """A draft the target gives probability 0 is always rejected, and never resampled."""
    p = torch.zeros(1, 2, V)
    p[0, :, 3] = 1.0
    q = torch.full((1, 1, V), 1.0 / V)
    n_acc, nxt = rejection_accept(torch.tensor([[5]]), q, p)
    assert int(n_acc) == 0 and int(nxt) == 3


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    r = residual_distribution(p, q)
    assert torch.allclose(r, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(residual_distribution(p, p), p)  # nothing left: falls back to p


def test_greedy_accept():
    logits = torch.full((3, 4, 10), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    logits.scatter_(2, best[..., None], 1.0)
    draft = torch.tensor([[1, 2, 3], [1, 9, 3], [7, 2, 3]])
    n_acc, nxt = greedy_accept(draft, logits)
    assert n_acc.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 2, 1]


def test_sample_draws_each_row_from_its_distribution():
    """decoding.sample (inverse CDF in float64): 100k draws per row match the row's distribution (chi-square),
    tokens of probability zero are never drawn, an unnormalised row counts as its normalisation, and a seeded
    generator repeats its draws; a wrong distribution fails the same test."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0, 0.0], [0.0, 0.1, 0.1, 0.1, 0.1, 1.6]])  # row 2 sums to 2
    draws = torch.stack([decoding.sample(probs, g) for _ in range(100_000)])  # [n, 2]
    for row in range(2):
        obs = np.bincount(draws[:, row].numpy(), minlength=6)
        p = (probs[row] / probs[row].sum()).double().numpy()
        assert obs[p == 0].sum() == 0
        assert chisquare(obs[p > 0], p[p > 0] * len(draws)).pvalue > 1e-3
        wrong = np.where(p > 0, 1.0, 0.0) / (p > 0).sum()
        assert chisquare(obs[p > 0], wrong[p > 0] * len(draws)).pvalue < 1e-6
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(decoding.sample(probs, a), decoding.sample(probs, b))


# ------------------------------------------------------------- a verify length chosen per row (auto)
class ChainQDrafter(FixedQDrafter):
    """Drafts position 1 from q_1 and position j + 1 from ``Q[x_j]`` (a distribution per previous token) and
    offers each row the prefix :func:`xpress.verify_length.draft_lengths` chooses from each position's largest
    probability (what ``decode.draft_tokens=auto`` reads)."""

    def __init__(self, block_size: int, seed: int = 0) -> None:
        super().__init__(block_size, seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 100)
            self.table = torch.distributions.Dirichlet(torch.full((V,), 0.3)).sample((V,)).float()  # [V, V]
        self.lengths_seen: set[int] = set()

    def propose(self, anchor, anchor_pos, temperature, generator=None):
        from xpress.verify_length import VerifyCosts, draft_lengths

        b, n = anchor.shape[0], self.block_size - 1
        q = torch.empty(b, n, V)
        tokens = torch.empty(b, n, dtype=torch.long)
        q[:, 0] = self.q[0]
        for j in range(n):
            if j:
                q[:, j] = self.table[tokens[:, j - 1]]
            tokens[:, j] = torch.multinomial(q[:, j], 1, generator=generator)[:, 0]
        costs = VerifyCosts(0.0, tuple(1.0 + 0.1 * i for i in range(self.block_size)))  # a row costs 0.1 more
        lengths = draft_lengths(q.amax(-1), costs)
        self.lengths_seen |= set(lengths.tolist())
        return Draft(tokens=tokens, q=q, lengths=lengths)


class PeekingDrafter(FixedQDrafter):
    """The mistake the rule avoids: it offers its drafts only when the token drawn at position 1 is q_1's
    most likely one (a length that reads the drawn token itself), else none."""

    def propose(self, anchor, anchor_pos, temperature, generator=None):
        draft = super().propose(anchor, anchor_pos, temperature, generator)
        draft.lengths = torch.where(draft.tokens[:, 0] == self.q[0].argmax(), self.block_size - 1, 0)
        return draft


def test_a_verify_length_chosen_per_row_from_each_positions_distribution_is_lossless(micro, exact):
    g = torch.Generator().manual_seed(3)
    drafter = ChainQDrafter(4, seed=3)
    gens = generate_speculative_batch(micro, drafter, [PROMPT] * N, N_TOKENS, TEMPERATURE, generator=g)
    assert drafter.lengths_seen == {1, 2, 3}, "every length should be chosen for some rows"
    assert _gof_pvalue(_joint_counts([x.token_ids for x in gens]), exact) > 1e-3


def test_a_verify_length_that_reads_the_drawn_token_is_detected(micro, exact):
    """The test above can fail: offering drafts only when a drawn token is likely biases the output."""
    g = torch.Generator().manual_seed(3)
    gens = generate_speculative_batch(micro, PeekingDrafter(4, seed=3), [PROMPT] * N, N_TOKENS, TEMPERATURE,
                                      generator=g)
    assert _gof_pvalue(_joint_counts([x.token_ids for x in gens]), exact) < 1e-6
