import pytest
import torch

from xpress import DraftVocab


def test_full_is_identity():
    v = DraftVocab.full(10)
    ids = torch.tensor([[0, 3, 9]])
    assert v.size == 10 and v.is_identity
    assert torch.equal(v.to_target(ids), ids) and torch.equal(v.to_draft(ids), ids)
    q = torch.softmax(torch.randn(2, 10), -1)
    assert torch.equal(v.to_target_probs(q), q)


def test_from_ids_maps_both_ways():
    v = DraftVocab.from_ids([7, 2, 5], 10)
    assert v.size == 3 and not v.is_identity
    assert torch.equal(v.to_target(torch.tensor([0, 1, 2])), torch.tensor([7, 2, 5]))
    assert torch.equal(v.to_draft(torch.tensor([5, 7, 3])), torch.tensor([2, 0, -1]))
    assert torch.equal(v.contains(torch.tensor([2, 3])), torch.tensor([True, False]))
    # heads read out-of-vocabulary previous tokens (e.g. the anchor) from the extra row Vd
    assert torch.equal(v.input_index(torch.tensor([[5, 3, 7]])), torch.tensor([[2, 3, 0]]))


def test_from_counts_keeps_frequent_and_special():
    counts = torch.zeros(20)
    counts[[4, 9, 11, 15]] = torch.tensor([5.0, 50.0, 7.0, 7.0])
    v = DraftVocab.from_counts(counts, 4, always=[19])
    assert v.d2t.tolist() == [9, 11, 15, 19]  # most frequent (tie 11/15 both kept), EOS always, id order
    v = DraftVocab.from_counts(counts, 3, always=[19])
    assert v.d2t.tolist() == [9, 11, 19]  # tie broken towards the lower id
    with pytest.raises(ValueError):
        DraftVocab.from_counts(counts, 0)


def test_rejects_bad_ids():
    with pytest.raises(ValueError):
        DraftVocab.from_ids([1, 1], 5)
    with pytest.raises(ValueError):
        DraftVocab.from_ids([5], 5)


def test_to_target_probs_zero_outside():
    v = DraftVocab.from_ids([7, 2, 5], 10)
    q = torch.softmax(torch.randn(2, 4, 3), -1)
    p = v.to_target_probs(q)
    assert p.shape == (2, 4, 10)
    assert torch.allclose(p.sum(-1), torch.ones(2, 4))
    assert torch.equal(p[..., [7, 2, 5]], q)
    assert p[..., [0, 1, 3, 4, 6, 8, 9]].abs().sum() == 0


def test_save_load_roundtrip(tmp_path):
    v = DraftVocab.from_ids([7, 2, 5], 10)
    v.save(tmp_path / "draft_vocab.safetensors")
    w = DraftVocab.load(tmp_path / "draft_vocab.safetensors")
    assert w == v and w.target_size == 10
    assert DraftVocab.from_state_dict(v.state_dict()) == v


def test_vocabulary_reach_counts_coverage_copies_and_bigrams():
    from xpress.studies.vocab_reach import vocabulary_reach

    # a 10-token vocabulary; training answers: 1 four times, 2 twice, 3 once (after 2); bigrams 0->1, 1->1, 2->3
    train = [([0, 1, 1, 2, 3], 1), ([0, 1, 1, 2], 1)]
    # validation answers: 1, 2, 3 (3 is in the prompt), then 5, 5 (the second a copy of the first)
    val = [([3, 0, 1, 2, 3], 2), ([0, 5, 5], 1)]
    rows = {r["draft_vocab_size"]: r for r in vocabulary_reach(train, val, 10, [2, 3, 0], always=[9])}
    two = rows[2]  # {1, 9}: the most frequent and EOS
    assert (two["val_tokens"], two["val_outside"]) == (5, 4)
    assert two["val_coverage"] == pytest.approx(1 / 5) and two["train_coverage"] == pytest.approx(4 / 7)
    assert two["outside_seen_before"] == pytest.approx(2 / 4) and two["outside_in_prompt"] == pytest.approx(1 / 4)
    assert two["outside_bigram"] == pytest.approx(1 / 4) and two["inside_bigram"] == 1.0
    three = rows[3]  # {1, 2, 9}
    assert three["val_outside"] == 3 and three["train_coverage"] == pytest.approx(6 / 7)
    assert three["outside_seen_before"] == pytest.approx(2 / 3) and three["inside_bigram"] == pytest.approx(1 / 2)
    full = rows[10]  # size 0: the whole vocabulary
    assert full["val_coverage"] == 1.0 and full["val_outside"] == 0 and full["outside_seen_before"] is None
    assert full["inside_bigram"] == pytest.approx(2 / 5)


def test_vocab_reach_command_refuses_a_negative_size_before_loading_anything(capsys):
    from xpress.studies.vocab_reach import main

    with pytest.raises(SystemExit) as e:
        main(["--preset", "smoke", "--sizes", "4096", "-1"])
    assert e.value.code == 2 and "--sizes must be 0 (the whole vocabulary) or positive" in capsys.readouterr().err
