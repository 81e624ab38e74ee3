"""The draft-temperature study (xpress.studies.draft_temperature): a drafter drawing at its own temperature, or
greedily with a one-hot q (lossless: tests/test_sampling.py, test_rejection_accept_with_greedy_drafts_is_p), and
the study's table and command line."""
import dataclasses

import pytest
import torch

from xpress.config import load_config
from xpress.decoding import generate_speculative
from xpress.proposer import new_drafter
from xpress.studies import draft_temperature as dt
from xpress.targets import encode_chat


def test_greedy_drafts_carry_a_one_hot_q_and_other_temperatures_pass_through(cfg, smoke):
    drafter = new_drafter("dflash", cfg, smoke, seed=0)
    prompt = encode_chat(smoke.tokenizer, ["Count to five."])
    calls = []
    real = drafter.propose

    def spy(anchor, pos, temperature, generator=None):
        calls.append(temperature)
        return real(anchor, pos, temperature, generator)

    drafter.propose = spy
    greedy = dt.DraftAt(drafter, 0.0, smoke.vocab_size)
    gen = generate_speculative(smoke, greedy, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(gen.token_ids) == 12 and set(calls) == {0.0}  # every round drafted greedily
    drafter.reset([prompt])
    draft = greedy.propose(torch.tensor([prompt[-1]]), torch.tensor([len(prompt) - 1]), 1.0)
    assert draft.q.shape == (*draft.tokens.shape, smoke.vocab_size)
    assert torch.equal(draft.q.sum(-1), torch.ones(draft.tokens.shape))
    assert torch.equal(draft.q.argmax(-1), draft.tokens)
    calls.clear()
    warm = dt.DraftAt(drafter, 0.8, smoke.vocab_size)
    generate_speculative(smoke, warm, prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    generate_speculative(smoke, warm, prompt, 6, temperature=0.0)  # T = 0: greedy whatever t_d
    assert set(calls) == {0.8, 0.0}
    with pytest.raises(ValueError, match="use 0 \\(greedy drafts\\) or a positive temperature"):
        dt.DraftAt(drafter, -0.5, smoke.vocab_size)


def test_the_study_tables_tau_and_the_ratio_to_drawing_at_the_decoding_temperature(smoke):
    cfg = load_config("smoke", ["eval.max_new_tokens=8", "eval.resolution_batch_size=2", "eval.bootstrap=50"])
    result = dt.run_draft_temperature(cfg, smoke, temps=[0.0, 0.5], per_benchmark=1, methods=["dflash", "xpress"],
                                      untrained_ok=True, progress=False, save=False)
    T = cfg.eval.sampling_temperature
    assert result["draft_temperatures"] == sorted({0.0, 0.5, T}) and result["temperature"] == T
    table = {(r["method"], r["draft_temperature"]): r for r in result["table"]}
    assert set(table) == {(m, t) for m in ("dflash", "xpress") for t in result["draft_temperatures"]}
    n_prompts = len(cfg.data.benchmarks)
    for (m, t), r in table.items():
        assert r["prompts"] == n_prompts and r["tau"] >= 1 and r["lo"] <= r["ratio"] <= r["hi"]
        rows = [x for x in result["rows"] if x["method"] == dt.name(m, t)]
        assert r["tau"] == pytest.approx(sum(x["tokens"] for x in rows) / sum(x["steps"] for x in rows))
    assert table[("dflash", T)]["ratio"] == table[("xpress", T)]["ratio"] == 1.0
    assert {r["temperature"] for r in result["rows"]} == {T}


def test_the_command_refuses_bad_temperatures_in_one_line(capsys):
    assert dt.main(["--preset", "smoke", "--draft-temperatures", "0,warm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--draft-temperatures '0,warm'" in err[0] and "e.g. 0,0.8,1" in err[0]
    assert dt.main(["--preset", "smoke", "--draft-temperatures", "0,-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a negative temperature; use 0 (greedy drafts) or positive ones" in err[0]
    assert dt.main(["--preset", "smoke", "--prompts", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prompts 0: give at least 1 prompt per benchmark" in err[0]


def test_a_draft_keeps_its_fields_when_q_is_replaced():
    from xpress.protocol import Draft

    d = Draft(torch.tensor([[3, 4]]), None, {"draft": 0.1}, {"iters": torch.tensor([2])})
    e = dataclasses.replace(d, q=torch.zeros(1, 2, 5))
    assert e.timings == d.timings and e.stats is d.stats and torch.equal(e.tokens, d.tokens)
