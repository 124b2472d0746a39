"""--kv-cache fp8: calibrated FP8 KV-cache scales in the checkpoint, measured as llm-compressor measures them."""

import json
import shutil
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from fp8kit import convert
from fp8kit.cli import fp8_convert
from fp8kit.converter.calibration import calibration_ids, checkpoint_prefix
from fp8kit.converter.schemes import scale_from_amax
from fp8kit.errors import Fp8kitError
from fp8kit.models import add_tokenizer, build_checkpoint
from fp8kit.quality import load_causal_lm, logit_drift, quiet

# 1,500-2,000 tokens with the tokenizer trained on it: four calibration sequences of at most 512 (the scales
# are maxima over all of them)
TEXT = " ".join(f"Sentence {i} tells the quick brown fox to jump over {i % 7} lazy dogs." for i in range(120))


def kv_scales(directory):
    scales = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            scales.update({k: sf.get_tensor(k) for k in sf.keys() if k.endswith((".k_scale", ".v_scale"))})
    return scales


def recomputed_scales(src, seq_len=512):
    """The reference: each attention module's keys and values recomputed from its inputs with its own k_proj,
    v_proj, key norm and RoPE, while the model runs with transformers' default attention and masks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    amax = {}

    def hook(module, args, kwargs, output, name):
        h = kwargs["hidden_states"]
        shape = (*h.shape[:-1], -1, module.head_dim)
        k = module.k_proj(h).view(shape).transpose(1, 2)
        v = module.v_proj(h).view(shape).transpose(1, 2)
        if hasattr(module, "k_norm"):
            k = module.k_norm(k)
        cos, sin = kwargs["position_embeddings"]
        _, k = sys.modules[type(module).__module__].apply_rotary_pos_emb(k, k, cos, sin)
        for kind, states in (("k", k), ("v", v)):
            amax[f"{name}.{kind}_scale"] = max(amax.get(f"{name}.{kind}_scale", 0.0), states.abs().max().float().item())

    for name, module in model.named_modules():
        if hasattr(module, "k_proj") and hasattr(module, "v_proj"):
            module.register_forward_hook(lambda m, a, kw, out, name=name: hook(m, a, kw, out, name), with_kwargs=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    with torch.no_grad():
        for ids in calibration_ids(tokenizer, TEXT, seq_len):
            model(input_ids=torch.tensor([ids]))
    return {k: scale_from_amax(torch.tensor(a), torch.bfloat16) for k, a in amax.items()}


@pytest.fixture(scope="module")
def qwen3_src(tmp_path_factory):
    """Qwen3 normalizes keys before RoPE: the cached keys are neither k_proj's output nor its norm's."""
    src = build_checkpoint(tmp_path_factory.mktemp("kv") / "src", "qwen3", torch.bfloat16, seed=3)
    add_tokenizer(src, TEXT)
    calibration = src.parent / "calibration.txt"
    calibration.write_text(TEXT)
    return src, calibration


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "mistral", "llama"])
def test_scales_are_the_cached_keys_and_values(tmp_path, arch):
    """Qwen3 and Gemma3 normalize keys before RoPE; Gemma3 and Mistral have sliding windows (64 tokens here)
    shorter than the 512-token calibration sequences, which the model's own masks must keep."""
    src = build_checkpoint(tmp_path / "src", arch, torch.bfloat16, seed=3)
    add_tokenizer(src, TEXT)
    (tmp_path / "calibration.txt").write_text(TEXT)
    # several source shards: the scales join the index as one more shard
    report = convert(src, tmp_path / "out", scheme="block", kv_cache="fp8", calibration=tmp_path / "calibration.txt",
                     max_shard_size="1MB")
    assert "FP8 KV-cache scales calibrated on 4 sequences from calibration.txt" in report.warnings
    from transformers import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert not [k for k in list(ALL_ATTENTION_FUNCTIONS) + list(AttentionMaskInterface._global_mapping)
                if k.startswith("fp8kit")]  # the observer is gone once the conversion is done
    ours = kv_scales(tmp_path / "out")
    reference = recomputed_scales(src)
    assert sorted(ours) == sorted(reference) and len(ours) == 2 * json.loads((src / "config.json").read_text())[
        "num_hidden_layers"]
    for name, scale in ours.items():
        assert scale.dtype == torch.bfloat16 and scale.shape == (1,)
        assert float(scale) == float(reference[name]), name
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    kv = q["kv_cache_scheme"]
    # the fields vLLM 0.25 checks before it turns on its FP8 KV cache (validate_kv_cache_scheme)
    assert (kv["type"], kv["num_bits"], kv["strategy"], kv["symmetric"], kv["dynamic"]) == ("float", 8, "tensor",
                                                                                           True, False)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert set(ours) <= set(index["weight_map"]) and all(index["weight_map"][k] == files[-1] for k in ours)
    stored = 0
    for f in files:
        with safe_open(tmp_path / "out" / f, "pt") as sf:
            stored += sum(sf.get_tensor(k).nbytes for k in sf.keys())
    assert index["metadata"]["total_size"] == stored


def test_checkpoint_names_of_renamed_attention_modules():
    keys = ["language_model.model.layers.0.self_attn.k_proj.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight"]
    assert checkpoint_prefix("model.language_model.layers.0.self_attn", keys) == "language_model.model.layers.0.self_attn"
    assert checkpoint_prefix("model.layers.3.self_attn", ["model.layers.3.self_attn.k_proj.weight"]) == \
        "model.layers.3.self_attn"
    with pytest.raises(Fp8kitError, match="0 checkpoint tensors end in layers.1.self_attn.k_proj.weight"):
        checkpoint_prefix("model.layers.1.self_attn", keys)
    # a vision tower's encoder layers end alike; the calibration text never reaches them
    keys.append("vision_tower.encoder.layers.0.self_attn.k_proj.weight")
    assert checkpoint_prefix("model.language_model.layers.0.self_attn", keys) == "language_model.model.layers.0.self_attn"


def test_multimodal_scales_land_on_the_language_model(tmp_path):
    """Gemma 3 multimodal: `layers.0.self_attn.k_proj.weight` ends a vision-tower tensor too, which made the
    conversion fail ("2 checkpoint tensors end in ..."). The scales are the language model's attention's."""
    src = build_checkpoint(tmp_path / "src", "gemma3_mm", torch.bfloat16, seed=3)
    add_tokenizer(src, TEXT, vocab_size=400)  # below the image token ids
    (tmp_path / "calibration.txt").write_text(TEXT)
    report = convert(src, tmp_path / "out", scheme="dynamic", kv_cache="fp8", calibration=tmp_path / "calibration.txt",
                     device="cpu")
    ours = kv_scales(tmp_path / "out")
    assert sorted(ours) == [f"language_model.model.layers.{i}.self_attn.{k}_scale" for i in range(2) for k in "kv"]
    assert all(s.dtype == torch.bfloat16 and s.shape == (1,) and float(s) > 0 for s in ours.values())
    assert not [m for m in report.quantized if "vision" in m]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert {index["weight_map"][k] for k in ours} == {"model-00002-of-00002.safetensors"}
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert q["kv_cache_scheme"]["type"] == "float" and "vision_tower.encoder.layers.0.self_attn.k_proj" in q["ignore"]


def test_full_disk_while_writing_the_scales_is_one_line(tmp_path, qwen3_src, monkeypatch):
    """The scales' shard is written last, once the weights fit: a full disk there is one line naming that shard,
    exit 1, nothing at OUT (safetensors' save_file raised its own SafetensorError)."""
    import errno
    import os

    from fp8kit.converter import streaming

    src, calibration = qwen3_src

    def full_disk(tensors, path, metadata=None):
        path.write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(streaming, "save_small", full_disk)
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(src), str(out), "--scheme", "dynamic", "--kv-cache", "fp8",
                                              "--calibration", str(calibration), "--device", "cpu"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, (result.stderr, result.exception)
    assert errors[0] == (f"error: {out / 'model-00002-of-00002.safetensors'}: cannot write (No space left on "
                         f"device); free disk space or choose another OUT")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_scales_shard_is_what_safetensors_writes(tmp_path, qwen3_src):
    """The scales' shard is written by fp8kit's own writer now: the same bytes safetensors' save_file writes."""
    from safetensors.torch import save_file

    src, calibration = qwen3_src
    convert(src, tmp_path / "out", scheme="dynamic", kv_cache="fp8", calibration=calibration, device="cpu")
    shard = tmp_path / "out" / "model-00002-of-00002.safetensors"
    save_file(kv_scales(tmp_path / "out"), tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert shard.read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_scales_match_llmcompressor_and_serve_in_transformers(tmp_path, qwen3_src):
    pytest.importorskip("llmcompressor")
    src, calibration = qwen3_src
    convert(src, tmp_path / "dyn", scheme="dynamic", kv_cache="fp8", calibration=calibration)
    ours = kv_scales(tmp_path / "dyn")
    assert sorted(ours) == [f"model.layers.{i}.self_attn.{k}_scale" for i in range(2) for k in "kv"]

    # the reference: llm-compressor's own KV-cache calibration (static min-max observer) in the same run as its
    # static activation scales, on the same text
    convert(src, tmp_path / "static", scheme="tensor-static", kv_cache="fp8", calibration=calibration)
    reference = kv_scales(tmp_path / "static")
    assert sorted(reference) == sorted(ours)
    for name, scale in ours.items():
        assert scale.dtype == reference[name].dtype == torch.bfloat16 and scale.shape == (1,)
        # both divide a BF16 maximum by 448; one BF16 rounding apart at most
        torch.testing.assert_close(scale.float(), reference[name].float(), rtol=2 ** -7, atol=0)
    values = torch.cat([v.float() for k, v in ours.items() if k.endswith("v_scale")])
    keys = torch.cat([v.float() for k, v in ours.items() if k.endswith("k_scale")])
    assert not torch.allclose(values, keys)  # keys and values measured apart

    # transformers (compressed-tensors) reads the scales and quantizes its KV states with them
    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "dyn", plain)
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = None
    (plain / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with quiet(), torch.no_grad():
        source = load_causal_lm(src)(input_ids=ids).logits
        with_kv = load_causal_lm(tmp_path / "dyn")(input_ids=ids).logits
        without_kv = load_causal_lm(plain)(input_ids=ids).logits
    assert not torch.equal(with_kv, without_kv)
    assert logit_drift(source, with_kv)["kl"] < 5e-3


def test_rl_loader_reads_a_kv_cache_checkpoint(tmp_path, qwen3_src):
    from fp8kit.rl import load_fp8_model

    src, calibration = qwen3_src
    convert(src, tmp_path / "dyn", scheme="dynamic", kv_cache="fp8", calibration=calibration)
    model = load_fp8_model(tmp_path / "dyn", dtype=torch.float32, lora_rank=4)
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, model.config.vocab_size)


def test_vllm_scale_check_pairs_attention_layers_with_checkpoint_names(tmp_path, qwen3_src):
    """evals/vllm_load.py's check on the GPU (tests/test_gpu.py runs it in vLLM): vLLM's `...self_attn.attn`
    layers against the checkpoint's `...self_attn.k_scale`/`v_scale`; a changed or absent scale is reported."""
    from evals.vllm_load import kv_scale_agreement

    src, calibration = qwen3_src
    convert(src, tmp_path / "dyn", scheme="dynamic", kv_cache="fp8", calibration=calibration)
    stored = {k: v.float().item() for k, v in kv_scales(tmp_path / "dyn").items()}
    layers = sorted({k.rsplit(".", 1)[0] for k in stored})
    loaded = {f"{layer}.attn": [stored[f"{layer}.k_scale"], stored[f"{layer}.v_scale"], "fp8"] for layer in layers}
    agreement = kv_scale_agreement(tmp_path / "dyn", loaded)
    assert agreement["layers"] == len(layers) == 2 and agreement["checkpoint_scales"] == 4
    assert agreement["scales_equal"] == 4 and agreement["mismatched"] == [] and agreement["kv_cache_dtypes"] == ["fp8"]
    loaded[f"{layers[0]}.attn"][1] = 1.0  # vLLM's value when it finds no scale
    loaded["model.layers.9.self_attn.attn"] = [0.5, 0.5, "fp8"]
    agreement = kv_scale_agreement(tmp_path / "dyn", loaded)
    assert agreement["scales_equal"] == 3
    assert agreement["mismatched"] == [[f"{layers[0]}.v_scale", stored[f"{layers[0]}.v_scale"], 1.0],
                                       ["model.layers.9.self_attn.k_scale", None, 0.5],
                                       ["model.layers.9.self_attn.v_scale", None, 0.5]]


def test_bad_kv_cache_requests_leave_nothing(tmp_path, llama_dir, qwen3_src):
    src, _ = qwen3_src
    out = tmp_path / "out"
    runner = CliRunner()
    result = runner.invoke(fp8_convert, [str(src), str(out), "--scheme", "block", "--format", "fp8", "--kv-cache", "fp8"])
    assert result.exit_code == 1 and "compressed-tensors format only" in result.stderr and not out.exists()
    # llama_dir has no tokenizer: nothing to calibrate with
    result = runner.invoke(fp8_convert, [str(llama_dir), str(out), "--scheme", "dynamic", "--kv-cache", "fp8"])
    assert result.exit_code == 1 and "--kv-cache fp8 needs the model's tokenizer" in result.stderr
    assert not out.exists()
    result = runner.invoke(fp8_convert, [str(src), str(out), "--scheme", "dynamic", "--kv-cache", "fp8",
                                         "--calibration", str(tmp_path / "missing.txt")])
    assert result.exit_code == 1 and "missing.txt: cannot read the calibration text" in result.stderr
    assert not out.exists()


def test_kv_cache_value_and_out_of_memory(tmp_path, qwen3_src, monkeypatch):
    import transformers

    src, calibration = qwen3_src
    with pytest.raises(Fp8kitError, match="--kv-cache 'int8': expected one of fp8"):
        convert(src, tmp_path / "out", scheme="dynamic", kv_cache="int8")

    def too_big(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", too_big)
    with pytest.raises(Fp8kitError, match="ran out of memory on cpu; pass --device cpu"):
        convert(src, tmp_path / "out", scheme="dynamic", kv_cache="fp8", calibration=calibration)
    assert not (tmp_path / "out").exists()


def test_attention_outside_transformers_interface_is_refused(tmp_path, qwen3_src, monkeypatch):
    """An attention module that never calls transformers' attention interface (as remote-code models may) leaves
    nothing to measure: a clear error and no output, instead of a checkpoint without scales."""
    from transformers.models.qwen3 import modeling_qwen3

    src, calibration = qwen3_src

    def own_attention(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return self.o_proj(self.q_proj(hidden_states)), None  # Qwen3 here: q_proj's width is o_proj's input

    monkeypatch.setattr(modeling_qwen3.Qwen3Attention, "forward", own_attention)
    with pytest.raises(Fp8kitError, match="no attention layer ran through transformers' attention interface"):
        convert(src, tmp_path / "out", scheme="dynamic", kv_cache="fp8", calibration=calibration)
    assert not (tmp_path / "out").exists()


def test_missing_tokenizer_is_one_line(tmp_path, llama_dir):
    """transformers explains a missing tokenizer over five lines; the user gets one, naming the checkpoint."""
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(llama_dir), str(out), "--scheme", "dynamic", "--kv-cache", "fp8"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {llama_dir}: --kv-cache fp8 needs the model's tokenizer to calibrate")
    assert f"copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) into {llama_dir}" in lines[0]
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def overflowing_fp16_model(directory):
    """A float16 Llama with finite weights whose layer-1 keys overflow float16 (k_proj filled with 60000)."""
    from safetensors.torch import load_file, save_file

    src = build_checkpoint(directory, "llama", torch.float16, seed=2)
    add_tokenizer(src, TEXT)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"].fill_(60000.0)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (directory.parent / "calibration.txt").write_text(TEXT)
    return src, directory.parent / "calibration.txt"


def test_keys_that_overflow_the_source_dtype_are_refused(tmp_path):
    """vLLM would serve a NaN k_scale as NaN: one line naming the layer, and no output."""
    src, calibration = overflowing_fp16_model(tmp_path / "src")
    out = tmp_path / "out"
    result = CliRunner().invoke(fp8_convert, [str(src), str(out), "--scheme", "dynamic", "--kv-cache", "fp8",
                                              "--calibration", str(calibration), "--device", "cpu"])
    assert result.exit_code == 1 and not out.exists(), result.output
    last = result.stderr.strip().splitlines()[-1]  # the one line, after transformers' progress bar
    assert "keys of model.layers.1.self_attn reach" in last and "bfloat16 or float32 copy" in last, last


def test_mistral3_calibrates_and_validates_through_its_own_class(tmp_path):
    """No causal-LM auto class maps Mistral 3: --kv-cache fp8 and tensor-static loaded it with AutoModelForCausalLM
    and were refused, and so was the validation that `fp8kit publish` runs (load_causal_lm)."""
    src = build_checkpoint(tmp_path / "src", "mistral3", torch.bfloat16, seed=3)
    add_tokenizer(src, TEXT)
    convert(src, tmp_path / "kv", scheme="dynamic", kv_cache="fp8")
    assert kv_scales(tmp_path / "kv")
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    with quiet(), torch.no_grad():
        source = load_causal_lm(src)(input_ids=ids).logits
        with_kv = load_causal_lm(tmp_path / "kv")(input_ids=ids).logits
    assert logit_drift(source, with_kv)["kl"] < 5e-3
    import importlib.util

    if importlib.util.find_spec("llmcompressor") is None:  # tensor-static needs it (the dev extra)
        return
    convert(src, tmp_path / "static", scheme="tensor-static")
    with quiet(), torch.no_grad():
        static = load_causal_lm(tmp_path / "static")(input_ids=ids).logits
    assert logit_drift(source, static)["kl"] < 2e-2


def test_a_peft_adapter_beside_the_weights_is_left_out_of_every_calibration(tmp_path, qwen3_src):
    """With peft installed, transformers applies an adapter_config.json it finds beside the weights: the scales were
    calibrated, and publish's KL measured, on base + adapter while the converter writes the base alone."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fp8kit.hub.validate import validate

    src, calibration = qwen3_src
    with_adapter = tmp_path / "with_adapter"
    shutil.copytree(src, with_adapter)
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=64, target_modules=["k_proj", "v_proj"]))
    with torch.no_grad():  # B starts at zero: an untrained adapter would change nothing
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    peft_model.save_pretrained(with_adapter)
    assert (with_adapter / "adapter_config.json").is_file()
    applied = AutoModelForCausalLM.from_pretrained(with_adapter, dtype=torch.float32)  # what transformers does
    assert any("lora_B" in n for n, _ in applied.named_parameters())

    scales = {}
    for name, folder in (("plain", src), ("adapter", with_adapter)):
        convert(folder, tmp_path / f"dyn-{name}", scheme="dynamic", kv_cache="fp8", calibration=calibration)
        convert(folder, tmp_path / f"static-{name}", scheme="tensor-static", kv_cache="fp8", calibration=calibration)
        scales[name] = {**{f"dyn.{k}": v for k, v in kv_scales(tmp_path / f"dyn-{name}").items()},
                        **{k: v for k, v in load_file_scales(tmp_path / f"static-{name}").items()}}
    assert sorted(scales["plain"]) == sorted(scales["adapter"]) and len(scales["plain"]) > 8
    for key, value in scales["plain"].items():
        assert torch.equal(value, scales["adapter"][key]), key
    assert not (tmp_path / "dyn-adapter" / "adapter_config.json").exists()
    kl = {name: validate(folder, tmp_path / f"dyn-{name}")["kl"] for name, folder in (("plain", src),
                                                                                      ("adapter", with_adapter))}
    assert kl["adapter"] == kl["plain"]


def test_an_adapter_folder_without_links_is_one_line(tmp_path, qwen3_src, monkeypatch):
    """Where no folder of links can be made (a filesystem without symlinks), the adapter is named, not applied."""
    from pathlib import Path

    from fp8kit.loaded_names import load_model

    src, _ = qwen3_src
    folder = tmp_path / "with_adapter"
    shutil.copytree(src, folder)
    (folder / "adapter_config.json").write_text("{}")

    def no_links(self, target):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(Path, "symlink_to", no_links)
    with pytest.raises(Fp8kitError, match=r"with_adapter: holds a PEFT adapter \(adapter_config.json\), which "
                                          r"transformers would apply .* \(Operation not permitted\); move"):
        load_model(folder, dtype="auto")


def load_file_scales(directory):
    """Every scale tensor llm-compressor wrote (weight, input and KV-cache scales)."""
    scales = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            scales.update({k: sf.get_tensor(k) for k in sf.keys() if k.endswith("_scale")})
    return scales
