import dataclasses

import pytest
import torch

import xpress.paths
from xpress import Drafter, ModelDrafter, build_drafter
from xpress.drafter import DrafterMismatchError
from xpress.heads import randomize_
from xpress.methods import MODEL_METHODS, drafter_weights, make_drafter
from xpress.proposer import METHODS, CheckpointNotFoundError, new_drafter, save_drafter
from xpress.targets import target_forward


@pytest.fixture(scope="module")
def context(target):
    """Two ragged rows: 11 and 7 committed tokens (row 1 padded), anchors after them."""
    ids = torch.randint(3, 2000, (2, 12), generator=torch.Generator().manual_seed(0))
    feats = target_forward(target, ids).features
    lens = torch.tensor([11, 7])
    valid = torch.arange(11)[None] < lens[:, None]
    anchor = ids[torch.arange(2), lens]
    return ids[:, :11], feats[:, :11], torch.arange(11).expand(2, 11), valid, anchor, lens


def drafter(method, cfg, target, **kw):
    d = new_drafter(method, cfg, target, **kw)
    if d.head is not None:  # a fresh head is the identity; make it act
        randomize_(d.head, 3.0, torch.Generator().manual_seed(1))
    return d


def propose(d, context, temperature=0.0, seed=0, rows=slice(None)):
    tokens, feats, pos, valid, anchor, lens = context
    d.reset([[0]] * tokens[rows].shape[0])
    d.extend(tokens[rows], feats[rows], pos[rows], valid[rows])
    return d.propose(anchor[rows], lens[rows], temperature, torch.Generator().manual_seed(seed))


def test_the_cli_names_the_methods_the_proposer_builds():
    """methods.MODEL_METHODS is a literal (the command line must not import torch); it must name exactly
    what the proposer builds, in the same order."""
    assert MODEL_METHODS == METHODS


@pytest.mark.parametrize("method", MODEL_METHODS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_propose_shapes_and_distributions(method, temperature, cfg, target, context):
    d = drafter(method, cfg, target)
    assert isinstance(d, Drafter) and d.block_size == cfg.drafter.block_size
    out = propose(d, context, temperature)
    b, p = 2, cfg.drafter.block_size - 1
    assert out.tokens.shape == (b, p) and out.tokens.dtype == torch.int64
    assert d.vocab.contains(out.tokens).all()  # target ids inside the draft vocabulary
    assert set(out.timings) == {"draft", "refine"} and out.stats["iters"].shape == (b,)
    if temperature == 0:
        assert out.q is None
    else:
        assert out.q.shape == (b, p, target.vocab_size) and out.q.dtype == torch.float32
        torch.testing.assert_close(out.q.sum(-1), torch.ones(b, p))
        outside = ~d.vocab.contains(torch.arange(target.vocab_size))
        assert out.q[..., outside].abs().max() == 0
        assert (out.q.gather(-1, out.tokens[..., None]) > 0).all()
    expected_iters = {"dflash": 0, "markov": p}.get(method)
    if expected_iters is not None:
        assert (out.stats["iters"] == expected_iters).all()
    else:
        assert ((out.stats["iters"] >= 1) & (out.stats["iters"] <= cfg.head.max_iters)).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_xpress_jacobi_equals_sequential(temperature, cfg, target, context):
    p = cfg.drafter.block_size - 1
    jac = drafter("xpress", cfg, target)
    jac.max_iters = p
    seq = drafter("xpress", cfg, target, refine="sequential")
    a, b = propose(jac, context, temperature, seed=3), propose(seq, context, temperature, seed=3)
    assert torch.equal(a.tokens, b.tokens)
    if temperature:
        torch.testing.assert_close(a.q, b.q)


@pytest.mark.parametrize("method", MODEL_METHODS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fewer_draft_tokens_are_the_full_drafts_first_ones(method, temperature, cfg, target, context):
    """decode.draft_tokens = k: the first k tokens and q rows of the full draft, whatever the head (both are
    causal, so k sequential steps or k Jacobi passes settle them), and no more refinement than k steps. Only
    the k positions are computed (their readout a k-row product, not a (B-1)-row one), so q agrees to float32
    rounding; each token is drawn from the q returned with it, which is what lossless sampling needs."""
    full = drafter(method, cfg, target)
    whole = propose(full, context, temperature, seed=5)
    for k in (1, 2):
        short = dataclasses.replace(cfg, decode=dataclasses.replace(cfg.decode, draft_tokens=k))
        d = drafter(method, short, target)
        assert d.draft_tokens == k
        out = propose(d, context, temperature, seed=5)
        assert torch.equal(out.tokens, whole.tokens[:, :k])
        if temperature:
            torch.testing.assert_close(out.q, whole.q[:, :k], rtol=1e-5, atol=1e-7)
        assert (out.stats["iters"] <= k).all()


def test_draft_tokens_out_of_range_is_refused(cfg, target):
    from xpress.config import ConfigError, load_config

    d = new_drafter("dflash", cfg, target)
    with pytest.raises(ValueError, match="draft_tokens"):
        ModelDrafter(d.drafter, None, d.vocab, "dflash", 1, draft_tokens=cfg.drafter.block_size)
    with pytest.raises(ConfigError, match="decode.draft_tokens"):
        load_config(cfg.preset, [f"decode.draft_tokens={cfg.drafter.block_size}"])


def test_ragged_batch_rows_equal_each_row_alone(cfg, target, context):
    d = drafter("xpress", cfg, target)
    batch = propose(d, context)
    for i in range(2):
        alone = propose(d, context, rows=slice(i, i + 1))
        assert torch.equal(batch.tokens[i:i + 1], alone.tokens)


def test_dflash_greedy_is_base_argmax(cfg, target, context):
    d = drafter("dflash", cfg, target)
    out = propose(d, context)
    tokens, feats, pos, valid, anchor, lens = context
    ctx = d.drafter.encode_context(feats, pos, valid)
    with torch.no_grad():
        h = d.drafter(anchor[:, None], lens[:, None], ctx)[:, 0, 1:]
    assert torch.equal(out.tokens, d.vocab.to_target(d.drafter.base_logits(h, d.vocab).argmax(-1)))


@pytest.mark.parametrize("method", MODEL_METHODS)
def test_save_and_build_roundtrip(method, cfg, target, context, tmp_path):
    d = drafter(method, cfg, target)
    save_drafter(tmp_path / method, d.drafter, d.head, d.vocab, method)
    names = {p.name for p in (tmp_path / method).iterdir()}
    assert {"config.json", "model.safetensors", "draft_vocab.safetensors"} <= names
    assert ({"head.json", "head.safetensors"} <= names) == (method != "dflash")
    loaded = build_drafter(method, cfg, target, checkpoint=tmp_path / method)
    assert isinstance(loaded, ModelDrafter) and loaded.vocab == d.vocab
    assert drafter_weights(loaded) == "trained" and drafter_weights(d) == "untrained"
    for t in (0.0, 1.0):
        a, b = propose(d, context, t, seed=4), propose(loaded, context, t, seed=4)
        assert torch.equal(a.tokens, b.tokens)


def test_missing_checkpoint_says_how_to_get_one(cfg, target, tmp_path, monkeypatch):
    monkeypatch.setattr(xpress.paths, "CHECKPOINTS", tmp_path / "checkpoints")
    with pytest.raises(CheckpointNotFoundError) as e:
        build_drafter("xpress", cfg, target)
    msg = str(e.value)
    assert str(tmp_path / "checkpoints" / "smoke" / "xpress") in msg
    assert "python -m xpress train --preset smoke --method xpress" in msg
    assert "python -m xpress regenerate --preset smoke" in msg and "--checkpoint" in msg
    with pytest.raises(CheckpointNotFoundError, match="drafter.checkpoint"):
        build_drafter("dflash", cfg, target)
    assert isinstance(CheckpointNotFoundError("x"), FileNotFoundError)


def test_dflash_from_released_layout(cfg, target, tmp_path, monkeypatch):
    """cfg.drafter.checkpoint: a folder with only config.json + model.safetensors (full vocabulary)."""
    monkeypatch.setattr(xpress.paths, "CHECKPOINTS", tmp_path / "checkpoints")
    d = drafter("dflash", cfg, target)
    d.drafter.save_pretrained(tmp_path / "released")
    released = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, checkpoint=str(tmp_path / "released")))
    loaded = build_drafter("dflash", released, target)
    assert loaded.vocab.size == target.vocab_size and loaded.head is None
    with pytest.raises(CheckpointNotFoundError, match="no markov head"):
        build_drafter("markov", cfg, target, checkpoint=tmp_path / "released")


def test_mismatched_target_is_refused_on_load(cfg, target, tmp_path):
    d = drafter("xpress", cfg, target)
    save_drafter(tmp_path / "x", d.drafter, d.head, d.vocab, "xpress")
    other = dataclasses.replace(target, num_layers=12)
    with pytest.raises(DrafterMismatchError, match="drafter built for 6, target has 12"):
        build_drafter("xpress", cfg, other, checkpoint=tmp_path / "x")


def test_unknown_method(cfg, target):
    with pytest.raises(ValueError, match="dflash, markov, xpress"):
        new_drafter("gru", cfg, target)


def test_checkpoint_of_another_block_size_is_refused(cfg, target, tmp_path, monkeypatch):
    monkeypatch.setattr(xpress.paths, "CHECKPOINTS", tmp_path / "checkpoints")
    d = drafter("markov", cfg, target)
    save_drafter(tmp_path / "m", d.drafter, d.head, d.vocab, "markov")
    B = cfg.drafter.block_size
    other = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, block_size=B + 2))
    with pytest.raises(DrafterMismatchError) as e:
        build_drafter("markov", other, target, checkpoint=tmp_path / "m")
    msg = str(e.value)
    assert f"block_size={B}" in msg and f"drafter.block_size={B + 2}" in msg and f"drafter.block_size={B}" in msg
    released = dataclasses.replace(other, drafter=dataclasses.replace(other.drafter, checkpoint=str(tmp_path / "m")))
    with pytest.raises(DrafterMismatchError, match=f"block_size={B}"):
        build_drafter("dflash", released, target, checkpoint=None)


def test_make_drafter_falls_back_to_fresh_weights_only_when_asked(cfg, target, tmp_path, monkeypatch):
    monkeypatch.setattr(xpress.paths, "CHECKPOINTS", tmp_path / "checkpoints")
    assert make_drafter("ar", cfg, target) is None
    for method in ("oracle", "random"):
        assert drafter_weights(make_drafter(method, cfg, target)) == "reference"
    with pytest.raises(CheckpointNotFoundError, match="python -m xpress train"):
        make_drafter("xpress", cfg, target)
    fresh = make_drafter("xpress", cfg, target, seed=3, untrained_ok=True)
    assert isinstance(fresh, ModelDrafter) and drafter_weights(fresh) == "untrained"
    same = new_drafter("xpress", cfg, target, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(fresh.drafter.state_dict().values(), same.drafter.state_dict().values()))
    d = drafter("xpress", cfg, target)
    save_drafter(tmp_path / "checkpoints" / cfg.preset / "xpress", d.drafter, d.head, d.vocab, "xpress")
    assert drafter_weights(make_drafter("xpress", cfg, target, untrained_ok=True)) == "trained"
    with pytest.raises(ValueError, match="ar, oracle, random"):
        make_drafter("gru", cfg, target)


def test_checkpoint_fingerprint_names_the_weights_and_only_the_weights(cfg, target, tmp_path):
    """Two folders of the same weights share a fingerprint whatever else differs; one changed element of the
    head (or of the drafter) changes it; a loaded drafter carries its folder's."""
    from xpress.proposer import checkpoint_fingerprint, load_drafter

    d = drafter("xpress", cfg, target)
    a = save_drafter(tmp_path / "a", d.drafter, d.head, d.vocab, "xpress")
    b = save_drafter(tmp_path / "b", d.drafter, d.head, d.vocab, "xpress")
    (b / "trainer_state.pt").write_bytes(b"anything")
    (b / "config.json").write_text((b / "config.json").read_text().replace("{", '{"note": "other", ', 1))
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)
    assert len(checkpoint_fingerprint(a)) == 16
    with torch.no_grad():
        next(d.head.parameters()).view(-1)[0] += 1.0
    c = save_drafter(tmp_path / "c", d.drafter, d.head, d.vocab, "xpress")
    assert checkpoint_fingerprint(c) != checkpoint_fingerprint(a)
    with torch.no_grad():
        next(d.head.parameters()).view(-1)[0] -= 1.0
        d.drafter.fc.weight.view(-1)[0] += 1.0
    e = save_drafter(tmp_path / "e", d.drafter, d.head, d.vocab, "xpress")
    assert len({checkpoint_fingerprint(x) for x in (a, c, e)}) == 3
    assert load_drafter(a, "xpress", cfg, target).fingerprint == checkpoint_fingerprint(a)
    assert new_drafter("xpress", cfg, target).fingerprint is None
