import dataclasses
import json

import pytest
import torch
from torch import nn

from xpress import DFlashDraftModel, DraftVocab
from xpress.config import load_config
from xpress.drafter import (CheckpointNotFoundError, DFlashConfig, DrafterMismatchError, RopeTable, apply_rope,
                            block_attention_mask, rope)

V, H = 100, 32


def small(mask_token_id=None, **kw) -> DFlashDraftModel:
    """A tiny drafter attached to a random 'target' embedding and lm_head."""
    torch.manual_seed(0)
    c = DFlashConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     num_hidden_layers=2, num_target_layers=6, target_layer_ids=[1, 3], vocab_size=V, block_size=4,
                     mask_token_id=mask_token_id, rope_theta=10000.0, **kw)
    model = DFlashDraftModel(c).eval()
    return model.attach(nn.Embedding(V, H), nn.Linear(H, V, bias=False))


def features(b, n, seed=1):
    return torch.randn(b, n, 2 * H, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ layout
def test_qwen3_8b_layout_matches_released_checkpoint():
    """z-lab/Qwen3-8B-DFlash-b16: 58 tensors, names without a `model.` prefix (listed independently)."""
    cfg = DFlashConfig(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, num_hidden_layers=5, num_target_layers=36, target_layer_ids=[1, 9, 17, 25, 33],
                       vocab_size=151936, block_size=16, mask_token_id=151669, rope_theta=1e6)
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    expected = {"fc.weight": (4096, 5 * 4096), "hidden_norm.weight": (4096,), "norm.weight": (4096,)}
    for i in range(5):
        p = f"layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (32 * 128, 4096), p + "self_attn.k_proj.weight": (8 * 128, 4096),
            p + "self_attn.v_proj.weight": (8 * 128, 4096), p + "self_attn.o_proj.weight": (4096, 32 * 128),
            p + "self_attn.q_norm.weight": (128,), p + "self_attn.k_norm.weight": (128,),
            p + "mlp.gate_proj.weight": (12288, 4096), p + "mlp.up_proj.weight": (12288, 4096),
            p + "mlp.down_proj.weight": (4096, 12288),
            p + "input_layernorm.weight": (4096,), p + "post_attention_layernorm.weight": (4096,)})
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert len(expected) == 58
    assert got == expected
    n = sum(p.numel() for p in model.parameters())
    assert 1.0e9 < n < 1.1e9  # "about 1.1B parameters"
    j = cfg.to_json()
    assert j["architectures"] == ["DFlashDraftModel"] and j["model_type"] == "qwen3" and j["block_size"] == 16
    assert j["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert DFlashConfig.from_json(json.loads(json.dumps(j))) == cfg


def test_config_reads_rope_parameters_and_defaults():
    j = small().config.to_json()
    del j["rope_theta"]
    j["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    c = DFlashConfig.from_json(j)
    assert c.rope_theta == 5e5 and c.mask_token_id is None


def test_learned_mask_embedding_is_saved_only_without_mask_id():
    assert "mask_embedding" in small(mask_token_id=None).state_dict()
    assert "mask_embedding" not in small(mask_token_id=V - 1).state_dict()


# ------------------------------------------------------------------------------------------ forward
def run_cached(model, feats, pos, valid, anchor, anchor_pos, chunks):
    """Feed the context in chunks, then one block per row."""
    ctx = model.empty_context(feats.shape[0])
    for a, b in chunks:
        ctx = ctx.append(model.encode_context(feats[:, a:b], pos[:, a:b], valid[:, a:b]))
    return model(anchor[:, None], anchor_pos[:, None], ctx)[:, 0]


@pytest.mark.parametrize("mask_token_id", [None, 7])
def test_cached_ragged_equals_masked_full_forward(mask_token_id):
    model = small(mask_token_id)
    b, L = 2, 10
    feats, pos = features(b, L), torch.arange(L).expand(b, L)
    anchor, anchor_pos = torch.tensor([5, 9]), torch.tensor([L, L])
    with torch.no_grad():
        full = model(anchor[:, None], anchor_pos[:, None], model.encode_context(feats, pos))[:, 0]
        # the same context with padding holes (garbage features and positions) between chunks
        holes = 3
        f2 = torch.cat([feats[:, :4], torch.randn(b, holes, 2 * H) * 100, feats[:, 4:]], 1)
        p2 = torch.cat([pos[:, :4], torch.full((b, holes), 99), pos[:, 4:]], 1)
        v2 = torch.ones(b, L + holes, dtype=torch.bool)
        v2[:, 4:4 + holes] = False
        cached = run_cached(model, f2, p2, v2, anchor, anchor_pos, [(0, 2), (2, 6), (6, L + holes)])
    assert full.shape == (b, 4, H)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_ragged_rows_equal_each_row_alone():
    model = small()
    lens = [7, 4]
    L = max(lens)
    feats = features(2, L)
    pos = torch.arange(L).expand(2, L)
    valid = torch.arange(L)[None] < torch.tensor(lens)[:, None]  # row 1 padded at the end
    anchor, anchor_pos = torch.tensor([3, 8]), torch.tensor(lens)
    with torch.no_grad():
        batch = run_cached(model, feats, pos, valid, anchor, anchor_pos, [(0, 3), (3, L)])
        for i, n in enumerate(lens):
            alone = run_cached(model, feats[i:i + 1, :n], pos[i:i + 1, :n], valid[i:i + 1, :n], anchor[i:i + 1],
                               anchor_pos[i:i + 1], [(0, n)])
            torch.testing.assert_close(batch[i:i + 1], alone, atol=1e-5, rtol=1e-5)


def test_many_blocks_in_one_forward_equal_each_block_alone():
    """Training: nb anchor blocks per sequence, each sees the context strictly before its anchor."""
    model = small()
    L = 12
    feats, pos = features(1, L), torch.arange(L)[None]
    anchor_pos = torch.tensor([[3, 6, 10]])
    anchor = torch.tensor([[11, 22, 33]])
    with torch.no_grad():
        many = model(anchor, anchor_pos, model.encode_context(feats, pos))
        assert many.shape == (1, 3, 4, H)
        for a in range(3):
            n = int(anchor_pos[0, a])
            alone = model(anchor[:, a:a + 1], anchor_pos[:, a:a + 1], model.encode_context(feats[:, :n], pos[:, :n]))
            torch.testing.assert_close(many[:, a], alone[:, 0], atol=1e-5, rtol=1e-5)


def test_rope_table_rows_are_rope_and_the_rotation_is_rotate_half_bit_for_bit():
    """The kept table gives rope()'s entries at any positions (grown past its first size; cos and sin are
    vectorised differently in a long table than in a short one, so to float32 rounding), and apply_rope with
    the signed sin table is the textbook rotate-half x * cos + cat(-x2, x1) * sin, bit for bit."""
    d, theta = 8, 10000.0
    table = RopeTable(d, theta)
    for pos in (torch.tensor([[0, 5, 1023]]), torch.tensor([[3000, 7], [1, 2]])):  # the second grows the table
        cos, sin = table(pos, torch.float32)
        ref_cos, ref_sin = rope(pos, d, theta, torch.float32)
        assert cos.shape == sin.shape == (pos.shape[0], 1, pos.shape[1], d)
        torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)
    assert table._cos.shape[0] >= 3001
    x = torch.randn(2, 3, 2, d)
    half = sin[..., d // 2:]  # sin of the angles; the first half of the table holds their negatives
    assert torch.equal(sin[..., :d // 2], -half)
    x1, x2 = x.chunk(2, dim=-1)
    textbook = x * cos + torch.cat([-x2, x1], dim=-1) * torch.cat([half, half], dim=-1)
    assert torch.equal(apply_rope(x, cos, sin), textbook)


def test_a_block_after_a_whole_context_skips_the_mask_and_keeps_its_states(monkeypatch):
    """Inference's case (one block per row, every context entry real and before the anchor) runs without a
    mask; the states equal those of the masked forward (the same context marked as not known to be dense)."""
    import xpress.drafter as drafter_module

    model = small()
    feats, pos = features(2, 9), torch.arange(9).expand(2, 9)
    anchor, anchor_pos = torch.tensor([[5], [7]]), torch.tensor([[9], [9]])
    calls = []
    monkeypatch.setattr(drafter_module, "block_attention_mask", lambda *a: calls.append(1) or block_attention_mask(*a))
    with torch.no_grad():
        ctx = model.encode_context(feats, pos)
        assert ctx.dense and ctx.end == 9
        fast, slow = model(anchor, anchor_pos, ctx), model(anchor, anchor_pos, dataclasses.replace(ctx, dense=False))
        assert len(calls) == 1  # only the context not known to be dense built one
        model(anchor, anchor_pos - 1, ctx)  # an anchor inside the context: masked
        assert len(calls) == 2
        valid = torch.ones(2, 9, dtype=torch.bool)
        valid[1, 4] = False
        holes = model.encode_context(feats, pos, valid)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-6)
    assert not holes.dense and not ctx.append(holes).dense and ctx.append(ctx).dense and ctx.append(ctx).end == 9


def test_block_attention_mask_pattern():
    m = block_attention_mask(torch.arange(4)[None], torch.tensor([[True, True, False, True]]),
                             torch.tensor([[2, 4]]), block_size=2)
    assert m.shape == (1, 1, 4, 4 + 4)
    expected = torch.tensor([
        [1, 1, 0, 0, 1, 1, 0, 0],  # block of anchor 2: context before 2, its own block
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 1, 0, 0, 1, 1],  # block of anchor 4: valid context before 4 (hole at 2)
        [1, 1, 0, 1, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m[0, 0], expected)


def test_base_logits_over_draft_vocab():
    model = small()
    h = torch.randn(2, 3, H)
    vocab = DraftVocab.from_ids([5, 1, 42], V)
    full = model.base_logits(h)
    assert full.shape == (2, 3, V) and full.dtype == torch.float32
    torch.testing.assert_close(model.base_logits(h, vocab), full[..., [5, 1, 42]])


def test_readout_weight_is_kept_until_the_weight_or_vocabulary_changes():
    net = small()
    head = net._io()[1]
    vocab = DraftVocab.from_ids([5, 1, 60], V)
    with torch.no_grad():
        w = net.readout_weight(vocab)
        assert torch.equal(w, head.weight[[5, 1, 60]]) and net.readout_weight(vocab) is w  # gathered once
        head.weight.mul_(3)  # an in-place update of the target's lm_head
        assert torch.equal(net.readout_weight(vocab), head.weight[[5, 1, 60]])
        other = DraftVocab.from_ids([2, 3], V)
        assert torch.equal(net.readout_weight(other), head.weight[[2, 3]])
        assert net.readout_weight(DraftVocab.full(V)) is head.weight


def test_unattached_drafter_says_how_to_fix():
    c = small().config
    with pytest.raises(RuntimeError, match="attach"):
        DFlashDraftModel(c).embed_block(torch.zeros(1, 1, dtype=torch.long))


# ------------------------------------------------------------------------------------------- files
@pytest.mark.parametrize("mask_token_id", [None, 7])
def test_save_and_reload_gives_identical_logits(tmp_path, mask_token_id):
    model = small(mask_token_id)
    with torch.no_grad():
        if mask_token_id is None:
            model.mask_embedding.add_(1.0)
        model.save_pretrained(tmp_path / "ckpt")
        saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
        assert saved["dflash_config"]["mask_token_id"] == mask_token_id
        embed, lm_head = model._io()
        again = DFlashDraftModel.from_pretrained(tmp_path / "ckpt").attach(embed, lm_head)
        ctx_a = model.encode_context(features(1, 6), torch.arange(6)[None])
        ctx_b = again.encode_context(features(1, 6), torch.arange(6)[None])
        a = model.base_logits(model(torch.tensor([[3]]), torch.tensor([[6]]), ctx_a))
        b = again.base_logits(again(torch.tensor([[3]]), torch.tensor([[6]]), ctx_b))
    assert torch.equal(a, b)
    assert set(again.state_dict()) == set(model.state_dict())


def test_missing_checkpoint_names_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=str(tmp_path / "nothing")):
        DFlashDraftModel.from_pretrained(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="config.json"):
        DFlashDraftModel.from_pretrained(tmp_path / "empty")


# ------------------------------------------------------------------------------------------ target
def test_from_target_shapes_and_match(smoke):
    cfg = load_config("smoke")
    model = DFlashDraftModel.from_target(smoke, cfg)
    c = model.config
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 4, 2, 16)
    assert c.target_layer_ids == smoke.layer_ids and c.block_size == cfg.drafter.block_size
    assert c.mask_token_id is None and "mask_embedding" in model.state_dict()  # SmolLM2: no spare row
    assert model.fc.weight.shape == (64, smoke.feature_size)
    model.check_matches(smoke)
    assert all(not n.startswith(("embed", "lm_head")) for n in model.state_dict())


def test_mismatch_error_names_both_values(smoke):
    model = DFlashDraftModel.from_target(smoke, load_config("smoke"))
    other = dataclasses.replace(smoke, hidden_size=128, layer_ids=[1, 2, 3])
    with pytest.raises(DrafterMismatchError) as e:
        model.check_matches(other)
    msg = str(e.value)
    assert "drafter 64, target 128" in msg and "[1, 3]" in msg and "[1, 2, 3]" in msg
    assert "num_target_features" in msg


def test_from_pretrained_checks_target(tmp_path, smoke):
    model = DFlashDraftModel.from_target(smoke, load_config("smoke"))
    model.save_pretrained(tmp_path / "d")
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "d", target=smoke)
    assert loaded._io()[0] is smoke.embed_tokens()
    with pytest.raises(DrafterMismatchError):
        DFlashDraftModel.from_pretrained(tmp_path / "d", target=dataclasses.replace(smoke, vocab_size=10))
