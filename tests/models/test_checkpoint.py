"""Checkpoint directory loading: layouts, dtypes, tokenizer, and every error path."""
import json
import os
import re
import shutil

import numpy as np
import pytest
from conftest import fixture_dir, reference
from safetensors.numpy import load_file, save_file

import moejax
from moejax import CheckpointError


def copy_fixture(name, tmp_path, transform=None):
    """Copy a fixture into one model.safetensors, optionally rewriting its tensor dict."""
    src, dst = fixture_dir(name), tmp_path / name
    dst.mkdir()
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
        elif f.endswith(".json") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), dst / f)
    if transform:
        tensors = transform(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def logits(path, name, dtype="float32"):
    return moejax.load(path, dtype=dtype).logits(reference(name)["input_ids"])


def test_sharded_checkpoint_with_index(tmp_path):
    assert os.path.isfile(os.path.join(fixture_dir("qwen3_moe_nonorm"), "model.safetensors.index.json"))
    merged = copy_fixture("qwen3_moe_nonorm", tmp_path)
    np.testing.assert_array_equal(logits(merged, "qwen3_moe_nonorm"),
                                  logits(fixture_dir("qwen3_moe_nonorm"), "qwen3_moe_nonorm"))


def _fuse_experts(tensors):
    """Per-expert keys -> transformers 5's fused experts.gate_up_proj [E, 2I, D] / down_proj [E, D, I]."""
    out, groups = {}, {}
    for k, v in tensors.items():
        m = re.match(r"(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = v
        else:
            out[k] = v
    for prefix, parts in groups.items():
        stack = {p: np.stack([parts[p][e] for e in sorted(parts[p])]) for p in parts}
        out[prefix + "gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
        out[prefix + "down_proj"] = stack["down_proj"]
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_fused_expert_layout_loads_the_same(tmp_path, name):
    fused = copy_fixture(name, tmp_path, _fuse_experts)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(os.path.join(fused, "model.safetensors")))
    np.testing.assert_array_equal(logits(fused, name), logits(fixture_dir(name), name))


def test_bfloat16_checkpoint_converts_to_float32(tmp_path):
    import ml_dtypes
    path = copy_fixture("mixtral", tmp_path, lambda t: {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()})
    out = logits(path, "mixtral")
    ref = reference("mixtral")["logits"]
    assert out.dtype == np.float32
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 0.05


def test_tokenizer_is_loaded_when_present():
    engine = moejax.load(fixture_dir("qwen3_moe"), dtype="float32")
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode("the cat").ids
    assert ids and max(ids) < engine.config.vocab_size
    assert moejax.load(fixture_dir("mixtral")).tokenizer is None


def test_missing_unexpected_and_misshaped_are_reported_together(tmp_path):
    def damage(t):
        t = dict(t)
        del t["model.layers.0.self_attn.q_norm.weight"]
        del t["model.layers.2.mlp.experts.1.up_proj.weight"]
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:, :-1]
        t["model.layers.0.mlp.extra.weight"] = np.zeros(3, np.float32)
        return t

    path = copy_fixture("qwen3_moe", tmp_path, damage)
    with pytest.raises(CheckpointError) as err:  # checked from metadata at load, before any weight is read
        moejax.load(path, dtype="float32")
    msg = str(err.value)
    assert "2 missing" in msg and "model.layers.0.self_attn.q_norm.weight" in msg
    assert "model.layers.2.mlp.experts.1.up_proj.weight" in msg
    assert "1 mis-shaped" in msg and "model.layers.0.self_attn.k_proj.weight: shape [32, 31], expected [32, 32]" in msg
    assert "1 unexpected" in msg and "model.layers.0.mlp.extra.weight" in msg


def test_rotary_buffers_in_old_checkpoints_are_not_unexpected(tmp_path):
    def add(t):
        return {**t, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
    path = copy_fixture("mixtral", tmp_path, add)
    np.testing.assert_array_equal(logits(path, "mixtral"), logits(fixture_dir("mixtral"), "mixtral"))


def test_deepseek_v3_multi_token_prediction_layer_is_skipped_with_a_warning(tmp_path):
    def add_mtp(t):  # DeepSeek-V3 checkpoints store the MTP module as one more layer
        return {**t, "model.layers.3.eh_proj.weight": np.zeros((4, 4), np.float32),
                "model.layers.3.mlp.experts.0.up_proj.weight": np.zeros((4, 4), np.float32)}
    path = copy_fixture("deepseek_v3", tmp_path, add_mtp)
    config = json.loads((tmp_path / "deepseek_v3" / "config.json").read_text())
    assert config.get("num_nextn_predict_layers")  # written by transformers' save_pretrained
    with pytest.warns(UserWarning, match="skipped 2 tensors of layers >= 3"):
        engine = moejax.load(path, dtype="float32")
    np.testing.assert_array_equal(engine.logits(reference("deepseek_v3")["input_ids"]),
                                  logits(fixture_dir("deepseek_v3"), "deepseek_v3"))


def test_num_layers_slice_skips_deeper_layers_only():
    ref = reference("qwen3_moe")
    with pytest.warns(UserWarning, match="skipped .* tensors of layers >= 2"):
        engine = moejax.load(fixture_dir("qwen3_moe"), dtype="float32", num_layers=2)
    assert engine.config.num_layers == 2
    assert engine.logits(ref["input_ids"]).shape == ref["logits"].shape


def test_directory_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        moejax.load(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        moejax.load(str(tmp_path))
    shutil.copy(os.path.join(fixture_dir("mixtral"), "config.json"), tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        moejax.load(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="gone.safetensors listed in model.safetensors.index.json is missing"):
        moejax.load(str(tmp_path))


def test_unknown_model_and_options():
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a preset"):
        moejax.load("no-such-model")
    with pytest.raises(TypeError, match="unknown option"):
        moejax.load("tiny-qwen3-moe", windoww=3)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        moejax.load("tiny-qwen3-moe", dtype="int8")


@pytest.mark.parametrize("key, named, expected", [
    ("dtype", None, "float32"),  # the fixture as transformers wrote it: "dtype": "float32"
    ("dtype", "bfloat16", "bfloat16"),
    ("torch_dtype", "float16", "float16"),  # older configs
])
def test_default_dtype_is_the_checkpoints_own(tmp_path, key, named, expected):
    path = copy_fixture("qwen3_moe", tmp_path)
    if named is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.pop("dtype", None)
        config[key] = named
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    engine = moejax.load(path)
    assert engine.dtype.name == expected
    assert moejax.load(path, dtype="float32").dtype.name == "float32"  # an explicit dtype wins


def test_presets_default_to_bfloat16_and_an_unknown_checkpoint_dtype_is_an_error(tmp_path):
    assert moejax.load("tiny-qwen3-moe").dtype.name == "bfloat16"
    path = copy_fixture("qwen3_moe", tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["dtype"] = "float8_e4m3fn"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="config.json has dtype 'float8_e4m3fn'.*pass dtype= explicitly"):
        moejax.load(path)


def test_generation_config_eos_must_be_token_ids(tmp_path):
    path = copy_fixture("qwen3_moe", tmp_path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ["</s>"]}, f)
    with pytest.raises(CheckpointError, match=r"generation_config.json: eos_token_id must be a token id"):
        moejax.load(path)
