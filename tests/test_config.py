import pytest

from xpress.config import Config, ConfigError, load_config, parse_overrides, presets, valid_keys


def test_presets_load_and_validate(monkeypatch):
    import torch

    import xpress.runtime

    assert {"smoke", "cpu", "qwen3-8b"} <= set(presets())
    for name in ("smoke", "cpu", "qwen3-8b"):
        cfg = load_config(name)
        assert isinstance(cfg, Config) and cfg.preset == name
    q = load_config("qwen3-8b")
    assert q.target.model == "Qwen/Qwen3-8B" and q.drafter.checkpoint == "z-lab/Qwen3-8B-DFlash-b16"
    assert q.drafter.block_size == 16 and q.target.device == "cuda"
    # the paper's setting computes in bf16 on any GPU with bf16 (auto), float32 only where bf16 is not native
    monkeypatch.setattr(xpress.runtime, "native_bf16", lambda: True)
    assert xpress.runtime.resolve_dtype(q.target.dtype) == torch.bfloat16
    monkeypatch.setattr(xpress.runtime, "native_bf16", lambda: False)
    assert xpress.runtime.resolve_dtype(q.target.dtype) == torch.float32
    assert load_config("cpu").target.source == "gguf"


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ConfigError) as e:
        load_config("nope")
    msg = str(e.value)
    assert "nope" in msg and "smoke" in msg and "cpu" in msg and "qwen3-8b" in msg


def test_train_sources_are_validated():
    assert load_config("smoke").data.train_sources == ["gsm8k-train", "math-train", "sharegpt", "code"]
    assert load_config("smoke", ['data.train_sources=["code"]']).data.train_sources == ["code"]
    for bad in ('["code", "code"]', '["github"]', "[]"):
        with pytest.raises(ConfigError, match="data.train_sources.*gsm8k-train, math-train, sharegpt, code"):
            load_config("smoke", [f"data.train_sources={bad}"])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config("smoke", ["drafter.blocksize=4"])
    assert "drafter.blocksize" in str(e.value) and "drafter.block_size" in str(e.value)
    with pytest.raises(ConfigError):
        load_config("smoke", {"nosection": {"x": 1}})


def test_overrides_from_cli_strings_and_papermill_dicts():
    cfg = load_config("smoke", ["drafter.block_size=4", "decode.temperature=0.7",
                                "data.benchmarks=gsm8k,mt-bench", "target.model=foo"])
    assert cfg.drafter.block_size == 4 and cfg.decode.temperature == 0.7
    assert cfg.data.benchmarks == ["gsm8k", "mt-bench"] and cfg.target.model == "foo"
    cfg = load_config("smoke", {"head": {"rank": 8}, "train.lr": 1e-3})
    assert cfg.head.rank == 8 and cfg.train.lr == 1e-3
    assert parse_overrides(["a.b=c=d"]) == {"a.b": "c=d"}


@pytest.mark.parametrize("override", ["drafter.block_size=1", "head.max_iters=0", "decode.temperature=-1",
                                      "target.dtype=int8", "target.source=ftp", "drafter.block_size=2.5",
                                      "drafter.block_size=abc", "data.regen_engine=paged",
                                      "train.snapshot_steps=[0]", "train.snapshot_steps=[2.5]"])
def test_bad_values_are_rejected_with_the_key_named(override):
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [override])
    assert override.split("=")[0].split(".")[-1] in str(e.value)


def test_malformed_override_and_section_assignment():
    with pytest.raises(ConfigError, match="key=value"):
        load_config("smoke", ["drafter.block_size"])
    with pytest.raises(ConfigError, match="section"):
        load_config("smoke", ["drafter=3"])


def test_env_default_preset(monkeypatch):
    monkeypatch.setenv("XPRESS_PRESET", "smoke")
    assert load_config().preset == "smoke"
    assert "drafter.block_size" in valid_keys()


def test_overrides_as_papermill_strings():
    """papermill passes -p OVERRIDES as a string: a JSON list or comma-separated key=value pairs."""
    from xpress.config import ConfigError, load_config

    assert load_config("smoke", '["head.max_iters=3", "drafter.block_size=4"]').head.max_iters == 3
    cfg = load_config("smoke", "head.max_iters=2,drafter.block_size=4")
    assert (cfg.head.max_iters, cfg.drafter.block_size) == (2, 4)
    with pytest.raises(ConfigError, match="not a JSON list"):
        load_config("smoke", '["head.max_iters=3"')


def test_on_bf16_overrides_apply_only_on_bf16_and_yield_to_explicit_ones(monkeypatch, tmp_path):
    import xpress.cpu

    preset = tmp_path / "p.yaml"
    preset.write_text("target: {dtype: auto, device: cpu}\ndata: {n_train_prompts: 10}\n"
                      "on_bf16: {data.n_train_prompts: 40, train: {anchors_per_seq: 8}}\n")
    monkeypatch.setattr(xpress.cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    cfg = load_config(str(preset))
    assert (cfg.data.n_train_prompts, cfg.train.anchors_per_seq, cfg.on_bf16) == (10, 16, [])
    for native in ("amx_bf16", "avx512_bf16"):  # tiles, or VDPBF16PS without them
        monkeypatch.setattr(xpress.cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", native}))
        cfg = load_config(str(preset))
        assert (cfg.data.n_train_prompts, cfg.train.anchors_per_seq) == (40, 8)
    assert cfg.on_bf16 == ["data.n_train_prompts=40", "train.anchors_per_seq=8"]
    cfg = load_config(str(preset), ["data.n_train_prompts=12"])  # an explicit key wins and is not recorded
    assert (cfg.data.n_train_prompts, cfg.train.anchors_per_seq, cfg.on_bf16) == (12, 8, ["train.anchors_per_seq=8"])
    for off in (["target.dtype=float32"], ["target.device=cuda"]):  # not a bf16 target on this CPU
        cfg = load_config(str(preset), off)
        assert (cfg.data.n_train_prompts, cfg.on_bf16) == (10, [])
    with pytest.raises(ConfigError, match="on_bf16 records"):
        load_config(str(preset), ["on_bf16=x"])
    preset.write_text("on_bf16: [1, 2]\n")
    with pytest.raises(ConfigError, match="on_bf16 must map"):
        load_config(str(preset))
    preset.write_text("on_bf16: {train.nope: 1}\n")
    with pytest.raises(ConfigError, match="train.nope"):
        load_config(str(preset))


def test_cpu_preset_on_bf16_keeps_its_keys_valid():
    import yaml

    from xpress import paths

    raw = yaml.safe_load((paths.CONFIGS / "cpu.yaml").read_text())
    assert raw["on_bf16"], "the cpu preset sizes its bf16 run in on_bf16"
    load_config("cpu", {k: v for k, v in raw["on_bf16"].items()})  # every key exists and validates
