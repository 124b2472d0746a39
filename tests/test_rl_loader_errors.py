"""Bad input to the FP8 LoRA loaders: one Fp8kitError line naming the file and what to do, and the model
untouched; save_adapter writes its two files into a directory without disturbing anything else there."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8kit import convert
from fp8kit.errors import Fp8kitError
from fp8kit.quality import load_causal_lm, quiet
from fp8kit.rl import load_adapter, load_fp8_model, save_adapter
from fp8kit.rl.loader import lora_modules

IDS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def fp8_dir(llama_dir, tmp_path_factory):
    return convert(llama_dir, tmp_path_factory.mktemp("fp8") / "dynamic", scheme="dynamic").out


def _model(fp8_dir, seed=0):
    """An FP8 model whose LoRA B matrices are random (LoRA then changes the logits)."""
    model = load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4, lora_alpha=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05, generator=g)
    return model


@pytest.fixture(scope="module")
def adapter(fp8_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "adapter"
    save_adapter(_model(fp8_dir, seed=1), path)
    return path


def _lora_state(model):
    return {n: (m.lora_A.detach().clone(), m.lora_B.detach().clone(), m.scaling)
            for n, m in lora_modules(model).items()}


def _assert_untouched(model, before):
    after = _lora_state(model)
    assert after.keys() == before.keys()
    for n in before:
        assert torch.equal(after[n][0], before[n][0]) and torch.equal(after[n][1], before[n][1]), n
        assert after[n][2] == before[n][2], n


def _one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def _bad_adapter(adapter, tmp_path, config=None, weights=None):
    """A copy of `adapter` with adapter_config.json replaced by `config` (text) or the weights by `weights`."""
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    if config is not None:
        (bad / "adapter_config.json").write_text(config)
    if weights is not None:
        (bad / "adapter_model.safetensors").write_bytes(weights)
    return bad


def test_truncated_adapter_file_is_named(fp8_dir, adapter, tmp_path):
    data = (adapter / "adapter_model.safetensors").read_bytes()
    bad = _bad_adapter(adapter, tmp_path, weights=data[:-100])
    model = _model(fp8_dir)
    before = _lora_state(model)
    with pytest.raises(Fp8kitError) as e:
        load_adapter(model, bad)
    _one_line(e, str(bad / "adapter_model.safetensors"), "truncated", "save the adapter again")
    _assert_untouched(model, before)


def test_pickled_adapter_is_named_and_never_read(fp8_dir, adapter, tmp_path):
    bad = _bad_adapter(adapter, tmp_path)
    (bad / "adapter_model.safetensors").unlink()
    (bad / "adapter_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(Fp8kitError) as e:
        load_adapter(_model(fp8_dir), bad)
    _one_line(e, str(bad / "adapter_model.safetensors"), "adapter_model.bin is a pickle, never read")


def test_adapter_config_without_r_is_named(fp8_dir, adapter, tmp_path):
    config = json.loads((adapter / "adapter_config.json").read_text())
    del config["r"]
    bad = _bad_adapter(adapter, tmp_path, config=json.dumps(config))
    model = _model(fp8_dir)
    before = _lora_state(model)
    with pytest.raises(Fp8kitError) as e:
        load_adapter(model, bad)
    _one_line(e, str(bad / "adapter_config.json"), "`r`")
    _assert_untouched(model, before)  # the weights were not copied in before the config was found wanting


@pytest.mark.parametrize("text, needle", [("[4, 8]", "not a JSON object"), ('{"r": 4,', "not JSON"),
                                          ('{"r": 0, "lora_alpha": 8}', "positive integer"),
                                          ('{"r": 4, "lora_alpha": "8"}', "lora_alpha")],
                         ids=["list", "corrupt", "r-zero", "alpha-string"])
def test_unusable_adapter_config_is_named(fp8_dir, adapter, tmp_path, text, needle):
    bad = _bad_adapter(adapter, tmp_path, config=text)
    model = _model(fp8_dir)
    before = _lora_state(model)
    with pytest.raises(Fp8kitError) as e:
        load_adapter(model, bad)
    _one_line(e, str(bad / "adapter_config.json"), needle)
    _assert_untouched(model, before)


def test_failed_adapter_load_leaves_the_model_untouched(fp8_dir, adapter, tmp_path):
    """A wrong shape in the last tensor is found before any tensor is copied into the model."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    last = sorted(tensors)[-1]
    tensors[last] = torch.zeros(tensors[last].shape[0] + 1, tensors[last].shape[1])
    bad = _bad_adapter(adapter, tmp_path)
    save_file(tensors, bad / "adapter_model.safetensors", metadata={"format": "pt"})
    model = _model(fp8_dir)
    before = _lora_state(model)
    with pytest.raises(Fp8kitError) as e:
        load_adapter(model, bad)
    _one_line(e, str(bad / "adapter_model.safetensors"), last, "shape")
    _assert_untouched(model, before)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "{}", None, "field-type"],
                         ids=["corrupt", "list", "no-model-type", "missing", "field-type"])
def test_unusable_model_config_is_named(fp8_dir, tmp_path, text):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    if text is None:
        (bad / "config.json").unlink()
    elif text == "field-type":  # transformers' StrictDataclassFieldValidationError was a traceback
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": "false"}))
    else:
        (bad / "config.json").write_text(text)
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(bad, dtype=torch.float32)
    _one_line(e, str(bad / "config.json"))


def test_a_model_type_transformers_builds_no_language_model_of_is_one_short_line(fp8_dir, tmp_path):
    """CLIP has no causal-LM class: transformers' ValueError lists every config class it has (thousands of
    characters), which the line does not repeat."""
    import transformers

    bad = tmp_path / "clip"
    shutil.copytree(fp8_dir, bad)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.CLIPConfig(text_config=small, vision_config=small).to_dict()
    config["quantization_config"] = json.loads((Path(fp8_dir) / "config.json").read_text())["quantization_config"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(bad, dtype=torch.float32)
    _one_line(e, str(bad), "builds no causal language model for model_type 'clip'")
    assert len(str(e.value)) < 300, str(e.value)


@pytest.mark.parametrize("keep", [-1000, 4], ids=["tail-cut", "shorter-than-header-length"])
def test_truncated_model_shard_is_named(fp8_dir, tmp_path, keep):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    shard = bad / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:keep])
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(bad, dtype=torch.float32)
    _one_line(e, str(shard), "truncated", "re-download the checkpoint or convert it again")


def _edited_copy(fp8_dir, bad, edit):
    """A copy of the checkpoint at `bad` whose tensors went through `edit` (a dict -> dict function)."""
    shutil.copytree(fp8_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    save_file(edit(tensors), bad / "model.safetensors", metadata={"format": "pt"})
    return bad


O_PROJ = "model.layers.1.self_attn.o_proj"


def test_an_fp8_weight_without_its_scale_is_refused_not_read_as_values(fp8_dir, tmp_path):
    """It loaded as a plain Linear holding the raw FP8 codes (up to 448 where the weights are ~1e-2), logits off by
    ~1, without a word."""
    bad = _edited_copy(fp8_dir, tmp_path / "bad",
                       lambda t: {k: v for k, v in t.items() if k != f"{O_PROJ}.weight_scale"})
    for rank in (4, 0):
        with pytest.raises(Fp8kitError) as e:
            load_fp8_model(bad, dtype=torch.float32, lora_rank=rank)
        _one_line(e, str(bad / "model.safetensors"), f"{O_PROJ}.weight is float8_e4m3fn with no weight scale",
                  "convert it again")


def test_a_shard_the_index_names_must_be_there(fp8_dir, tmp_path):
    """A sharded checkpoint that lost the shard holding one scale: every *.safetensors present was read, the index
    never, and the weight went in unscaled."""
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    (bad / "model.safetensors").unlink()
    scale = f"{O_PROJ}.weight_scale"
    save_file({k: v for k, v in tensors.items() if k != scale}, bad / "model-00001-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors}
    weight_map[scale] = "model-00002-of-00002.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(bad, dtype=torch.float32)
    _one_line(e, "model.safetensors.index.json", "model-00002-of-00002.safetensors, which is missing")


def test_files_beside_the_checkpoints_weights_are_not_read(fp8_dir, tmp_path):
    """model.safetensors alone is the model, as transformers reads it: an adapter saved into the checkpoint's folder
    (model.save_pretrained(path) writes adapter_model.safetensors) made the next load fail."""
    folder = tmp_path / "ckpt"
    shutil.copytree(fp8_dir, folder)
    model = _model(folder)
    model.save_pretrained(folder)
    again = load_fp8_model(folder, dtype=torch.float32, lora_rank=4, lora_alpha=8)
    load_adapter(again, folder)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=0)


def test_per_layer_rotary_tables_of_older_checkpoints_are_skipped(fp8_dir, tmp_path):
    """Older transformers saved `self_attn.rotary_emb.inv_freq` per layer; transformers and fp8-convert take such a
    checkpoint, and the loader refused it ("has no place in the model")."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    bad = _edited_copy(fp8_dir, tmp_path / "bad",
                       lambda t: {**t, "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq})
    with torch.no_grad():
        torch.testing.assert_close(load_fp8_model(bad, dtype=torch.float32)(input_ids=IDS).logits,
                                   load_fp8_model(fp8_dir, dtype=torch.float32)(input_ids=IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize("tensor, value, needle", [
    (f"{O_PROJ}.weight", lambda t: t[:128], "has shape [128, 256], but config.json gives the model [256, 256]"),
    (f"{O_PROJ}.weight", lambda t: t.to(torch.bfloat16), "o_proj.weight is bfloat16 beside its weight_scale"),
    (f"{O_PROJ}.weight_scale", lambda t: t[:100], "weight_scale has shape [100, 1]; dynamic FP8 of a 256x256 weight "
                                                  "needs 256 values"),
    ("model.layers.0.input_layernorm.weight", lambda t: t[:100], "input_layernorm.weight has shape [100]"),
    ("model.embed_tokens.weight", lambda t: t[:300], "embed_tokens.weight has shape [300, 256]"),
], ids=["weight-shape", "weight-dtype", "scale-shape", "norm-shape", "embedding-rows"])
def test_a_tensor_that_does_not_fit_the_config_is_named_at_load(fp8_dir, tmp_path, tensor, value, needle):
    """Each failed at the first forward with a torch error (or at load with a ValueError traceback)."""
    bad = _edited_copy(fp8_dir, tmp_path / "bad", lambda t: {**t, tensor: value(t[tensor]).contiguous()})
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(bad, dtype=torch.float32)
    _one_line(e, str(bad / "model.safetensors"), needle)


def test_a_missing_or_unexpected_bias_is_named(fp8_dir, tmp_path):
    """A bias the config gives a Linear but the checkpoint lacks was a KeyError; one the config does not give it was
    dropped without a word."""
    from fp8kit.models import build_checkpoint

    qwen2 = convert(build_checkpoint(tmp_path / "qwen2", "qwen2", torch.bfloat16, seed=3), tmp_path / "q8",
                    scheme="dynamic").out
    bias = "model.layers.0.self_attn.q_proj.bias"
    bad = _edited_copy(qwen2, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != bias})
    for targets in (None, ["o_proj"]):
        with pytest.raises(Fp8kitError) as e:
            load_fp8_model(bad, dtype=torch.float32, target_modules=targets)
        _one_line(e, str(bad), f"lacks {bias}, which config.json gives the model")
    extra = _edited_copy(fp8_dir, tmp_path / "extra", lambda t: {**t, bias: torch.full((256,), 5.0)})  # a Llama
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(extra, dtype=torch.float32)
    _one_line(e, str(extra / "model.safetensors"), f"{bias} has no place in the model", "gives")


def test_a_loaded_model_is_in_eval_mode_like_from_pretrained(fp8_dir):
    """LoRA dropout was live in a plain forward after loading: two identical forwards differed."""
    model = load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4, lora_dropout=0.5)
    assert not model.training
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.normal_(0, 0.5)
        assert torch.equal(model(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_block_scheme_on_the_cpu_with_the_torch_backend_is_one_line(tmp_path, llama_dir):
    """backend='torch' on the CPU loaded a block model, then its first forward died in torch.cuda (AssertionError)."""
    block = convert(llama_dir, tmp_path / "block", scheme="block").out
    model = load_fp8_model(block, dtype=torch.float32, backend="torch")
    with pytest.raises(Fp8kitError) as e:
        model(input_ids=IDS)
    _one_line(e, "'torch' and 'triton' backends run block FP8 GEMMs on CUDA GPUs only", "'reference'")


def _adapter_files(directory):
    return sorted(p.name for p in directory.iterdir() if "adapter" in p.name)


def test_save_adapter_keeps_unrelated_files_and_round_trips(fp8_dir, llama_dir, tmp_path, monkeypatch):
    from peft import PeftModel

    work = tmp_path / "run"
    (work / "logs").mkdir(parents=True)
    (work / "notes.txt").write_text("keep me")
    (work / "logs" / "train.log").write_text("step 1")
    model = _model(fp8_dir, seed=2)
    monkeypatch.chdir(work)
    assert save_adapter(model, ".", base_model_name_or_path=str(llama_dir)) == Path(".")
    assert (work / "notes.txt").read_text() == "keep me" and (work / "logs" / "train.log").read_text() == "step 1"
    assert _adapter_files(work) == ["adapter_config.json", "adapter_model.safetensors"]  # no temporaries
    assert os.stat(work / "adapter_model.safetensors").st_mode & 0o777 == 0o666 & ~_umask()

    # Saving again replaces the adapter and still leaves the rest alone; the base may be a Path, not another type.
    model = _model(fp8_dir, seed=3)
    with pytest.raises(Fp8kitError, match=r"base_model_name_or_path=3: expected the base model's Hub name"):
        save_adapter(model, work, base_model_name_or_path=3)
    save_adapter(model, work, base_model_name_or_path=llama_dir)
    assert json.loads((work / "adapter_config.json").read_text())["base_model_name_or_path"] == str(llama_dir)
    assert sorted(p.name for p in work.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "logs",
                                                      "notes.txt"]
    fresh = _model(fp8_dir, seed=4)
    load_adapter(fresh, work)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=IDS).logits, model(input_ids=IDS).logits)
    with quiet():
        base = load_causal_lm(llama_dir, torch.float32)
    peft_model = PeftModel.from_pretrained(base, work)
    checked = 0
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            ours = model.get_submodule(name)
            assert torch.equal(module.lora_B["default"].weight, ours.lora_B)
            assert module.scaling["default"] == ours.scaling
            checked += 1
    assert checked == len(lora_modules(model))

    # A save that fails part-way leaves the previous adapter, the other files, and no temporaries.
    previous = {n: (work / n).read_bytes() for n in _adapter_files(work)}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("fp8kit.converter.safetensors_io.save_small", disk_full)
    with pytest.raises(Fp8kitError) as e:
        save_adapter(_model(fp8_dir, seed=5), work)
    _one_line(e, str(work), "No space left on device", "free disk space")
    assert {n: (work / n).read_bytes() for n in _adapter_files(work)} == previous
    assert sorted(p.name for p in work.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "logs",
                                                      "notes.txt"]


def test_save_adapter_creates_a_missing_directory_but_never_replaces_a_file(fp8_dir, tmp_path):
    model = _model(fp8_dir)
    save_adapter(model, tmp_path / "new" / "adapter")
    assert _adapter_files(tmp_path / "new" / "adapter") == ["adapter_config.json", "adapter_model.safetensors"]
    target = tmp_path / "occupied"
    target.write_text("a file, not a folder")
    with pytest.raises(Fp8kitError) as e:
        save_adapter(model, target)
    _one_line(e, str(target), "not a directory")
    assert target.read_text() == "a file, not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "occupied"]


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_rslora_scaling_matches_peft(fp8_dir, adapter, tmp_path):
    """use_rslora: scaling alpha / sqrt(r), as peft's own LoRA layer computes it for the same config."""
    from peft import LoraConfig, get_peft_model

    config = json.loads((adapter / "adapter_config.json").read_text())
    bad = _bad_adapter(adapter, tmp_path, config=json.dumps({**config, "use_rslora": True}))
    model = load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4, lora_alpha=8)
    load_adapter(model, bad)
    reference = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)),
                               LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"], use_rslora=True,
                                          target_modules=["0"]))
    want = reference.base_model.model[0].scaling["default"]
    assert want != config["lora_alpha"] / config["r"]
    assert {m.scaling for m in lora_modules(model).values()} == {want}


@pytest.mark.parametrize("key", ["rank_pattern", "alpha_pattern"])
def test_per_module_patterns_are_refused(fp8_dir, adapter, tmp_path, key):
    config = json.loads((adapter / "adapter_config.json").read_text())
    bad = _bad_adapter(adapter, tmp_path, config=json.dumps({**config, key: {"q_proj": 16}}))
    model = load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4, lora_alpha=8)
    before = _lora_state(model)
    with pytest.raises(Fp8kitError) as excinfo:
        load_adapter(model, bad)
    _one_line(excinfo, str(bad / "adapter_config.json"), f"`{key}`")
    _assert_untouched(model, before)


def test_save_interrupted_between_its_two_files_is_refused_on_load(fp8_dir, tmp_path, monkeypatch):
    """The weights renamed into place, then the config's rename fails: the folder holds new weights with the old
    config. With the same rank and another lora_alpha it would load with the wrong scaling; it is refused."""
    work = tmp_path / "adapter"
    save_adapter(_model(fp8_dir, seed=1), work)  # lora_alpha 8
    newer = load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4, lora_alpha=16)
    real_replace = os.replace

    def config_rename_fails(src, dst):
        if Path(dst).name == "adapter_config.json":
            raise OSError(5, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", config_rename_fails)
    with pytest.raises(Fp8kitError):
        save_adapter(newer, work)
    monkeypatch.setattr(os, "replace", real_replace)
    assert json.loads((work / "adapter_config.json").read_text())["lora_alpha"] == 8
    model = _model(fp8_dir)
    before = _lora_state(model)
    with pytest.raises(Fp8kitError) as e:
        load_adapter(model, work)
    _one_line(e, str(work / "adapter_model.safetensors"), "lora_alpha=16.0", "says 8.0", "save the adapter again")
    _assert_untouched(model, before)
    save_adapter(newer, work)  # a whole save loads again
    load_adapter(model, work)
    assert {m.scaling for m in lora_modules(model).values()} == {4.0}


@pytest.mark.parametrize("kwargs,needle", [
    (dict(target_modules=["qproj"]), "target_modules 'qproj' matches no Linear"),
    (dict(target_modules=["embed_tokens"]), "target_modules 'embed_tokens' matches no Linear"),  # an Embedding
    (dict(target_modules=["self_attn.q_proj"]), "'self_attn.q_proj' is not a leaf name"),
    (dict(target_modules=[]), "target_modules=[]"),
    (dict(lora_rank=-1), "lora_rank=-1"),
    (dict(lora_rank=2.5), "lora_rank=2.5"),
    (dict(lora_alpha="16"), "lora_alpha='16'"),
    (dict(lora_alpha=-1), "lora_alpha=-1: expected a number > 0"),
    (dict(lora_alpha=float("nan")), "lora_alpha=nan"),
    (dict(lora_dropout=1.5), "lora_dropout=1.5"),
    (dict(device="gpu"), "device='gpu': not a device"),
    (dict(device="meta"), "device='meta': the FP8 layers run on 'cpu' or 'cuda'"),
], ids=["typo", "embedding", "dotted", "empty", "rank-negative", "rank-float", "alpha-string", "alpha-negative",
        "alpha-nan", "dropout", "device-name", "device-kind"])
def test_lora_arguments_are_checked_in_one_line(fp8_dir, kwargs, needle):
    """Each once gave a torch traceback, or (target_modules) a model with no LoRA at all."""
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(fp8_dir, dtype=torch.float32, **kwargs)
    _one_line(e, needle)


def test_target_modules_as_one_string_means_that_module(fp8_dir):
    model = load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4, target_modules="q_proj")
    assert lora_modules(model) and {n.rsplit(".", 1)[-1] for n in lora_modules(model)} == {"q_proj"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_device_without_a_gpu_is_one_line(fp8_dir):
    with pytest.raises(Fp8kitError) as e:
        load_fp8_model(fp8_dir, dtype=torch.float32, device="cuda")
    _one_line(e, "device='cuda'", "no CUDA GPU")
    with pytest.raises(Fp8kitError) as e:  # an index means that CUDA GPU
        load_fp8_model(fp8_dir, dtype=torch.float32, device=3)
    _one_line(e, "device=3:", "no CUDA GPU")


def test_vllm_rollouts_on_a_second_gpu_are_refused_before_anything_loads(monkeypatch):
    """vLLM's worker takes cuda:0 and the trainer's weights are views of its parameters: cuda:1 was ignored."""
    import fp8kit.rl.model as rl_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(rl_model, "_vllm_available", lambda: True)
    with pytest.raises(Fp8kitError) as e:  # a name the registry does not know: the device check comes first
        rl_model.load_model("org/not-a-model", device="cuda:1")
    _one_line(e, "device='cuda:1'", "CUDA_VISIBLE_DEVICES=1", "fast_inference=False")


@pytest.mark.parametrize("device", ["cpu:0", "cpu:1", torch.device("cpu", 3)])
def test_any_cpu_index_means_the_cpu(fp8_dir, device):
    """'cpu:1' passed the device check, then safetensors refused it with a message blaming the checkpoint."""
    from fp8kit.rl.loader import check_device

    model = load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4, device=device)
    assert check_device(device) == torch.device("cpu")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


@pytest.mark.parametrize("kwargs,needle", [(dict(dtype=torch.float32, lora_rank=8), "need torch.bfloat16"),
                                           (dict(lora_rank=4), "vLLM serves LoRA ranks")], ids=["float32", "rank"])
def test_vllm_arguments_are_refused_before_any_conversion(monkeypatch, llama_dir, kwargs, needle):
    """vLLM's dtype and LoRA rank checks ran only after the checkpoint had been converted (minutes for a large one)."""
    import fp8kit.rl.model as rl_model

    converted = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(rl_model, "_vllm_available", lambda: True)
    monkeypatch.setattr(rl_model, "_checkpoint", lambda *a: converted.append(a) or pytest.fail("converted first"))
    with pytest.raises(Fp8kitError) as e:
        rl_model.load_model(str(llama_dir), device="cuda", **kwargs)
    _one_line(e, needle)
    assert not converted


def test_static_activation_scales_on_channel_weights_are_refused_for_vllm_rollouts_naming_the_weights(
        monkeypatch, fp8_dir, tmp_path):
    """vLLM would quantize with the checkpoint's static scales and the trainer per token; the refusal named every such
    checkpoint tensor-static, per-channel weights included (llm-compressor's FP8 with static activations)."""
    import fp8kit.rl.model as rl_model
    from fp8kit.rl import vllm_engine

    static = tmp_path / "channel-static"
    shutil.copytree(fp8_dir, static)
    config = json.loads((static / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"].update(dynamic=False, strategy="tensor")
    (static / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(rl_model, "_vllm_available", lambda: True)
    monkeypatch.setattr(rl_model, "_check_vllm_model", lambda *a: None)  # vLLM's own checks need vLLM installed
    monkeypatch.setattr(vllm_engine, "VLLMRollout", lambda *a, **k: pytest.fail("the engine started"))
    with pytest.raises(Fp8kitError) as e:
        rl_model.load_model(str(static), device="cuda", lora_rank=8)
    _one_line(e, f"{static}: static activation scales (per-channel weights)", "--scheme tensor or dynamic")


def test_a_second_vllm_engine_in_the_process_is_refused_before_any_conversion(monkeypatch, llama_dir):
    """vLLM's sleep-mode allocator serves one engine per process at a time: with an earlier engine's memory in its pool
    (made here: the allocator module as vLLM leaves it), load_model is refused before converting anything, and the
    message says what frees it: unload_model while that engine is open, a restart for what no open engine owns."""
    import sys
    import types

    import fp8kit.rl.model as rl_model
    from fp8kit.rl import vllm_engine

    converted = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(rl_model, "_vllm_available", lambda: True)
    monkeypatch.setattr(rl_model, "_checkpoint", lambda *a: converted.append(a) or pytest.fail("converted first"))
    pool = types.SimpleNamespace(get_current_usage=lambda: 3 << 30)
    cumem = types.SimpleNamespace(CuMemAllocator=types.SimpleNamespace(instance=pool))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    monkeypatch.setattr(vllm_engine, "OPEN_ENGINES", {1})
    with pytest.raises(Fp8kitError) as e:
        rl_model.load_model(str(llama_dir), device="cuda", lora_rank=8)
    _one_line(e, "a vLLM engine of an earlier load_model holds 3.0 GiB in this process, and vLLM runs one engine "
                 "per process at a time: call fp8kit.rl.unload_model on that model first")
    vllm_engine.OPEN_ENGINES.clear()  # what an engine shut down left (34 MiB on an H100 before initialize_early)
    pool.get_current_usage = lambda: 34 << 20
    with pytest.raises(Fp8kitError) as e:
        rl_model.load_model(str(llama_dir), device="cuda", lora_rank=8)
    _one_line(e, "vLLM's memory pool holds 34 MiB that no open engine owns")
    assert "restart Python" in str(e.value)
    pool.get_current_usage = lambda: 0  # its memory released: not refused for it (this folder has no tokenizer)
    with pytest.raises(Fp8kitError, match="no tokenizer files"):
        rl_model.load_model(str(llama_dir), device="cuda", lora_rank=8)
    assert not converted


def test_deepgemm_is_initialized_before_the_engine_for_quantized_checkpoints_only(monkeypatch):
    """vLLM initializes DeepGEMM's runtime as it builds its first FP8 layer, inside the engine's weight pool, where its
    32 MiB outlived the engine and refused the next one (evals/engine_unload.py); fp8kit initializes it first."""
    import sys
    import types

    from fp8kit.rl.vllm_engine import initialize_early

    calls = []
    deep_gemm = types.ModuleType("vllm.utils.deep_gemm")
    deep_gemm.is_deep_gemm_e8m0_used = lambda: calls.append("init") or False
    monkeypatch.setitem(sys.modules, "vllm.utils.deep_gemm", deep_gemm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    initialize_early(quantized=False)
    assert calls == []
    initialize_early(quantized=True)
    assert calls == ["init"]


def test_unload_model_shuts_the_engine_down_and_frees_the_models_tensors(monkeypatch, fp8_dir, tmp_path):
    """vLLM freezes its engine out of the garbage collector's reach, so `del model` freed none of its memory. Here an
    engine as load_model leaves it, its LLM a stand-in that records its shutdown, and vLLM's LoRA kernels' pointer
    cache holding a buffer (test_gpu_grpo.py runs the real engine): unload_model shuts the engine down, empties the
    cache, and drops every tensor of the model though another reference to it is kept; both refuse work after
    (the model: training, saving or loading an adapter)."""
    import gc
    import sys
    import types
    import weakref

    from fp8kit.rl import unload_model
    from fp8kit.rl.grpo import train
    from fp8kit.rl.vllm_engine import VLLMRollout

    shut = []
    lora_ops = types.ModuleType("vllm.lora.ops.triton_ops.utils")
    lora_ops._LORA_A_PTR_DICT = {(1, 2): (torch.zeros(4),)}
    lora_ops._LORA_B_PTR_DICT = {(3,): (torch.zeros(4),)}
    monkeypatch.setitem(sys.modules, lora_ops.__name__, lora_ops)
    model = load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4)
    engine = VLLMRollout.__new__(VLLMRollout)
    core = types.SimpleNamespace(shutdown=lambda: shut.append("engine core"))
    engine.llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=core))
    engine.path, engine.asleep, engine.runner, engine.vllm_model = Path("tiny"), False, object(), object()
    engine._manager = engine.lora_request = None
    model.rollout_engine = engine
    held = model  # another reference, as a notebook's Out[] keeps one
    tensors = [weakref.ref(t) for t in [*model.parameters(), *model.buffers()]]
    unload_model(model)
    del model
    gc.collect()
    assert shut == ["engine core"] and engine.llm is None and engine.vllm_model is None
    assert lora_ops._LORA_A_PTR_DICT == {} and lora_ops._LORA_B_PTR_DICT == {}
    assert all(r() is None for r in tensors)  # nothing kept a tensor of the model, nor a view of one
    assert all(t.is_meta for t in [*held.parameters(), *held.buffers()])
    unload_model(held)  # again: nothing left to do
    assert shut == ["engine core"]
    with pytest.raises(Fp8kitError) as e:
        train(held, None, ["the quick"], [lambda completions, **_: [0.0] * len(completions)])
    _one_line(e, "model: freed by unload_model; train a model from load_model")
    from fp8kit.rl import load_adapter, save_adapter

    for save in (lambda: save_adapter(held, tmp_path / "adapter"), lambda: held.save_pretrained(tmp_path / "adapter")):
        with pytest.raises(Fp8kitError) as e:  # was torch's "Cannot copy out of meta tensor"
            save()
        _one_line(e, "model: freed by unload_model; its adapter went with it: save the adapter before unload_model")
        assert not (tmp_path / "adapter").exists()
    saved = save_adapter(load_fp8_model(fp8_dir, dtype=torch.float32, lora_rank=4), tmp_path / "saved")
    with pytest.raises(Fp8kitError) as e:  # it returned, having copied into meta tensors: nothing loaded
        load_adapter(held, saved)
    _one_line(e, "model: freed by unload_model; load the adapter into a model from load_model")
    for call in (lambda: engine.generate([[1, 2]], 2, 4), engine.sleep, lambda: engine.sync_lora(held)):
        with pytest.raises(Fp8kitError) as e:
            call()
        _one_line(e, "the vLLM engine for tiny was shut down (unload_model): load the model again with load_model")
    with pytest.raises(Fp8kitError) as e:
        unload_model("model")
    _one_line(e, "unload_model('model'): expected a model from load_model")


def test_an_engine_whose_training_model_fails_is_shut_down(monkeypatch, fp8_dir, tmp_path):
    """An error while the trainer is assembled on the engine's weights left the engine running, unreachable, with
    its memory: load_model shuts it down before the error reaches the caller."""
    import fp8kit.rl.model as rl_model
    from fp8kit.models import add_tokenizer
    from fp8kit.rl import vllm_engine

    local = tmp_path / "tiny"
    shutil.copytree(fp8_dir, local)
    add_tokenizer(local, "the quick brown fox jumps over the lazy dog " * 20, vocab_size=300)
    events = []

    class Engine:  # VLLMRollout's part load_model uses, without a GPU
        def __init__(self, path, **kwargs):
            events.append("started")

        def training_model(self, *args, **kwargs):
            raise Fp8kitError("vLLM has no LoRA slot for 1 of the model's LoRA modules")

        def close(self):
            events.append("closed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(rl_model, "_vllm_available", lambda: True)
    monkeypatch.setattr(rl_model, "_check_vllm_model", lambda *a: None)
    monkeypatch.setattr(vllm_engine, "VLLMRollout", Engine)
    with pytest.raises(Fp8kitError, match="no LoRA slot"):
        rl_model.load_model(str(local), device="cuda", lora_rank=8)
    assert events == ["started", "closed"]


def test_local_model_path_is_stored_expanded_and_absolute(fp8_dir, tmp_path, monkeypatch):
    """load_model('~/x') named the base '~/x' in saved adapters, a path peft cannot open."""
    from fp8kit.models import add_tokenizer
    from fp8kit.rl.model import load_model

    home = tmp_path / "home"
    local = home / "models" / "tiny"
    shutil.copytree(fp8_dir, local)
    add_tokenizer(local, "the quick brown fox jumps over the lazy dog " * 20, vocab_size=300)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    for name in ("~/models/tiny", "models/tiny"):
        model, _ = load_model(name, lora_rank=4, dtype=torch.float32, device="cpu")
        assert model.name_or_path == str(local.resolve())
        save_adapter(model, tmp_path / "adapter")
        saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
        assert saved["base_model_name_or_path"] == str(local.resolve())
