"""Co-training (:mod:`xpress.train`) on the smoke preset: the block mask, training = inference for the
drafter and the refiner, the loss on hand-computed cases, exact resume, a falling loss, clear CLI errors
and two DDP processes that stay identical."""
from __future__ import annotations

import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import xpress.drafter
import xpress.targets
from xpress import kernels, paths
from xpress.__main__ import main
from xpress.config import load_config
from xpress.drafter import block_attention_mask
from xpress.heads import randomize_
from xpress.proposer import load_drafter, new_drafter
from xpress.targets import target_forward
from xpress.train.losses import (anchor_weight, distribution_loss, position_weights, target_distribution,
                                 teacher_forced_acceptance)
from xpress.train.loop import (CoTrainer, TrainingError, build_vocab, compute_loss, make_batch, stage_signature,
                               step_generator, step_rows, teacher_forced_val, train, training_rows)
from xpress.train.regenerate import RegenData, RegenerationError, regenerate

DATA = ["data.n_train_prompts=8", "data.n_val_prompts=2", "data.regen_max_new_tokens=16", "data.regen_shard_size=4"]
# every training knob the tests rely on, so that edits of configs/smoke.yaml do not change them
TRAIN = ["train.steps=4", "train.warm_start_steps=0", "train.batch_size=2", "train.max_len=128",
         "train.anchors_per_seq=4", "train.log_every=1", "train.checkpoint_every=1000", "train.eval_every=0",
         "train.eval_prompts=0"]


def small(*extra: str):
    return load_config("smoke", [*DATA, *TRAIN, *extra])


def _env(root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "XPRESS_DATA": str(root / "data"), "XPRESS_CHECKPOINTS": str(root / "checkpoints"),
            "XPRESS_RESULTS": str(root / "results"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            **extra}


@pytest.fixture(scope="module")
def root(tmp_path_factory, target):
    """Regenerated smoke data under a temporary ``data/``; paths.DATA/CHECKPOINTS/RESULTS point there, and
    load_target returns the session's target (the same model: no reload per training run)."""
    base = tmp_path_factory.mktemp("train")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "DATA", base / "data")
        mp.setattr(paths, "CHECKPOINTS", base / "checkpoints")
        mp.setattr(paths, "RESULTS", base / "results")
        mp.setattr(xpress.targets, "load_target", lambda cfg: target)
        regenerate(small(), target, progress=False)
        yield base


@pytest.fixture(scope="module")
def data(root):
    return RegenData.load(small())


def _where(monkeypatch, root: Path, name: str) -> Path:
    """Give this run its own checkpoints/ and results/ (the data stay shared)."""
    monkeypatch.setattr(paths, "CHECKPOINTS", root / name / "checkpoints")
    monkeypatch.setattr(paths, "RESULTS", root / name / "results")
    return root / name / "checkpoints" / "smoke"


# ---------------------------------------------------------------------------------------------- mask
def test_block_attention_kernel_is_sdpa_over_the_mask_and_its_gradient():
    """The C++ attention over training blocks (BlockLayout) against scaled_dot_product_attention over
    block_attention_mask: outputs and every gradient, with ragged sequences, a padded anchor, GQA."""
    import torch.nn.functional as F

    from xpress.drafter import BlockLayout, ContextCache, _BlockAttention

    mod = kernels.for_training("auto", "cpu")
    if mod is None:
        pytest.skip(f"the fused kernels do not build here ({kernels.status().get('reason')})")
    g = torch.Generator().manual_seed(0)
    b, nh, kvh, d, B, nb, L = 2, 6, 2, 16, 3, 4, 11
    lengths = torch.tensor([11, 7])
    positions = torch.arange(L).expand(b, L).clone()
    valid = positions < lengths[:, None]
    anchor_pos = torch.tensor([[0, 3, 5, 10], [0, 0, 2, 6]])  # row 1: a padded anchor at 0 first; 10 and 6 past the ends
    context = ContextCache([], [], positions, valid, bool(valid.all()), L)
    layout = BlockLayout.of(context, anchor_pos, B, mod)
    assert layout.lim.tolist() == [[0, 3, 5, 10], [0, 0, 2, 6]]
    assert BlockLayout.of(ContextCache([], [], positions.flip(1), valid, False, L), anchor_pos, B, mod) is None
    shapes = [(b, nh, nb * B, d), (b, kvh, L, d), (b, kvh, L, d), (b, kvh, nb * B, d), (b, kvh, nb * B, d)]
    inputs = [torch.randn(s, generator=g) for s in shapes]
    d_out = torch.randn(b, nh, nb * B, d, generator=g)
    mask = block_attention_mask(positions, valid, anchor_pos, B)
    results = []
    for fused in (False, True):
        q, ck, cv, k, v = (t.clone().requires_grad_() for t in inputs)
        if fused:
            o = _BlockAttention.apply(q, ck, cv, k, v, layout.lim, B, mod)
        else:
            o = F.scaled_dot_product_attention(q, torch.cat([ck, k], 2), torch.cat([cv, v], 2), attn_mask=mask,
                                               enable_gqa=True)
        (o * d_out).sum().backward()
        results.append([o.detach()] + [t.grad for t in (q, ck, cv, k, v)])
    for name, ref, got in zip(("out", "q", "ctx_k", "ctx_v", "k", "v"), *results):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5, msg=name)
    assert float(results[1][2][1, :, 7:].abs().max()) == 0.0  # the padding past sequence 1's end gets nothing


def test_block_attention_mask():
    B = 3
    # row 0: a plain context 0..5; row 1: ragged, two left-padding holes (valid False) then positions 0..3
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])
    valid = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    anchors = torch.tensor([[0, 3, 5], [0, 2, 4]])
    m = block_attention_mask(positions, valid, anchors, B)
    b, nb, L = 2, 3, 6
    assert m.shape == (b, 1, nb * B, L + nb * B) and m.dtype == torch.bool
    for r in range(b):
        for j in range(nb):
            a = int(anchors[r, j])
            for t in range(B):
                row = m[r, 0, j * B + t]
                for c in range(L):  # the context: valid and strictly before the anchor
                    want = bool(valid[r, c]) and int(positions[r, c]) < a
                    assert bool(row[c]) == want, (r, j, t, c)
                for j2 in range(nb):  # the blocks: its own entirely, no other block
                    assert row[L + j2 * B:L + (j2 + 1) * B].tolist() == [j2 == j] * B, (r, j, t, j2)
    # named cases: anchor 0 sees no context; the hole entries are never seen (row 1, anchor 4 sees 0..3)
    assert not m[0, 0, :B, :L].any()
    assert m[1, 0, 2 * B, :L].tolist() == [False, False, True, True, True, True]
    assert m[0, 0, B, :L].tolist() == [True, True, True, False, False, False]


# --------------------------------------------------------------------------- training = inference
def _float32_data(data: RegenData, target, rows: list[int]):
    """``data`` with the stored (fp16) features of ``rows`` replaced by float32 target_forward ones, so
    that training and inference can be compared at float32 precision."""
    full = {}
    for i in rows:
        with torch.no_grad():
            full[i] = target_forward(target, torch.tensor(data.input_ids[i])[None]).features[0].float().numpy()

    def states(i):
        return {**data.states(i), "features": full[i]}

    return types.SimpleNamespace(input_ids=data.input_ids, prompt_len=data.prompt_len, states=states,
                                 has_states=True, folder=data.folder)


def _inference(md, target, ids: list[int], prompt_len: int, a: int, P: int, anchor_pos: int | None = None):
    """The decoding path for a block anchored at ``a``: the context features of positions < a, extended
    as decoding does (a ragged-padding hole, the prompt, then the committed response tokens), one block
    forward, the base readout and the folded refiner fed the target ids x_a .. x_{a+P-1}."""
    T = len(ids)
    md.reset([ids[:prompt_len]])
    with torch.no_grad():
        feats = target_forward(target, torch.tensor(ids[:a])[None]).features.float()  # [1, a, F]
    hole = torch.randn(1, 1, feats.shape[-1], generator=torch.Generator().manual_seed(0)) * 3
    md.extend(torch.zeros(1, 1, dtype=torch.long), hole, torch.zeros(1, 1, dtype=torch.long),
              torch.zeros(1, 1, dtype=torch.bool))
    for lo, hi in [(0, min(prompt_len, a)), (min(prompt_len, a), a)]:
        if hi > lo:
            md.extend(torch.tensor(ids[lo:hi])[None], feats[:, lo:hi], torch.arange(lo, hi)[None],
                      torch.ones(1, hi - lo, dtype=torch.bool))
    pos = a if anchor_pos is None else anchor_pos
    with torch.no_grad():
        h = md.drafter(torch.tensor([[ids[a]]]), torch.tensor([[pos]]), md.context)[:, 0, 1:]  # [1, P, H]
        base = md.drafter.base_logits(h, md.vocab)
        prev = torch.tensor([[ids[min(a + k, T - 1)] for k in range(P)]])  # past the end: any token
        refined = base + md.head.fold(h)(prev)
    return h[0], base[0], refined[0]


def test_training_forward_equals_inference(data, target, monkeypatch):
    cfg = small()
    P = cfg.drafter.block_size - 1
    vocab, _ = build_vocab(cfg, target, data)
    md = new_drafter("xpress", cfg, target, vocab, seed=3)
    randomize_(md.head, generator=torch.Generator().manual_seed(4))  # a fresh head is delta = 0
    rows = [1, 2]  # two sequences of different lengths: the shorter is padded in the batch
    lens = [len(data.input_ids[i]) for i in rows]
    assert lens[0] != lens[1]
    anchors = []
    for i in rows:
        p, T = data.prompt_len[i], len(data.input_ids[i])
        anchors.append([p - 1, p + 2, (p + T) // 2, T - 3])  # the first drafts from the prompt; the last overhangs
    f32 = _float32_data(data, target, rows)
    batch = make_batch(f32, rows, cfg, step_generator(0, 0, 0), anchors=anchors)
    trainer = CoTrainer(md.drafter, md.head, vocab)
    with torch.no_grad():
        out = trainer(batch)
    assert (out["refined"] - out["base"]).abs().max() > 0.1, "the head must act (delta != 0)"

    # the batch's labels and target states line up with the sequence
    for r, i in enumerate(rows):
        ids, T = data.input_ids[i], len(data.input_ids[i])
        for j, a in enumerate(anchors[r]):
            assert int(batch.anchor_ids[r, j]) == ids[a] and int(batch.anchor_pos[r, j]) == a
            for k in range(P):
                ok = a + k + 1 < T
                assert bool(batch.label_valid[r, j, k]) == ok
                if ok:
                    assert int(batch.labels[r, j, k]) == ids[a + k + 1]
    readout = target.lm_head().weight[vocab.d2t]
    p_t = target_distribution(batch.t_hidden, batch.t_lse, readout)  # [b, nb, P, Vd]
    in_vocab = vocab.to_draft(batch.labels) >= 0
    check = batch.label_valid & in_vocab
    assert check.sum() > 10
    # the greedy regenerated token is the argmax of the target distribution stored before it
    assert (p_t.argmax(-1) == vocab.to_draft(batch.labels))[check].all()

    n = 0
    keys = ("hidden", "base", "refined")
    for r, i in enumerate(rows):
        ids, p = data.input_ids[i], data.prompt_len[i]
        for j, a in enumerate(anchors[r]):
            got = dict(zip(keys, _inference(md, target, ids, p, a, P)))
            # refined position k reads x_a .. x_{a+k}: compare where those exist (past the end the batch
            # feeds padding, the decoding path nothing; neither is scored)
            scored = batch.label_valid[r, j]
            assert scored[0]
            for k in keys:
                got_k, want_k = (got[k], out[k][n]) if k != "refined" else (got[k][scored], out[k][n][scored])
                torch.testing.assert_close(want_k, got_k, atol=1e-4, rtol=1e-4, msg=f"{k}, row {i}, anchor {a}")
            n += 1

    # negative controls: an anchor position off by one, or a mask that lets the anchor's own context
    # entry in, changes the states by far more than the tolerance above
    i, a = rows[0], anchors[0][1]
    h_shift, _, _ = _inference(md, target, data.input_ids[i], data.prompt_len[i], a, P, anchor_pos=a + 1)
    assert (h_shift - out["hidden"][1]).abs().max() > 1e-2
    leaky_mask = xpress.drafter.block_attention_mask

    def leaky(ctx_positions, ctx_valid, anchor_pos, block_size):
        return leaky_mask(ctx_positions, ctx_valid, anchor_pos + 1, block_size)

    monkeypatch.setattr(xpress.drafter, "block_attention_mask", leaky)
    with torch.no_grad():
        out_leaky = trainer(batch)
    monkeypatch.undo()
    assert min(float((out_leaky["hidden"][m] - out["hidden"][m]).abs().max()) for m in range(n)) > 1e-2

    # the real batch (fp16-stored features, captured during regeneration) agrees to fp16 precision
    with torch.no_grad():
        out16 = trainer(make_batch(data, rows, cfg, step_generator(0, 0, 0), anchors=anchors))
    for k in keys:
        torch.testing.assert_close(out16[k], out[k], atol=3e-3, rtol=1e-3)
    # and so do states computed online by the target (data without a cache; a right-padded batch)
    if "target" in inspect.signature(make_batch).parameters:
        bare = types.SimpleNamespace(input_ids=data.input_ids, prompt_len=data.prompt_len, has_states=False,
                                     folder=data.folder)
        online = make_batch(bare, rows, cfg, step_generator(0, 0, 0), anchors=anchors, target=target)
        for r, T in enumerate(lens):
            torch.testing.assert_close(online.features[r, :T], batch.features[r, :T], atol=1e-4, rtol=1e-4)
        scored = batch.label_valid  # (past the end of a sequence the cache holds zeros, online states padding)
        torch.testing.assert_close(online.t_hidden[scored], batch.t_hidden[scored], atol=5e-3, rtol=2e-3)  # fp16
        torch.testing.assert_close(online.t_lse[scored], batch.t_lse[scored], atol=1e-4, rtol=1e-5)
        for name in ("labels", "label_valid", "anchor_ids", "anchor_pos", "valid", "positions"):
            assert torch.equal(getattr(online, name), getattr(batch, name)), name


# ---------------------------------------------------------------------------------------------- loss
def test_distribution_loss_by_hand():
    logits = [[[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]], [[2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]]  # [n=2, P=2, Vd=3]
    labels = [[2, -1], [0, 1]]  # -1: the regenerated token lies outside the draft vocabulary
    p_target = [[[0.1, 0.2, 0.6], [0.3, 0.3, 0.3]], [[0.5, 0.25, 0.25], [0.0, 0.5, 0.2]]]  # mass outside: .1 .1 0 .3
    valid = [[True, True], [True, False]]
    gamma, ce_w, tv_w = 2.0, 0.1, 0.9
    w = [math.exp(-k / gamma) for k in range(2)]

    def softmax(xs):
        z = sum(math.exp(x) for x in xs)
        return [math.exp(x) / z for x in xs]

    num = den = ce_num = ce_den = l1_num = 0.0
    for b in range(2):
        for k in range(2):
            if not valid[b][k]:
                continue
            p = softmax(logits[b][k])
            ce = -math.log(p[labels[b][k]]) if labels[b][k] >= 0 else 0.0
            l1 = sum(abs(x - y) for x, y in zip(p, p_target[b][k])) + (1 - sum(p_target[b][k]))
            num += w[k] * (ce_w * ce + tv_w * l1)
            den += w[k]
            l1_num += w[k] * l1
            if labels[b][k] >= 0:
                ce_num += w[k] * ce
                ce_den += w[k]
    weights = position_weights(2, gamma)
    got = distribution_loss(torch.tensor(logits), torch.tensor(labels), torch.tensor(p_target),
                            torch.tensor(valid), weights, ce_w, tv_w)
    assert got["loss"].item() == pytest.approx(num / den, rel=1e-6)
    assert got["ce"].item() == pytest.approx(ce_num / ce_den, rel=1e-6)
    assert got["l1"].item() == pytest.approx(l1_num / den, rel=1e-6)
    # the L1 term is 2 (1 - acceptance): a perfect drafter of a target with mass outside pays twice that mass
    pt = torch.tensor([[[0.2, 0.3, 0.4]]])
    perfect = distribution_loss(torch.log(pt / pt.sum()), torch.tensor([[1]]), pt, torch.tensor([[True]]),
                                torch.ones(1), 0.0, 1.0)
    assert perfect["l1"].item() == pytest.approx(2 * 0.1, rel=1e-5)


def _loss_case(n: int, P: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, P, V, generator=g)).to(dtype)
    labels = torch.randint(-1, V, (n, P), generator=g)
    p_target = torch.softmax(2 * torch.randn(n, P, V, generator=g), -1) * 0.97  # 3% of the mass outside
    p_target[0, 0] = 0.0
    p_target[0, 0, 3] = 1.0  # a target sure of one token
    return logits, labels, p_target, torch.rand(n, P, generator=g) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_kernel_is_the_pytorch_loss_and_its_gradient(dtype):
    from xpress.train.losses import row_terms

    mod = kernels.for_training("auto", "cpu")
    if mod is None:
        pytest.skip(f"the fused kernels do not build here ({kernels.status().get('reason')})")
    assert kernels.for_training("torch", "cpu") is None and kernels.for_training_name("torch", "cpu") == "torch"
    assert kernels.for_training_name("auto", "cpu") == "fused" and kernels.for_training("auto", "meta") is None
    logits, labels, p_target, valid = _loss_case(24, 7, 520, dtype)
    w = position_weights(7, 7.0)
    got = {}
    for name, kernel in (("torch", None), ("fused", mod)):
        z = logits.clone().requires_grad_()
        out = distribution_loss(z, labels, p_target, valid, w, 0.1, 0.9, kernel)
        out["loss"].backward()
        got[name] = (out, z.grad.float())
        ce, l1 = row_terms(z, labels, p_target, kernel)
        got[name] += (ce.detach(), l1.detach())
    (ref, ref_grad, ref_ce, ref_l1), (out, grad, ce, l1) = got["torch"], got["fused"]
    for k in ("loss", "ce", "l1"):
        assert out[k].item() == pytest.approx(ref[k].item(), rel=1e-5), k
    torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l1, ref_l1, rtol=1e-5, atol=1e-5)
    assert bool((ce[labels < 0] == 0).all())
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # a bf16 gradient is rounded to bf16
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol * ref_grad.abs().max().item())
    # the gradient of each term alone, with other weights per row (what the backward receives)
    a, b = torch.rand(24, 7), torch.rand(24, 7)
    grads = []
    for kernel in (None, mod):
        z = logits.float().clone().requires_grad_()
        ce, l1 = row_terms(z, labels, p_target, kernel)
        ((a * ce).sum() + (b * l1).sum()).backward()
        grads.append(z.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    # deterministic, and a vocabulary that is not a multiple of 8 takes the PyTorch path
    assert torch.equal(row_terms(logits, labels, p_target, mod)[1], row_terms(logits, labels, p_target, mod)[1])
    z, lab, pt, _ = _loss_case(3, 2, 13, torch.float32)
    torch.testing.assert_close(row_terms(z, lab, pt, mod)[1], row_terms(z, lab, pt, None)[1], rtol=0, atol=0)


def test_kernel_settings_are_checked_and_signed_only_when_they_change_what_ran():
    from xpress.config import ConfigError
    from xpress.train.loop import UNSIGNED_AT

    with pytest.raises(ConfigError, match="train.loss_kernel='cuda': use auto"):
        small("train.loss_kernel=cuda")
    with pytest.raises(ConfigError, match="train.attention_kernel='sdpa': use auto"):
        small("train.attention_kernel=sdpa")
    assert UNSIGNED_AT == {"loss_kernel": "torch", "attention_kernel": "torch"}
    before = stage_signature(small("train.loss_kernel=torch", "train.attention_kernel=torch"), "xpress", "xpress", 4, "warm")
    assert not set(UNSIGNED_AT) & set(before["train"])  # a checkpoint signed before the keys existed continues its stage
    now = stage_signature(small(), "xpress", "xpress", 4, "warm")["train"]
    assert (now["loss_kernel"], now["attention_kernel"]) == ("auto", "auto")


def test_position_and_anchor_weights():
    assert position_weights(3, 2.0).tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0)])
    assert position_weights(1, 7.0).tolist() == [1.0]
    start, end, steps = 0.6, 0.2, 11
    assert anchor_weight(0, steps, start, end) == pytest.approx(start)
    assert anchor_weight(steps - 1, steps, start, end) == pytest.approx(end)
    assert anchor_weight(5, steps, start, end) == pytest.approx(0.4)
    assert anchor_weight(3, steps, start, end) == pytest.approx(start + (end - start) * 3 / 10)
    assert anchor_weight(50, steps, start, end) == pytest.approx(end)  # the floor holds past the end
    ws = [anchor_weight(s, steps, start, end) for s in range(steps)]
    assert all(x > y for x, y in zip(ws, ws[1:]))
    assert anchor_weight(0, 1, start, end) == end


def test_teacher_forced_acceptance_by_hand():
    def one_hot(ids, V=3):
        return torch.nn.functional.one_hot(torch.tensor(ids), V).float()

    logits = one_hot([[1, 2, 0], [0, 0, 0], [2, 2, 2]])  # argmax per block and position
    labels = torch.tensor([[1, 2, 1], [1, 0, 0], [2, 2, 2]])
    valid = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    per_pos, tau = teacher_forced_acceptance(logits, labels, valid)
    # block 0 runs 2 deep, block 1 fails at once (later matches do not count), block 2 runs 2 of its 2 valid
    assert per_pos.tolist() == pytest.approx([2 / 3, 2 / 3, 0.0])
    assert tau == pytest.approx(1 + (2 + 0) / 2)  # over the blocks valid at every position: 0 and 1
    _, none = teacher_forced_acceptance(logits[2:], labels[2:], valid[2:])
    assert math.isnan(none)


# -------------------------------------------------------------------------------------------- resume
def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{name}/{k}": v for name in ("model.safetensors", "head.safetensors")
            if (folder / name).is_file() for k, v in load_file(str(folder / name)).items()}


def _log(root: Path, stage: str) -> list[dict]:
    return json.loads((root / "results" / "smoke" / f"train_{stage}.json").read_text())["log"]


def test_resume_is_exact(root, data, monkeypatch):
    """4 steps at once == a warm start, then 1 co-training step, stop, resume to 4 (bit for bit); the run at
    once keeps a snapshot at co-training step 1 (``train.snapshot_steps``, not signed) equal to the stopped
    run's checkpoint there."""
    cfg = small("train.warm_start_steps=2")
    a = _where(monkeypatch, root, "resume-a")
    full = train(small("train.warm_start_steps=2", "train.snapshot_steps=[1]"), "xpress", progress=False, overwrite=True)
    assert sorted(p.name for p in a.iterdir()) == ["warmstart", "xpress", "xpress-step1"]
    assert full["warmstart"]["complete"] and full["xpress"]["complete"] and full["xpress"]["step"] == 4
    from xpress.runtime import native_bf16
    from xpress.train.loop import resolve_mixed_precision

    # auto trains under bf16 autocast where bf16 is native (this test then checks resume under it), else fp32
    assert full["xpress"]["mixed_precision"] == resolve_mixed_precision("auto") == ("bf16" if native_bf16() else "no")
    # and with the C++ loss and attention where the kernels build (so resume is checked under them too)
    fused = "fused" if kernels.for_training("auto", "cpu") is not None else "torch"
    assert (full["xpress"]["loss_kernel"], full["xpress"]["attention_kernel"]) == (fused, fused)

    b = _where(monkeypatch, root, "resume-b")
    part = train(cfg, "xpress", progress=False, overwrite=True, stop_after=3)
    assert part["warmstart"]["complete"] and part["xpress"]["step"] == 1 and not part["xpress"]["complete"]
    assert json.loads((b / "xpress" / "train_state.json").read_text())["step"] == 1
    snap = _tensors(a / "xpress-step1")
    assert snap.keys() == _tensors(b / "xpress").keys() and all(torch.equal(v, _tensors(b / "xpress")[k]) for k, v in snap.items())
    rest = train(cfg, "xpress", progress=False)
    assert rest["warmstart"]["skipped"] and rest["xpress"]["step"] == 4 and rest["xpress"]["complete"]

    for stage in ("warmstart", "xpress"):
        ta, tb = _tensors(a / stage), _tensors(b / stage)
        assert set(ta) == set(tb) and len(ta) > 10
        assert (stage == "xpress") == any(k.startswith("head") for k in ta)
        for k in ta:
            assert torch.equal(ta[k], tb[k]), f"{stage}: {k} differs after resume"
        la, lb = _log(a.parents[1], stage), _log(b.parents[1], stage)
        keys = ("step", "loss", "lr", "grad_norm", "tf_tau")
        assert [[r[k] for k in keys] for r in la] == [[r[k] for k in keys] for r in lb]
        assert len(la) == (2 if stage == "warmstart" else 4)
    assert not torch.equal(_tensors(a / "warmstart")["model.safetensors/fc.weight"],
                           _tensors(a / "xpress")["model.safetensors/fc.weight"]), "co-training did not train"
    again = train(cfg, "xpress", progress=False)  # complete: nothing to do
    assert again["warmstart"]["skipped"] and again["xpress"]["skipped"]
    # stopping at the warm start's last step (--stop-after its steps) leaves no step-0 stage of the method behind
    c = _where(monkeypatch, root, "resume-c")
    only = train(cfg, "xpress", progress=False, overwrite=True, stop_after=2)
    assert list(only) == ["warmstart"] and only["warmstart"]["complete"]
    assert not (c / "xpress").exists() and not (c.parents[1] / "results" / "smoke" / "train_xpress.json").exists()
    assert all(torch.equal(v, _tensors(a / "warmstart")[k]) for k, v in _tensors(c / "warmstart").items())
    # co-training keys are not the warm start's: a longer co-training keeps it and retrains the method only
    longer = train(small("train.warm_start_steps=2", "train.steps=5", "train.consistency_weight=0.5", "head.rank=8"),
                   "xpress", progress=False, overwrite=True)
    assert longer["warmstart"]["skipped"] and longer["xpress"]["step"] == 5 and not longer["xpress"].get("skipped")


def test_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint_and_resumes_exactly(root, data, target, monkeypatch):
    """A SIGINT in the middle of step 2 of 4: the step finishes, the stage saves step 2, writes its log as
    interrupted and raises KeyboardInterrupt; run again, it ends where an uninterrupted stage does, bit for bit,
    and names the weights it saved by the fingerprint a study that decodes them records."""
    import signal

    from xpress.train import loop

    cfg = small("train.log_every=1")
    a = _where(monkeypatch, root, "sigint-a")
    loop.run_stage(cfg, "probe", "xpress", 4, progress=False, overwrite=True)
    b = _where(monkeypatch, root, "sigint-b")
    step_once = loop.train_step
    calls = []

    def interrupted_in_step_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # as Ctrl-C would, half-way through the step
        return step_once(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", interrupted_in_step_two)
    with pytest.raises(KeyboardInterrupt):
        loop.run_stage(cfg, "probe", "xpress", 4, progress=False, overwrite=True)
    assert len(calls) == 2
    state = json.loads((b / "probe" / "train_state.json").read_text())
    assert state["step"] == 2 and not state["complete"]
    written = json.loads((b.parents[1] / "results" / "smoke" / "train_probe.json").read_text())
    assert written["interrupted"] and written["step"] == 2 and written["final_val"] is None
    monkeypatch.setattr(loop, "train_step", step_once)
    rest = loop.run_stage(cfg, "probe", "xpress", 4, progress=False)
    assert rest["step"] == 4 and rest["complete"] and not rest["interrupted"]
    ta, tb = _tensors(a / "probe"), _tensors(b / "probe")
    assert set(ta) == set(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    # the stage names what it saved; a study that loads the folder names the same weights
    from xpress.proposer import checkpoint_fingerprint
    from xpress.studies.compare import fingerprints_of, make_drafters

    assert rest["fingerprint"] == checkpoint_fingerprint(b / "probe") == checkpoint_fingerprint(a / "probe")
    assert json.loads((b.parents[1] / "results" / "smoke" / "train_probe.json").read_text())["fingerprint"] == \
        rest["fingerprint"]
    (b / "xpress").symlink_to(b / "probe")  # where make_drafters looks for the xpress drafter
    assert fingerprints_of(make_drafters(cfg, target, ["ar", "xpress"])) == {"xpress": rest["fingerprint"]}
    assert [r["loss"] for r in _log(a.parents[1], "probe")] == [r["loss"] for r in _log(b.parents[1], "probe")]


def test_stage_signature_keys():
    """The warm start's signature ignores the co-training keys and the head, and keeps the rest of the recipe;
    a co-training stage's keeps everything (the warm start's steps and recipe stand for its starting folder)."""
    def sig(*extra, method="dflash", init=None):
        return stage_signature(small(*extra), "s", method, 2, init)

    assert sig() == sig("train.steps=9", "train.consistency_weight=0.1", "train.anchor_weight_end=0.5",
                        "train.refiner_only=true", "head.rank=8")
    for change in ("train.lr=1e-3", "train.gamma=2", "train.anchors_per_seq=8", "drafter.num_layers=2", "seed=3"):
        assert sig() != sig(change), change
    for change in ("train.steps=9", "train.warm_start_steps=7", "head.rank=8", "train.consistency_weight=0.1"):
        assert sig(method="xpress", init="w") != sig(change, method="xpress", init="w"), change
    every = stage_signature(small(), "s", "dflash", 2, None, every_key=True)  # how older warm starts were signed
    assert every != sig() and every["head"] == sig(method="xpress", init="w")["head"]
    assert stage_signature(small(), "s", "xpress", 2, "w", every_key=True) == sig(method="xpress", init="w")


def test_a_warm_start_signed_the_old_way_is_kept(root, data, monkeypatch):
    """A complete warm start whose state carries the every-key signature (written before the co-training keys
    left it) is reused, not refused; a foreign signature is still refused with the fix named."""
    cfg = small("train.warm_start_steps=2")
    folder = _where(monkeypatch, root, "legacy") / "warmstart"
    assert train(cfg, "dflash", progress=False)["warmstart"]["complete"]
    state_file = folder / "train_state.json"
    state = json.loads(state_file.read_text())
    from xpress.train.regenerate import config_hash

    state["signature_hash"] = config_hash(stage_signature(cfg, "warmstart", "dflash", 2, None, every_key=True))
    state_file.write_text(json.dumps(state))
    assert train(cfg, "dflash", progress=False)["warmstart"]["skipped"]
    state["signature_hash"] = "another"
    state_file.write_text(json.dumps(state))
    with pytest.raises(TrainingError, match="another config or method.*--overwrite"):
        train(cfg, "dflash", progress=False)


def test_moved_checkpoints_are_still_this_stage(root, data, monkeypatch):
    """A co-training stage signs its start (the warm start's folder) as paths.portable shows it, so checkpoints
    moved with their clone (or to another $XPRESS_CHECKPOINTS) are still complete, and the stage log names no
    folder of this machine; a stage signed with the absolute path (before 2026-12-05) is kept too."""
    cfg = small("train.warm_start_steps=2", "train.steps=2")
    before = _where(monkeypatch, root, "moved-from") / "xpress"
    assert train(cfg, "xpress", progress=False)["xpress"]["complete"]
    log = json.loads((paths.RESULTS / "smoke" / "train_xpress.json").read_text())
    assert log["checkpoint"] == "$XPRESS_CHECKPOINTS/smoke/xpress"
    assert log["signature"]["init"] == "$XPRESS_CHECKPOINTS/smoke/warmstart"
    after = root / "moved-to" / "checkpoints"
    shutil.copytree(before.parents[1], after, dirs_exist_ok=True)
    monkeypatch.setattr(paths, "CHECKPOINTS", after)
    assert train(cfg, "xpress", progress=False)["xpress"]["skipped"]  # not refused as another config
    state_file = after / "smoke" / "xpress" / "train_state.json"
    state = json.loads(state_file.read_text())
    from xpress.train.regenerate import config_hash

    old = stage_signature(cfg, "xpress", "xpress", 2, str(after / "smoke" / "warmstart"), init_as_given=True)
    assert old["init"] == str(after / "smoke" / "warmstart")
    state["signature_hash"] = config_hash(old)
    state_file.write_text(json.dumps(state))
    assert train(cfg, "xpress", progress=False)["xpress"]["skipped"]


def test_refiner_only_keeps_the_drafter(root, data, monkeypatch):
    """train.refiner_only: the drafter (here the warm start) stays bit-identical, only the head trains."""
    cfg = small("train.warm_start_steps=2", "train.refiner_only=true")
    folder = _where(monkeypatch, root, "refiner-only")
    train(cfg, "xpress", progress=False, overwrite=True)
    warm, head = _tensors(folder / "warmstart"), _tensors(folder / "xpress")
    drafter_keys = [k for k in warm if k.startswith("model.safetensors")]
    assert drafter_keys and all(torch.equal(warm[k], head[k]) for k in drafter_keys)
    assert head["head.safetensors/w_r.weight"].abs().sum() > 0  # the zero-initialised readout moved


def _fixed_batch_loss(cfg, data, target, md) -> dict[str, float]:
    """L_total (anchor weight fixed at 0.4) and its parts on one fixed batch of every training sequence."""
    batch = make_batch(data, data.indices("train"), cfg, torch.Generator().manual_seed(123))
    readout = target.lm_head().weight[md.vocab.d2t]
    with torch.no_grad():
        out = CoTrainer(md.drafter, md.head, md.vocab)(batch)
        _, logs = compute_loss(out, batch, md.vocab, readout, cfg, 0.4)
    return logs


def test_train_speed_study_times_the_path_before_and_the_presets_on_the_same_batches(root, data, target, monkeypatch):
    from xpress.studies.train_speed import arms, run_train_speed

    _where(monkeypatch, root, "train_speed")
    assert list(arms(small())) == ["before", "loss_kernel=auto", "attention_kernel=auto", "preset"]
    assert (arms(small())["before"].train.loss_kernel, arms(small())["before"].train.attention_kernel) == ("torch", "torch")
    res = run_train_speed(small(), target, ["xpress"], steps=2, warmup=1, progress=False)
    table = {r["arm"]: r for r in res["table"]}
    assert {r["method"] for r in res["table"]} == {"xpress"}
    assert set(table) == set(arms(small())) and table["before"]["ratio_to_before"] == 1.0
    assert table["before"]["loss_kernel_ran"] == table["before"]["attention_kernel_ran"] == "torch"
    fused = "fused" if kernels.for_training("auto", "cpu") is not None else "torch"
    assert table["preset"]["loss_kernel_ran"] == table["preset"]["attention_kernel_ran"] == fused
    assert table["before"]["same_loss_rel_diff"] == 0.0 and table["preset"]["same_loss_rel_diff"] < 1e-4
    assert table["preset"]["same_grad_rel_diff_float32"] < 1e-4  # the same function, in float32
    assert table["before"]["same_grad_rel_diff_float32"] == table["before"]["same_grad_rel_diff"] == 0.0
    assert [r["arm"] for r in res["rows"]].count("preset") == 2 and all(r["seconds"] > 0 for r in res["rows"])
    assert (paths.RESULTS / "smoke" / "train_speed.json").is_file() and res["provenance"]["git_revision"]


def test_teacher_forced_validation_is_float32_whoever_wraps_the_module(root, data, target, monkeypatch):
    """A stage's own validation (its module prepared by accelerate, whose forward runs under bf16 autocast
    where bf16 is native) and a rescoring of its checkpoint (a plain module) score the same weights alike:
    the forward runs without autocast either way."""
    from accelerate import Accelerator

    seen = []
    forward = CoTrainer.forward

    def recording(self, *args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CoTrainer, "forward", recording)
    md = new_drafter("xpress", small(), target, seed=3)
    randomize_(md.head, generator=torch.Generator().manual_seed(3))
    plain = teacher_forced_val(CoTrainer(md.drafter, md.head, md.vocab), data, small())
    module = CoTrainer(md.drafter, md.head, md.vocab)
    Accelerator(mixed_precision="bf16", cpu=True).prepare(module)  # its forward now runs under autocast
    with torch.no_grad():
        module(make_batch(data, data.indices("val")[:1], small(), torch.Generator().manual_seed(0)))
    assert seen == [False] * (len(seen) - 1) + [True]  # the wrapper does turn autocast on
    seen.clear()
    assert teacher_forced_val(module, data, small()) == plain
    with torch.autocast("cpu", dtype=torch.bfloat16):  # and inside a caller's autocast
        assert teacher_forced_val(module, data, small()) == plain
    assert seen and not any(seen)


def test_train_speed_command_line_names_bad_steps_and_writes_its_file(root, data, target, monkeypatch, capsys):
    from xpress.studies import train_speed

    _where(monkeypatch, root, "train_speed_cli")
    base = ["--preset", "smoke", "--no-progress", "--methods", "dflash", *DATA, *TRAIN]  # small()'s config
    assert train_speed.main(base + ["--steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --steps must be at least 1 and --warmup at least 0"
    assert train_speed.main(base + ["--steps", "1", "--warmup", "0"]) == 0
    res = json.loads((paths.RESULTS / "smoke" / "train_speed.json").read_text())
    assert res["methods"] == ["dflash"] and res["command"].endswith("--methods dflash --steps 1 --warmup 0")
    with pytest.raises(SystemExit, match="2"):  # argparse names the bad one
        train_speed.main(base + ["--methods", "dflash,ngram"])
    assert "'ngram': give methods from dflash, markov, xpress" in capsys.readouterr().err


def test_training_lowers_the_loss(root, data, target, monkeypatch):
    """12 steps on the 8 smoke sequences. The smoke target is a random model, nearly uniform (entropy
    ~10.5 nats of 10.8), so the L1 term cannot fall (>= 2 (1 - its mass inside the draft vocabulary)
    ~ 1.97): what training can learn is the cross-entropy to the regenerated (greedy) tokens."""
    _where(monkeypatch, root, "learn")
    cfg = small("train.steps=12", "train.lr=1e-2", "train.log_every=4", "train.eval_prompts=1",
                "train.eval_max_new_tokens=8")
    vocab, _ = build_vocab(cfg, target, data)
    before = _fixed_batch_loss(cfg, data, target, new_drafter("xpress", cfg, target, vocab, seed=cfg.seed))
    out = train(cfg, "xpress", progress=False, overwrite=True)["xpress"]
    assert out["complete"] and out["final_val"]["tau"] >= 1.0
    log = _log(root / "learn", "xpress")
    assert [r["step"] for r in log] == [4, 8, 12]
    assert np.mean([r["loss"] for r in log[-2:]]) < log[0]["loss"]
    # on a fixed batch and with a fixed anchor weight (the annealed one lowers the logged total by itself)
    after = _fixed_batch_loss(cfg, data, target, load_drafter(paths.CHECKPOINTS / "smoke" / "xpress", "xpress", cfg,
                                                              target))
    assert after["loss"] < 0.95 * before["loss"], (before, after)
    assert after["refined_ce"] < before["refined_ce"] - 1.0 and after["base_ce"] < before["base_ce"] - 1.0
    assert after["tf_tau"] >= before["tf_tau"]


def test_teacher_forced_val(data, target):
    """Validation acceptance: the held-out sequences only, the same blocks whatever the training batch
    shape, and exactly the teacher-forced acceptance of those blocks."""
    from dataclasses import replace

    from xpress.train.loop import VAL_ANCHORS, VAL_BATCH, teacher_forced_val

    cfg = small()
    vocab, _ = build_vocab(cfg, target, data)
    md = new_drafter("xpress", cfg, target, vocab, seed=0)
    randomize_(md.head, scale=3.0, generator=torch.Generator().manual_seed(0))  # refined != base
    module = CoTrainer(md.drafter, md.head, md.vocab)
    val = teacher_forced_val(module, data, cfg)
    assert val == teacher_forced_val(module, data, small("train.anchors_per_seq=7", "train.batch_size=1"))
    rows = data.indices("val")
    fixed = replace(cfg, train=replace(cfg.train, anchors_per_seq=VAL_ANCHORS, batch_size=VAL_BATCH))
    batch = make_batch(data, rows, fixed, torch.Generator().manual_seed(cfg.seed + 7919))
    with torch.no_grad():
        out = module(batch, consistency=False)
    labels, valid = vocab.to_draft(batch.labels.reshape(-1, cfg.drafter.block_size - 1)), batch.label_valid.flatten(0, 1)
    assert val["blocks"] == int(valid.all(-1).sum()) > 0
    assert val["tf_tau"] == pytest.approx(teacher_forced_acceptance(out["refined"], labels, valid)[1])
    assert val["tf_tau_base"] == pytest.approx(teacher_forced_acceptance(out["base"], labels, valid)[1])
    assert module.training  # left as it was

    class Perfect(CoTrainer):  # refined logits that always pick the regenerated token: tau = B on every block
        def forward(self, batch, consistency=True, attention=None):
            out = super().forward(batch, consistency, attention)
            gold = self.vocab.to_draft(batch.labels.flatten(0, 1)).clamp_min(0)
            out["refined"] = torch.nn.functional.one_hot(gold, out["base"].shape[-1]).float() * 50
            return out

    perfect = teacher_forced_val(Perfect(md.drafter, md.head, md.vocab), data, cfg)
    inside = bool((vocab.to_draft(batch.labels.flatten(0, 1))[valid.all(-1)] >= 0).all())
    assert perfect["tf_tau_base"] == val["tf_tau_base"]
    assert perfect["tf_tau"] > val["tf_tau"]  # labels outside the draft vocabulary still stop a block
    if inside:  # every label is a draft token: every block accepted whole
        assert perfect["tf_tau"] == cfg.drafter.block_size


def test_lever_rows_merge(tmp_path, monkeypatch):
    import json

    import pandas as pd

    from xpress.studies.levers import lever_config, record, row_provenance

    monkeypatch.setattr(paths, "RESULTS", tmp_path)
    record("smoke", [{"lever": "base", "steps": 4, "seconds": 8.0, "s_per_step": 2.0, "val_tf_tau": 1.1, "blocks": 3}])
    record("smoke", [{"lever": "base", "steps": 4, "seconds": None, "s_per_step": None, "val_tf_tau": 1.2, "blocks": 3},
                     {"lever": "train.lr=1e-3", "steps": 4, "seconds": 4.0, "s_per_step": 1.0, "val_tf_tau": 1.3, "blocks": 3}])
    rows = json.loads((tmp_path / "smoke" / "levers.json").read_text())["rows"]
    assert [(r["lever"], r["val_tf_tau"], r["seconds"]) for r in rows] == [("train.lr=1e-3", 1.3, 4.0), ("base", 1.2, 8.0)]
    assert lever_config("smoke", "train.lr=1e-3", 4).train.lr == 1e-3

    # each row says where it comes from (rows of several runs share the file), in the CSV too
    prov = row_provenance("smoke", "python -m xpress.studies.levers --preset smoke base")
    assert set(prov) == {"command", "git_revision", "date", "cpu", "cpu_class", "target_dtype"}
    assert prov["command"].endswith("--preset smoke base") and prov["git_revision"] and prov["date"]
    record("smoke", [{"lever": "base", "steps": 4, "seconds": 2.0, "s_per_step": 0.5, "val_tf_tau": 1.4, "blocks": 3,
                      **prov}])
    csv = pd.read_csv(tmp_path / "smoke" / "levers.csv").set_index("lever")
    assert csv.loc["base", "command"] == prov["command"]
    assert pd.isna(csv.loc["train.lr=1e-3", "git_revision"])  # a row recorded without provenance has none
    # ... and the file's provenance block of the write before, which described it, is kept for it
    first = json.loads((tmp_path / "smoke" / "levers.json").read_text())
    assert first["legacy_provenance"]["git_revision"] and first["provenance"]["date"] >= first["legacy_provenance"]["date"]
    record("smoke", [{"lever": "train.lr=1e-3", "steps": 4, "seconds": 1.0, "s_per_step": 0.25, "val_tf_tau": 1.3,
                      "blocks": 3, **prov}])
    assert "legacy_provenance" not in json.loads((tmp_path / "smoke" / "levers.json").read_text())  # no such row left
    # a rescore (seconds None) keeps the training time and where the training ran, twice over
    for command in ("rescore 1", "rescore 2"):
        record("smoke", [{"lever": "base", "steps": 4, "seconds": None, "s_per_step": None, "val_tf_tau": 1.5,
                          "blocks": 3, **prov, "command": command}])
    base = next(r for r in json.loads((tmp_path / "smoke" / "levers.json").read_text())["rows"] if r["lever"] == "base")
    assert (base["seconds"], base["s_per_step"], base["val_tf_tau"], base["command"]) == (2.0, 0.5, 1.5, "rescore 2")
    assert (base["trained_command"], base["trained_git_revision"]) == (prov["command"], prov["git_revision"])
    with pytest.raises(Exception, match="nosuch"):
        lever_config("smoke", "train.nosuch=1", 4)


def test_training_rows_and_step_rows():
    """Training rows: the train split, or its first train.train_sequences (nested prefixes), a one-line error
    when too many or none; a step's rows: a function of (seed, step) alone, the ranks splitting one draw."""
    split = types.SimpleNamespace(indices=lambda name: [3, 5, 8, 13, 21] if name == "train" else [], folder="d")
    assert training_rows(small(), split) == [3, 5, 8, 13, 21]
    assert training_rows(small("train.train_sequences=2"), split) == [3, 5]
    with pytest.raises(TrainingError, match="train.train_sequences=6 exceeds the 5 .* lower it"):
        training_rows(small("train.train_sequences=6"), split)
    with pytest.raises(TrainingError, match="d holds no training sequences"):
        training_rows(small(), types.SimpleNamespace(indices=lambda name: [], folder="d"))
    cfg, rows = small("train.batch_size=3"), list(range(100, 200))
    draws = [step_rows(rows, cfg, s, 0, 1) for s in range(6)]
    assert draws == [step_rows(rows, cfg, s, 0, 1) for s in range(6)]  # a resumed run draws the same rows
    assert all(len(d) == 3 and set(d) <= set(rows) for d in draws) and len({tuple(d) for d in draws}) > 1
    world = [step_rows(rows, cfg, 4, r, 2) for r in (0, 1)]  # two ranks split one draw of 6
    pick = torch.randint(len(rows), (6,), generator=step_generator(cfg.seed, 4, -1)).tolist()
    assert world[0] + world[1] == [rows[i] for i in pick]


def test_a_lever_on_fewer_sequences_is_scored_by_decoding(root, data, target, monkeypatch):
    """train.train_sequences trains on a prefix of the training split (recorded with its tokens); a lever
    row carries tau by decoding and the speedups; too many sequences is a one-line error."""
    from xpress.studies.levers import run_lever
    from xpress.train.loop import run_stage

    _where(monkeypatch, root, "fewer")
    n = len(data.indices("train"))
    with pytest.raises(TrainingError, match=f"train.train_sequences={n + 1} exceeds the {n}"):
        run_stage(small(f"train.train_sequences={n + 1}"), "probe", "dflash", 1, data=data, target=target,
                  progress=False, write_log=False)
    monkeypatch.setattr("xpress.studies.levers.load_config",
                        lambda preset, overrides=(): small(*overrides))  # the smoke sizes of this module
    row = run_lever("smoke", "train.train_sequences=2", 2, target=target, data=data, progress=False, decode_prompts=1)
    first2 = data.indices("train")[:2]
    assert row["train_sequences"] == 2 and row["block_size"] == small().drafter.block_size  # the row's own B
    assert (row["anchors_per_seq"], row["on_bf16"]) == (small().train.anchors_per_seq, [])  # and its sizes
    assert row["train_response_tokens"] == sum(len(data.input_ids[i]) - data.prompt_len[i] for i in first2)
    assert row["decode_prompts"] == 1 and row["val_tau"] >= 1 and row["ar_step_ms"] > 0 and row["round_ms"] > 0
    assert row["implied_speedup"] == pytest.approx(row["val_tau"] * row["ar_step_ms"] / row["round_ms"])
    again = run_lever("smoke", "train.train_sequences=2", 2, target=target, data=data, progress=False, decode_prompts=1)
    assert again["seconds"] is None and again["val_tf_tau"] == row["val_tf_tau"]  # complete: only rescored
    assert (again["train_sequences"], again["train_response_tokens"]) == (2, row["train_response_tokens"])


def test_a_cotraining_lever_starts_from_the_warm_start(root, data, target, monkeypatch, capsys):
    """--from-warm-start: a head method's lever co-trains from the preset's trained warm start (at lr 1e-30 its
    drafter is the warm start's, bit for bit, and its head is there); the row says method and init, and is
    kept apart from the from-scratch rows of the same lever and steps. No warm start: one line naming the fix."""
    from xpress.plots import lever_rows
    from xpress.studies.levers import record, run_lever

    folder = _where(monkeypatch, root, "cotrain-lever")
    monkeypatch.setattr("xpress.studies.levers.load_config",
                        lambda preset, overrides=(): small("train.warm_start_steps=2", *overrides))
    with pytest.raises(TrainingError, match="no complete warm start at .*python -m xpress train --preset smoke"):
        run_lever("smoke", "base", 2, target=target, data=data, progress=False, method="xpress", from_warm_start=True)
    with pytest.raises(ValueError, match="from_warm_start"):
        run_lever("smoke", "base", 2, target=target, data=data, progress=False, method="xpress")
    from xpress.studies.levers import main as levers_main

    for argv, says in ((["--method", "xpress", "--from-warm-start", "base"], "no complete warm start at "),
                       (["train.nope=1"], "train.nope"), (["--method", "xpress", "base"], "add --from-warm-start")):
        with pytest.raises(SystemExit) as exit_:  # the command line: one line naming the fix, no traceback
            levers_main(["--preset", "smoke", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and says in err[-1] and not any("Traceback" in line for line in err)
    train(small("train.warm_start_steps=2"), "dflash", progress=False, overwrite=True)
    row = run_lever("smoke", "train.lr=1e-30", 2, target=target, data=data, progress=False, decode_prompts=1,
                    method="xpress", from_warm_start=True)
    assert (row["method"], row["init"], row["steps"]) == ("xpress", "warmstart", 2) and row["val_tau"] >= 1
    warm, lever = _tensors(folder / "warmstart"), _tensors(folder / "levers" / "xpress" / "train.lr-1e-30-2steps")
    drafter_keys = [k for k in warm if k.startswith("model.safetensors")]
    assert drafter_keys and all(torch.equal(warm[k], lever[k]) for k in drafter_keys)
    assert any(k.startswith("head.safetensors") for k in lever)
    scratch = {**row, "val_tf_tau": 1.0, "seconds": 1.0}
    for k in ("method", "init"):
        scratch.pop(k)
    record("smoke", [row, {**scratch, "lever": "base"}, scratch])
    rows = json.loads((paths.RESULTS / "smoke" / "levers.json").read_text())["rows"]
    assert len(rows) == 3 and sum(bool(r.get("init")) for r in rows) == 1  # same lever and steps, two rows
    assert all(not r.get("init") for r in lever_rows({"rows": rows}))  # the from-scratch figure: its own rows


def test_the_gap_against_another_run_scores_each_runs_stages_on_both_splits(root, data, target, monkeypatch, capsys):
    """--gap --against ROOT: this run's and ROOT's trained stages, each scored on both runs' validation
    splits (here ROOT's data are a link to this run's, so a stage scores the same on both, and ROOT's stage,
    trained at a negligible learning rate, is a different drafter whose scores are its own)."""
    from xpress.studies.levers import generalisation_gap, main as levers_main

    monkeypatch.setattr("xpress.studies.levers.load_config", lambda preset, overrides=(): small(*overrides))
    other = root / "gap-other"
    (other / "data").mkdir(parents=True, exist_ok=True)
    if not (other / "data" / "smoke").exists():
        (other / "data" / "smoke").symlink_to(root / "data" / "smoke")
    _where(monkeypatch, root, "gap-other")  # its checkpoints: other / "checkpoints"
    train(small("train.warm_start_steps=2", "train.lr=1e-30"), "dflash", progress=False, overwrite=True)
    _where(monkeypatch, root, "gap-this")
    train(small("train.warm_start_steps=2"), "dflash", progress=False, overwrite=True)

    got = generalisation_gap("smoke", stages=("warmstart",), target=target, against=other)
    swap = {(r["checkpoints"], r["data"]): r["val_tf_tau"] for r in got["swap"]}
    assert set(swap) == {(c, d) for c in ("this", "other") for d in ("this", "other")}
    assert swap["this", "this"] == swap["this", "other"] == got["rows"][0]["val_tf_tau"]
    md = load_drafter(other / "checkpoints" / "smoke" / "warmstart", "dflash", small(), target)
    theirs = teacher_forced_val(CoTrainer(md.drafter, md.head, md.vocab), data, small())["tf_tau"]
    assert swap["other", "this"] == swap["other", "other"] == theirs
    assert set(got["regenerated_at"]) == {"this", "other"}
    assert RegenData.load(small(), data_root=other / "data").folder == other / "data" / "smoke" / "regen"
    missing = root / "nowhere"
    with pytest.raises(RegenerationError, match=re.escape(f"no complete regenerated data at {missing / 'data'}")):
        generalisation_gap("smoke", stages=("warmstart",), target=target, against=missing)
    assert json.loads((paths.RESULTS / "smoke" / "generalisation.json").read_text())["swap"] == got["swap"]
    with pytest.raises(SystemExit):
        levers_main(["--preset", "smoke", "--against", str(other)])  # --against alone: an argparse error
    with pytest.raises(SystemExit):
        levers_main(["--preset", "smoke", "--gap", "--against", str(missing)])  # no such run: one line, before any work
    assert f"--against {missing}: no {missing / 'data'}" in capsys.readouterr().err


def test_data_scaling_curve_and_its_fit():
    from xpress.plots import break_even_tau, data_scaling_rows
    from xpress.studies.levers import scaling_fit

    rows = [{"lever": "base", "steps": 10, "train_response_tokens": 1000, "val_tf_tau": 2.0},
            {"lever": "train.train_sequences=1", "steps": 10, "train_response_tokens": 10, "val_tf_tau": 1.0},
            {"lever": "train.train_sequences=2", "steps": 10, "train_response_tokens": 100, "val_tf_tau": 1.5},
            {"lever": "train.train_sequences=2", "steps": 5, "train_response_tokens": 100, "val_tf_tau": 1.4},
            {"lever": "drafter.block_size=8", "steps": 10, "train_response_tokens": 1000, "val_tf_tau": 9.0}]
    curve = data_scaling_rows({"rows": rows})
    assert [r["train_response_tokens"] for r in curve] == [10, 100, 1000] and {r["steps"] for r in curve} == {10}
    fit = scaling_fit(curve, goal=2.5)  # tau = 0.5 + 0.5 log10(tokens): 2.5 at 10^4
    assert fit["per_decade"] == pytest.approx(0.5) and fit["tokens_for_goal"] == pytest.approx(1e4)
    assert data_scaling_rows({"rows": rows[:2]}) == []  # two sizes are not a curve
    flat = [{**r, "val_tf_tau": 1.0} for r in curve]
    assert scaling_fit(flat)["tokens_for_goal"] is None
    # a later curve of another recipe at the same steps is a curve of its own, and the one drawn
    later = [{**r, "anchors_per_seq": 32, "train_response_tokens": 3 * r["train_response_tokens"], "date": "2026-12-03"}
             for r in curve]
    assert data_scaling_rows({"rows": rows + later}) == later
    assert data_scaling_rows({"rows": rows + later[:2]}) == curve  # two sizes of it are not a curve yet

    # the break-even tau drawn beside the curve: the median round / AR-step cost ratio of the rows that timed both
    timed = [{**r, "ar_step_ms": 50.0, "round_ms": ms} for r, ms in zip(curve, (80.0, 90.0, 100.0))]
    assert break_even_tau(timed) == pytest.approx(1.8) and break_even_tau(curve) is None


# ----------------------------------------------------------------------------------------------- CLI
def _train_cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xpress", "train", "--preset", "smoke", "--method", "xpress",
                           "--no-progress", *args, *DATA, *TRAIN], capture_output=True, text=True,
                          cwd=paths.REPO_ROOT, env=env or _env(root), timeout=600)


def _one_error_line(stderr: str) -> str:
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in stderr, stderr
    return lines[0]


def test_cli_bad_inputs(root, data, tmp_path, monkeypatch, capsys):
    # no regenerated data
    proc = _train_cli(tmp_path)
    assert proc.returncode == 2
    assert "regenerate" in _one_error_line(proc.stderr)

    # an interrupted checkpoint (a complete one would be skipped without being read), then broken copies
    ckpt = _where(monkeypatch, root, "cli")
    assert main(["train", "--preset", "smoke", "--method", "xpress", "--no-progress", "--stop-after", "1",
                 *DATA, *TRAIN]) == 0
    capsys.readouterr()
    good = ckpt / "xpress"
    assert json.loads((good / "train_state.json").read_text())["step"] == 1

    def broken(name: str) -> Path:
        where = tmp_path / name
        shutil.copytree(good, where / "checkpoints" / "smoke" / "xpress")
        return where

    truncated = broken("truncated")
    head = truncated / "checkpoints" / "smoke" / "xpress" / "head.safetensors"
    head.write_bytes(head.read_bytes()[:100])
    proc = _train_cli(truncated, env={**_env(truncated), "XPRESS_DATA": str(root / "data")})
    assert proc.returncode == 2
    assert "corrupt" in _one_error_line(proc.stderr)

    # in-process from here (the same code path as the CLI, without a second interpreter)
    garbage = broken("garbage")
    (garbage / "checkpoints" / "smoke" / "xpress" / "train_state.json").write_text("{not json")
    monkeypatch.setattr(paths, "CHECKPOINTS", garbage / "checkpoints")
    assert main(["train", "--preset", "smoke", "--method", "xpress", "--no-progress", *DATA, *TRAIN]) == 2
    assert "train_state.json" in _one_error_line(capsys.readouterr().err)

    monkeypatch.setattr(paths, "CHECKPOINTS", ckpt.parent)
    assert main(["train", "--preset", "smoke", "--method", "xpress", "--no-progress", *DATA, *TRAIN,
                 "train.lr=1e-3"]) == 2
    assert "--overwrite" in _one_error_line(capsys.readouterr().err)
    assert json.loads((good / "train_state.json").read_text())["step"] == 1, "refused, yet the checkpoint changed"


# ----------------------------------------------------------------------------------------------- DDP
def test_two_processes_stay_identical(root, data, tmp_path, torchrun):
    """torchrun, 2 gloo CPU processes: each draws other sequences and anchors, so only the all-reduced
    gradients keep them equal; each saves its own weights (XPRESS_SAVE_EVERY_RANK=1)."""
    from safetensors.torch import load_file

    env = {**_env(tmp_path), "XPRESS_DATA": str(root / "data"), "XPRESS_SAVE_EVERY_RANK": "1"}
    proc = torchrun("-m", "xpress", "train", "--preset", "smoke", "--method", "xpress", "--no-progress", *DATA, *TRAIN,
                    env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "checkpoints" / "smoke" / "xpress"
    r0, r1 = load_file(str(folder / "rank0.safetensors")), load_file(str(folder / "rank1.safetensors"))
    assert set(r0) == set(r1) and any(k.startswith("head.") for k in r0)
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    saved = _tensors(folder)
    for name, prefix in (("model.safetensors", "drafter."), ("head.safetensors", "head.")):
        for k, v in ((k, v) for k, v in saved.items() if k.startswith(name)):
            assert torch.equal(r0[prefix + k.split("/", 1)[1]], v), k
    state = json.loads((folder / "train_state.json").read_text())
    assert state["step"] == 4 and state["complete"]
    prov = json.loads((tmp_path / "results" / "smoke" / "train_xpress.json").read_text())["provenance"]
    assert prov["world_size"] == 2
    # training happened: the refiner's readout starts at zero
    assert r0["head.w_r.weight"].abs().max() > 0


def test_decoding_accepts_what_teacher_forcing_predicts(root, data, target, monkeypatch):
    """At T = 0 each decoding round accepts exactly the drafts that teacher forcing accepts at the round's anchor
    (the same context, positions and refiner inputs), for the plain drafter and the refiner, at every k; the
    decoded text is the regenerated answer. Anchors one position off disagree, so the check can fail."""
    from xpress.studies.anchor_bias import decode_anchors, run_anchor_bias
    from xpress.train.loop import accepted_at

    cfg = small("train.steps=40", "train.lr=3e-3")
    _where(monkeypatch, root, "anchor-bias")
    for method in ("dflash", "xpress"):
        train(cfg, method, progress=False)
    # the training sequences, which 40 steps at a high rate half learn by heart: many drafts are accepted
    result = run_anchor_bias(cfg, target, methods=["dflash", "xpress"], ks=(0, 2), n_prompts=3, progress=False,
                             split="train")
    assert json.loads((paths.RESULTS / "smoke" / "anchor_bias.json").read_text())["table"] == result["table"]
    from xpress.report import _anchor_bias_section

    assert sum(line.startswith("| xpress | 2 |") for line in _anchor_bias_section(result)) == 1
    assert [(r["method"], r["k"]) for r in result["table"]] == [("dflash", 7), ("dflash", 2), ("xpress", 7), ("xpress", 2)]
    for r in result["table"]:
        assert r["output_is_regenerated"] and r["rounds"] > 5 and r["anchors"] > r["rounds"]
        assert r["agreement"] == 1.0 and r["tf_tau_decode_anchors"] == r["decode_tau"], r
    assert max(r["decode_tau"] for r in result["table"]) > 1.2  # drafts are accepted: the counts say something
    md = load_drafter(paths.CHECKPOINTS / "smoke" / "xpress", "xpress", cfg, target)
    module = CoTrainer(md.drafter, md.head, md.vocab)
    off = moved = 0
    for i in data.indices("train")[:3]:
        seq, p = data.input_ids[i], data.prompt_len[i]
        anchors, counts, _ = decode_anchors(target, md, seq[:p], seq[p:])
        kept = [(a, c) for a, c in zip(anchors, counts) if a + 1 + md.draft_tokens < len(seq)]
        shifted = accepted_at(module, data, cfg, i, [a + 1 for a, _ in kept], md.draft_tokens)
        off += sum(int(s) != c for s, (_, c) in zip(shifted.tolist(), kept))
        with torch.no_grad():  # the head changes choices: the refiner's inputs are part of what agreed above
            out = module(make_batch(data, [i], small("train.anchors_per_seq=8"), step_generator(0, 0, 0)), consistency=False)
        moved += int((out["refined"].argmax(-1) != out["base"].argmax(-1)).sum())
    assert off > 0 and moved > 0
    from xpress.studies.anchor_bias import main as anchor_bias_main

    assert anchor_bias_main(["--preset", "smoke", "--no-progress", "--draft-tokens", "9"]) == 2  # one line, no run
