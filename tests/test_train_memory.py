"""Training that fits and runs on every rank (docs/gpu.md, "Training memory and the per-rank device"): the
chunked, checkpointed loss equals the one-piece loss with its gradients; float32 master weights over a bf16
target; the drafter's layers under gradient checkpointing; flex attention over the training blocks equal to
the dense mask; each process takes its launcher's GPU before anything loads; and the memory model of a step
against a real step's measured peak."""
from __future__ import annotations

import types

import pytest
import torch

import xpress.targets
import xpress.train.loop as loop
from xpress import distributed
from xpress.config import ConfigError, load_config
from xpress.drafter import BlockLayout, block_attention_mask
from xpress.heads import randomize_
from xpress.proposer import METHODS, new_drafter
from xpress.train.loop import CoTrainer, LossChunks, build_trainable, compute_loss, make_batch, step_generator


def small(*extra: str):
    return load_config("smoke", ["train.batch_size=2", "train.anchors_per_seq=4", "train.max_len=64", *extra])


def _batch(cfg, target, lengths=(40, 29)):
    """A batch of random token sequences (the second shorter: padded) with the target's states computed online."""
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in lengths]
    bare = types.SimpleNamespace(input_ids=ids, prompt_len=[6, 4], has_states=False, folder="synthetic")
    return make_batch(bare, list(range(len(ids))), cfg, step_generator(0, 0, 0), target=target)


def _loss_and_grads(module, batch, cfg, readout, chunks):
    module.zero_grad(set_to_none=True)
    out = module(batch, consistency=True, chunks=chunks)
    loss, logs = compute_loss(out, batch, module.vocab, readout, cfg, 0.4)
    loss.backward()
    return loss.detach(), logs, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_chunked_loss_and_gradients_equal_the_one_piece_loss(target, method, kernel):
    cfg = small(f"train.loss_kernel={kernel}")
    batch = _batch(cfg, target)
    md = new_drafter(method, cfg, target, seed=3)
    if md.head is not None:
        randomize_(md.head, generator=torch.Generator().manual_seed(4))  # a fresh head is delta = 0
    module = CoTrainer(md.drafter, md.head, md.vocab).train()
    readout = target.lm_head().weight.detach()[md.vocab.d2t]
    one, logs1, g1 = _loss_and_grads(module, batch, cfg, readout, None)
    for blocks in (3, 8):  # uneven chunks (3 + 3 + 2 blocks), and one chunk of all 8
        chunked = LossChunks.of(load_config("smoke", [f"train.loss_chunk_blocks={blocks}",
                                                      f"train.loss_kernel={kernel}"]), readout)
        loss, logs, g = _loss_and_grads(module, batch, cfg, readout, chunked)
        torch.testing.assert_close(loss, one, rtol=1e-6, atol=1e-6)
        assert set(g) == set(g1) and len(g) > 3
        for n in g1:
            torch.testing.assert_close(g[n], g1[n], rtol=1e-5, atol=1e-7, msg=n)
        for k, v in logs1.items():
            assert logs[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    # the check can fail: a loss with another anchor weight differs
    out = module(batch, consistency=True)
    other = compute_loss(out, batch, module.vocab, readout, cfg, 0.9)[0]
    assert method == "dflash" or abs(float(other.detach()) - float(one)) > 1e-4


def test_chunked_target_logsumexp_equals_the_full_logits(target):
    cfg = small()
    full = _batch(cfg, target)
    chunked = _batch(load_config("smoke", ["train.batch_size=2", "train.anchors_per_seq=4", "train.max_len=64",
                                           "train.state_chunk_tokens=7"]), target)
    scored = full.label_valid
    # the chunks read the captured (float16) hidden state, the full logits the model's own: fp16 rounding apart
    torch.testing.assert_close(chunked.t_lse[scored], full.t_lse[scored], atol=2e-3, rtol=1e-4)
    assert torch.equal(chunked.t_hidden, full.t_hidden) and torch.equal(chunked.features, full.features)


def test_chunk_settings_are_validated():
    with pytest.raises(ConfigError, match="train.loss_chunk_blocks=-1 must be >= 0"):
        load_config("smoke", ["train.loss_chunk_blocks=-1"])
    with pytest.raises(ConfigError, match="train.state_chunk_tokens"):
        load_config("smoke", ["train.state_chunk_tokens=-2"])
    cpu, smoke, big = load_config("cpu"), load_config("smoke"), load_config("qwen3-8b")
    assert (cpu.train.loss_chunk_blocks, cpu.train.state_chunk_tokens, cpu.train.gradient_checkpointing) == (0, 0, False)
    assert (smoke.train.loss_chunk_blocks, smoke.train.gradient_checkpointing) == (0, False)
    assert big.train.loss_chunk_blocks > 0 and big.train.state_chunk_tokens > 0 and big.train.gradient_checkpointing


# --------------------------------------------------------------------------------------- master weights
@pytest.mark.parametrize("method", METHODS)
def test_trainable_parameters_are_float32_over_a_bf16_target(target, method):
    bf16 = xpress.targets.Target(**{k: getattr(target, k) for k in xpress.targets.Target.__dataclass_fields__})
    bf16.runtime = None  # the transformers forward, in bf16 (the GPU's path)
    model = bf16.model
    bf16.model = type(model)(model.config).to(torch.bfloat16).eval().requires_grad_(False)
    bf16.model.load_state_dict(model.state_dict())
    cfg = small("train.gradient_checkpointing=true")
    module = build_trainable(cfg, method, target=bf16)
    trained = [p for p in module.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    # the borrowed embedding and LM head stay the target's, in its dtype
    embed, head = module.drafter._io()
    assert embed.weight is bf16.model.get_input_embeddings().weight and head.weight.dtype == torch.bfloat16
    assert module.drafter.gradient_checkpointing and module.training
    # and a step under bf16 autocast runs and gives every trained parameter a float32 gradient
    batch = _batch(cfg, bf16)
    readout = bf16.lm_head().weight.detach()[module.vocab.d2t]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(batch, chunks=LossChunks.of(load_config("smoke", ["train.loss_chunk_blocks=3"]), readout))
        loss, _ = compute_loss(out, batch, module.vocab, readout, cfg, 0.5)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained if p.dim() > 1)
    # the control: without the master-weight rule the drafter would be built in the target's dtype
    assert new_drafter(method, cfg, bf16).drafter.dtype == torch.bfloat16


def test_gradient_checkpointing_keeps_the_values_and_gradients(target):
    cfg = small()
    batch = _batch(cfg, target)
    md = new_drafter("xpress", cfg, target, seed=3)
    randomize_(md.head, generator=torch.Generator().manual_seed(4))
    module = CoTrainer(md.drafter, md.head, md.vocab).train()
    readout = target.lm_head().weight.detach()[md.vocab.d2t]
    plain = _loss_and_grads(module, batch, cfg, readout, None)
    module.drafter.gradient_checkpointing = True
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = module(batch, consistency=True)
    module.drafter.gradient_checkpointing = False
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(-t.numel()) or t, lambda t: t):
        module(batch, consistency=True)
    kept, kept_plain = sum(n for n in saved if n > 0), -sum(n for n in saved if n < 0)
    assert kept < kept_plain  # fewer activations held for backward
    module.drafter.gradient_checkpointing = True
    again = _loss_and_grads(module, batch, cfg, readout, None)
    torch.testing.assert_close(again[0], plain[0], rtol=1e-6, atol=1e-6)
    for n in plain[2]:
        torch.testing.assert_close(again[2][n], plain[2][n], rtol=1e-5, atol=1e-7, msg=n)
    del out


# --------------------------------------------------------------------------------------- flex attention
def test_flex_block_layout_equals_the_dense_mask(target):
    """The GPU's training attention (flex attention over the block rule, no dense scores) run eagerly on the
    CPU at small shapes: equal to SDPA over :func:`block_attention_mask` (values; flex attention has no
    backward on a CPU, so its gradient is the GPU device check's)."""
    cfg = small()
    batch = _batch(cfg, target)
    d = new_drafter("dflash", cfg, target, seed=3).drafter
    context = d.encode_context(batch.features, batch.positions, batch.valid)
    layout = BlockLayout.of(context, batch.anchor_pos, d.block_size, None)
    assert layout is not None and layout.kernel is None
    mask = block_attention_mask(context.positions, context.valid, batch.anchor_pos, d.block_size)
    x = d.embed_block(batch.anchor_ids)
    b, n = x.shape[:2]
    pos = (batch.anchor_pos[:, :, None] + torch.arange(d.block_size)).reshape(b, n)
    cos, sin = d._rope_table(pos, d.dtype)
    attn = d.layers[0].self_attn
    with torch.no_grad():
        dense, flex = (attn(x, cos, sin, context.keys[0], context.values[0], m) for m in (mask, layout))
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
        # the rule can fail: a layout whose blocks see one context key more differs
        leaky = BlockLayout((layout.lim + 1).clamp_max(context.positions.shape[1]), d.block_size, None)
        assert (attn(x, cos, sin, context.keys[0], context.values[0], leaky) - dense).abs().max() > 1e-3


# --------------------------------------------------------------------------------------- per-rank device
def test_training_takes_the_launchers_gpu_before_loading_anything(monkeypatch, cfg):
    """Under a launcher (LOCAL_RANK=1) on a machine that reports GPUs, train() makes GPU 1 current before the
    data or the target load, and the target is placed on cuda:1, not cuda:0 (a patched torch.cuda records it)."""
    events = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: events.append(("set_device", i)))

    class Stop(Exception):
        pass

    def load(c, verbose=False):
        events.append(("load_target", distributed.local_device(c.target.device)))
        raise Stop

    monkeypatch.setattr(loop.RegenData, "load", classmethod(lambda cls, c: events.append(("data",)) or None))
    monkeypatch.setattr(xpress.targets, "load_target", load)
    gpu = load_config("smoke", ["target.device=cuda"])
    with pytest.raises(Stop):
        loop.train(gpu, "xpress", progress=False)
    assert events[0] == ("set_device", 1) and ("load_target", "cuda:1") in events
    assert events.index(("set_device", 1)) < events.index(("data",))
    # the loader itself puts the model on the rank's GPU: Module.to is recorded (and kept on the CPU here)
    placed = []
    real_to = torch.nn.Module.to

    def to(self, *args, **kw):
        placed.extend(str(a) for a in args if isinstance(a, (str, torch.device)))
        return real_to(self, *[a for a in args if not isinstance(a, (str, torch.device))], **kw)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    xpress.targets._load_target(load_config("smoke", ["target.device=cuda", "target.runtime=transformers"]))
    assert "cuda:1" in placed and "cuda" not in placed and "cuda:0" not in placed
    # an explicit index and the CPU are kept
    assert distributed.local_device("cuda:3") == "cuda:3" and distributed.local_device("cpu") == "cpu"


# --------------------------------------------------------------------------------------- memory model
def test_memory_model_arithmetic():
    from xpress.gpu_budget import Dims
    from xpress.train.memory import LOSS_UNITS, StepShapes, head_params, step_memory

    cfg = load_config("qwen3-8b", ["train.loss_chunk_blocks=8", "train.batch_size=2", "train.anchors_per_seq=8"])
    t = Dims(hidden=64, layers=8, intermediate=192, heads=1, kv_heads=1, head_dim=64, vocab=1000)
    s = StepShapes.of(cfg, t, cuda=True)
    assert (s.loss_chunk, s.draft_vocab, s.target_bytes, s.compute_bytes) == (8, 1000, 2, 2)
    one = {m: step_memory(cfg, m, s) for m in ("dflash", "markov", "xpress")}
    unit = 8 * 15 * 1000 * 4  # c x P x Vd float32
    assert one["xpress"]["loss_chunk_unit"] == unit
    assert one["xpress"]["components"]["loss_chunk"] == LOSS_UNITS["xpress"] * unit
    # a head adds its weights, gradients, AdamW moments and bf16 copies: 18 bytes per parameter
    hp = head_params("markov", cfg, 1000, 64)
    assert hp == 1001 * 256 + 1000 * 256
    diff = {k: one["markov"]["components"][k] - one["dflash"]["components"][k]
            for k in ("master_weights", "gradients", "adam_moments", "autocast_copies")}
    assert diff == {"master_weights": 4 * hp, "gradients": 4 * hp, "adam_moments": 8 * hp, "autocast_copies": 2 * hp}
    # twice the chunk: the loss term doubles, nothing else moves; unchunked = every block in one chunk
    two = step_memory(load_config("qwen3-8b", ["train.loss_chunk_blocks=16", "train.batch_size=2",
                                               "train.anchors_per_seq=8"]), "xpress", StepShapes.of(
        load_config("qwen3-8b", ["train.loss_chunk_blocks=16", "train.batch_size=2", "train.anchors_per_seq=8"]), t, cuda=True))
    assert two["components"]["loss_chunk"] == 2 * one["xpress"]["components"]["loss_chunk"]
    whole = StepShapes.of(load_config("qwen3-8b", ["train.loss_chunk_blocks=0", "train.batch_size=2",
                                                   "train.anchors_per_seq=8"]), t, cuda=True)
    assert whole.loss_chunk == 16
    # the baseline is added as given; the first step holds AdamW's moments only at its end
    assert step_memory(cfg, "xpress", s, baseline=1e9)["peak"] == one["xpress"]["peak"] + 1e9
    first = step_memory(cfg, "xpress", s, first_step=True)
    assert first["peak"] < one["xpress"]["peak"]


def test_the_preset_fits_80gb_and_gpu_hours_prints_the_peaks(capsys):
    from xpress.__main__ import main
    from xpress.train.memory import FITS_GB, stage_peaks, step_memory

    cfg = load_config("qwen3-8b")
    peaks = stage_peaks(cfg)
    assert set(peaks) >= {"regenerate", "decode", "train dflash", "train markov", "train xpress"}
    assert max(peaks.values()) < FITS_GB * 1e9, peaks
    # without the chunking and checkpointing the preset would not fit: the model can say no
    plain = load_config("qwen3-8b", ["train.loss_chunk_blocks=0", "train.gradient_checkpointing=false"])
    assert step_memory(plain, "xpress")["peak"] > FITS_GB * 1e9
    assert main(["gpu-hours", "--preset", "qwen3-8b"]) == 0
    out = capsys.readouterr().out
    assert "peak GB/GPU" in out and f"| {peaks['train xpress'] / 1e9:.1f} |" in out


def test_a_real_step_peaks_where_the_model_says():
    """One xpress step in a fresh process at small shapes where the loss chunk dominates: its resident-set peak
    is within 25% of the model's prediction (the baseline measured in that process)."""
    from dataclasses import replace

    from xpress.train.memory import StepShapes, _bytes, run_fresh, shrunk, step_memory

    over = ["target.device=cpu", "train.max_len=256", "train.anchors_per_seq=8", "train.loss_chunk_blocks=32",
            "train.state_chunk_tokens=256"]
    got = run_fresh("qwen3-8b", "xpress", 32, 8, 1, 65536, over, timeout=900)
    cfg, t = shrunk(load_config("qwen3-8b", over), 32, 8, 1, 65536)
    shapes = replace(StepShapes.of(cfg, t, cuda=False), target_bytes=_bytes(got["target_dtype"]),
                     compute_bytes=2 if got["mixed_precision"] == "bf16" else 4)
    model = step_memory(cfg, "xpress", shapes, baseline=got["baseline_bytes"], first_step=True)
    assert model["components"]["loss_chunk"] > 0.5 * (model["peak"] - got["baseline_bytes"])  # the loss term matters
    assert abs(got["peak_bytes"] / model["peak"] - 1) <= 0.25, (got, model["components"], model["phases"])
    assert got["peak_bytes"] > got["baseline_bytes"] and got["loss"] > 0


@pytest.mark.slow
def test_train_memory_bench_at_the_presets_loss_shapes(tmp_path):
    """``python -m xpress bench train-memory --preset qwen3-8b --shrink`` for dflash (minutes on 2 cores)."""
    import json

    from xpress.__main__ import main

    assert main(["bench", "train-memory", "target.device=cpu", "--preset", "qwen3-8b", "--shrink", "--methods",
                 "dflash", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    got = json.loads((tmp_path / "train_memory.json").read_text())["methods"]["dflash"]
    assert got["within_25_percent"] and got["full_width_fits_80gb"]
