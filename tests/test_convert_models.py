"""End to end on each architecture: what is quantized, what is kept, and that transformers loads it."""

import json

import pytest
import torch
from safetensors import safe_open

from fp8kit import convert
from fp8kit.errors import Fp8kitError
from fp8kit.models import build_checkpoint
from fp8kit.quality import load_causal_lm, logit_drift, weight_error

KL_BOUND = 5e-3  # mean per-token KL (nats) on random-weight models; llm-compressor's output measures ~1e-3


def tensors(directory):
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                out[name] = f.get_slice(name).get_dtype()
    return out


def drift(src, out):
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return logit_drift(load_causal_lm(src)(input_ids=ids).logits, load_causal_lm(out)(input_ids=ids).logits)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen3", torch.bfloat16),
                                        ("mistral", torch.float16), ("gemma3", torch.bfloat16)])
@pytest.mark.parametrize("scheme", ["dynamic", "block", "tensor"])
def test_dense_architectures(tmp_path, arch, dtype, scheme):
    src = build_checkpoint(tmp_path / "src", arch, dtype, seed=3)
    report = convert(src, tmp_path / "out", scheme=scheme)
    names = tensors(tmp_path / "out")
    scale_dtype = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
    for name, dt in names.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            assert dt == "F8_E4M3", name
            assert names[name[: -len("weight")] + "weight_scale"] == scale_dtype
        elif not name.endswith("weight_scale"):
            assert dt == scale_dtype, name  # embeddings, norms, lm_head: source precision
    assert len(report.quantized) == 7 * 2
    assert "lm_head" in report.ignored
    result = drift(src, tmp_path / "out")
    assert 0 < result["kl"] < KL_BOUND, result
    assert weight_error(src, tmp_path / "out") < 0.04


def test_moe_experts_per_expert_router_kept(tmp_path):
    src = build_checkpoint(tmp_path / "src", "qwen3_moe", torch.bfloat16, seed=4)
    report = convert(src, tmp_path / "out", scheme="block")
    names = tensors(tmp_path / "out")
    assert names["model.layers.0.mlp.experts.3.down_proj.weight"] == "F8_E4M3"
    assert names["model.layers.0.mlp.experts.3.down_proj.weight_scale"] == "BF16"
    assert names["model.layers.0.mlp.gate.weight"] == "BF16"  # the router
    assert "model.layers.0.mlp.gate" in report.ignored
    assert len(report.quantized) == 2 * (4 + 4 * 3)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model.layers.1.mlp.gate" in config["quantization_config"]["ignore"]


def test_per_channel_layers_vllm_cannot_load_are_named_in_a_warning(tmp_path):
    """vLLM 0.25 pads a layer whose output width (q/k/v and gate/up fused) is not a multiple of 16 and then fails to
    load it with a per-channel scale (vllm-project/vllm#47005, seen on an H100 with gate/up 2 x 100 wide): the
    conversion says so. 2 x 104 fuses to 208, which vLLM pads only along the down projection's input, and loads;
    per-tensor scales pad fine."""
    src = build_checkpoint(tmp_path / "src100", "llama", torch.bfloat16, seed=0, intermediate_size=100)
    warned = [w for w in convert(src, tmp_path / "dyn100", scheme="dynamic").warnings if "#47005" in w]
    assert len(warned) == 1 and warned[0].startswith("2 per-channel layers (as vLLM fuses them) have an output width"), warned
    assert "gate_proj+up_proj of model.layers.0.mlp (200)" in warned[0] and "--scheme tensor" in warned[0]
    assert not [w for w in convert(src, tmp_path / "t100", scheme="tensor").warnings if "#47005" in w]
    src = build_checkpoint(tmp_path / "src104", "llama", torch.bfloat16, seed=0, intermediate_size=104)
    assert not [w for w in convert(src, tmp_path / "dyn104", scheme="dynamic").warnings if "#47005" in w]


def test_block_leaves_non_multiple_of_128_layers(odd_llama_dir, tmp_path):
    report = convert(odd_llama_dir, tmp_path / "out", scheme="block")
    names = tensors(tmp_path / "out")
    assert names["model.layers.0.mlp.gate_proj.weight"] == "BF16"
    assert names["model.layers.0.mlp.down_proj.weight"] == "BF16"
    assert names["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= set(ignore)
    assert report.warnings and "multiples of 128" in report.warnings[0]
    assert drift(odd_llama_dir, tmp_path / "out")["kl"] < KL_BOUND
    # per-channel has no such constraint
    convert(odd_llama_dir, tmp_path / "dyn", scheme="dynamic")
    assert tensors(tmp_path / "dyn")["model.layers.0.mlp.gate_proj.weight"] == "F8_E4M3"


def test_ignore_keeps_fused_siblings_together(llama_dir, tmp_path):
    report = convert(llama_dir, tmp_path / "out", scheme="dynamic", ignore=[r"layers\.0\.self_attn\.k_proj"])
    for leaf in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{leaf}" in report.ignored
    assert "model.layers.0.self_attn.o_proj" in report.quantized
    assert "model.layers.1.self_attn.k_proj" in report.quantized


def test_fp8_format_block(llama_dir, tmp_path):
    convert(llama_dir, tmp_path / "out", scheme="block", format="fp8")
    names = tensors(tmp_path / "out")
    assert names["model.layers.0.mlp.up_proj.weight_scale_inv"] == "F32"
    assert "model.layers.0.mlp.up_proj.weight_scale" not in names
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert q == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
                 "ignored_layers": ["lm_head"], "modules_to_not_convert": ["lm_head"]}
    assert drift(llama_dir, tmp_path / "out")["kl"] < KL_BOUND  # transformers' FineGrainedFP8 loader


def test_fp8_format_tensor(llama_dir, tmp_path):
    convert(llama_dir, tmp_path / "out", scheme="tensor", format="fp8")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        scale = f.get_tensor("model.layers.0.mlp.up_proj.weight_scale")
    assert scale.dtype == torch.float32 and scale.numel() == 1
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert "weight_block_size" not in q and q["quant_method"] == "fp8"


def test_shards_index_and_determinism(llama_dir, tmp_path):
    convert(llama_dir, tmp_path / "a", scheme="dynamic", max_shard_size="400KB")
    convert(llama_dir, tmp_path / "b", scheme="dynamic", max_shard_size="400KB")
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(tensors(tmp_path / "a"))
    for path in (tmp_path / "a").iterdir():
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name
    assert drift(llama_dir, tmp_path / "a")["kl"] < KL_BOUND


def test_sharded_source_and_extra_files(tmp_path):
    src = build_checkpoint(tmp_path / "src", "qwen3", torch.bfloat16, seed=5, max_shard_size="300KB")
    assert (src / "model.safetensors.index.json").exists()
    (src / "tokenizer.json").write_text("{}")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "pytorch_model.bin").write_bytes(b"not copied")
    convert(src, tmp_path / "out", scheme="dynamic")
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_text() == "{}"
    assert (out / "chat_template.jinja").exists() and (out / "generation_config.json").exists()
    assert not (out / "pytorch_model.bin").exists()
    assert drift(src, out)["kl"] < KL_BOUND


@pytest.mark.parametrize("scheme", ["dynamic", "tensor"])  # block: refused (test_convert_errors.py)
def test_lm_head_in_fp8(llama_dir, tmp_path, scheme):
    report = convert(llama_dir, tmp_path / "out", scheme=scheme, lm_head=True)
    names = tensors(tmp_path / "out")
    assert names["lm_head.weight"] == "F8_E4M3" and names["lm_head.weight_scale"] == "BF16"
    assert names["model.embed_tokens.weight"] == "BF16"
    assert "lm_head" in report.quantized and "lm_head" not in report.ignored
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == [] and q["config_groups"]["group_0"]["targets"] == ["Linear", "lm_head"]
    # transformers' compressed-tensors loader reads the config and quantizes lm_head too: its logits move away
    # from those of the same conversion with lm_head kept, and stay close to the source's.
    kept = convert(llama_dir, tmp_path / "kept", scheme=scheme).out
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = load_causal_lm(tmp_path / "out")
        with_head, without = model(input_ids=ids).logits, load_causal_lm(kept)(input_ids=ids).logits
    assert (with_head - without).abs().max() > 1e-3
    assert drift(llama_dir, tmp_path / "out")["kl"] < KL_BOUND


def test_lm_head_needs_an_untied_head(tmp_path):
    src = build_checkpoint(tmp_path / "src", "qwen3", torch.bfloat16, seed=3)  # tie_word_embeddings=True
    assert "lm_head.weight" not in tensors(src)
    with pytest.raises(Fp8kitError, match="ties the output head"):
        convert(src, tmp_path / "out", scheme="dynamic", lm_head=True)
    assert not (tmp_path / "out").exists()
    # some exports store lm_head.weight although the config ties it: transformers re-ties it on loading (an FP8
    # head then fails there) and vLLM skips it, so it is refused too
    from safetensors.torch import load_file, save_file

    weights = load_file(src / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Fp8kitError, match="ties the output head"):
        convert(src, tmp_path / "out", scheme="dynamic", lm_head=True)
    assert not (tmp_path / "out").exists()


def test_peak_rss_without_proc_status_falls_back_to_getrusage_in_bytes(tmp_path):
    """Where /proc/self/status is missing (macOS, BSD) the report's peak RSS comes from getrusage, whose unit differs
    by platform (KiB on Linux, bytes on macOS): on this machine both sources must agree on the order of magnitude."""
    from fp8kit.converter.streaming import peak_rss_bytes

    from_proc, from_rusage = peak_rss_bytes(), peak_rss_bytes(status=str(tmp_path / "no-status"))
    if from_proc is None or from_rusage is None:
        pytest.skip("no resident-set measure on this platform")
    assert 0.5 < from_rusage / from_proc < 2, (from_proc, from_rusage)


@pytest.mark.parametrize("scheme", ["dynamic", "block"])
def test_float16_source_rows_of_small_magnitude_keep_their_values(tmp_path, scheme):
    """A float16 row of amax under 1.3e-5 has a scale that underflows float16: compressed-tensors' eps in its place
    (5e4 times too large) quantized the row to zeros; the smallest subnormal keeps it. Up to amax 3.7e-4 the scale
    is subnormal and, rounded down, clipped the row's largest values at 448 (12% off); the next float16 up keeps
    them. The file's float16 scales are what every loader multiplies by, so the check dequantizes with them."""
    from safetensors.torch import load_file, save_file

    src = build_checkpoint(tmp_path / "src", "llama", torch.float16, seed=3)
    weights = load_file(src / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    w = weights[name].float()
    magnitudes = torch.logspace(-6.5, -3, w.shape[0])[:, None]  # row amax 3e-7 to 1e-3: scales 0 and subnormal
    weights[name] = (w / w.abs().amax(dim=1, keepdim=True) * magnitudes).half()
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    convert(src, tmp_path / "out", scheme=scheme)
    out = load_file(tmp_path / "out" / "model.safetensors")
    q, scale = out[name].float(), out[name + "_scale"]
    assert scale.dtype == torch.float16 and (scale > 0).all()
    scale = scale.float()
    if scheme == "block":
        scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    source = weights[name].float()
    err = (q * scale - source).norm(dim=1) / source.norm(dim=1)
    # e4m3's 3 mantissa bits (about 2.5% for a random row); float16's own subnormal rounding of the source adds
    # some at amax 3e-7 (its step is 6e-8)
    assert err.max() < 0.05 and err.median() < 0.03, (err.max(), err.median())  # 3.4%, 2.6% (eps: 100%; no bump: 12.7%)


def test_fp8_format_per_tensor_says_who_reads_it(tmp_path, llama_dir):
    report = convert(llama_dir, tmp_path / "out", scheme="tensor", format="fp8")
    assert any("read by vLLM and SGLang; transformers would ignore its scales" in w for w in report.warnings)
    assert not any("transformers" in w for w in convert(llama_dir, tmp_path / "b", scheme="block",
                                                          format="fp8").warnings)


def test_multimodal_kept_modules_are_named_as_transformers_loads_them(tmp_path):
    """Gemma 3 multimodal: transformers 5 loads `vision_tower.encoder...` as `model.vision_tower.encoder...` and
    `language_model.model.layers.N` as `model.language_model.layers.N`, and matches compressed-tensors' ignore list
    against the loaded names: listed by checkpoint name alone, the kept vision tower and an --ignore'd MLP got FP8
    wrappers with no scales (a vision output off by 0.08, NaN logits). Both names are listed; the report keeps the
    checkpoint's."""
    from transformers import Gemma3ForConditionalGeneration

    from fp8kit.quality import quiet

    src = build_checkpoint(tmp_path / "src", "gemma3_mm", torch.bfloat16, seed=3)
    report = convert(src, tmp_path / "out", scheme="dynamic", ignore=[r"layers\.0\.mlp\."])
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    # a config.json without `architectures`: the model is the one from_pretrained builds (its auto classes)
    config = json.loads((src / "config.json").read_text())
    del config["architectures"]
    (tmp_path / "noarch").mkdir()
    (tmp_path / "noarch" / "config.json").write_text(json.dumps(config))
    (tmp_path / "noarch" / "model.safetensors").symlink_to(src / "model.safetensors")
    convert(tmp_path / "noarch", tmp_path / "noarch-out", scheme="dynamic", ignore=[r"layers\.0\.mlp\."])
    assert json.loads((tmp_path / "noarch-out" / "config.json").read_text())["quantization_config"]["ignore"] == ignore
    for name in ("vision_tower.encoder.layers.0.self_attn.q_proj", "language_model.model.layers.0.mlp.up_proj"):
        assert name in ignore and name in report.ignored
    for name in ("model.vision_tower.encoder.layers.0.self_attn.q_proj", "model.language_model.layers.0.mlp.up_proj"):
        assert name in ignore and name not in report.ignored
    with quiet():
        ref = Gemma3ForConditionalGeneration.from_pretrained(src, dtype=torch.bfloat16)
        fp8 = Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    loaded = dict(fp8.named_modules())
    assert not hasattr(loaded["model.vision_tower.encoder.layers.0.self_attn.q_proj"], "quantization_scheme")
    assert not hasattr(loaded["model.language_model.layers.0.mlp.up_proj"], "quantization_scheme")
    assert loaded["model.language_model.layers.1.mlp.up_proj"].weight.dtype == torch.float8_e4m3fn
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ref.model.vision_tower(pixel_values=pixels).last_hidden_state,
                           fp8.model.vision_tower(pixel_values=pixels).last_hidden_state)
        ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
        result = logit_drift(ref(input_ids=ids).logits.float(), fp8(input_ids=ids).logits.float())
    assert 0 < result["kl"] < KL_BOUND, result


def test_moe_experts_of_one_layer_share_one_status(tmp_path):
    """One expert --ignore'd among FP8 ones: engines load a layer's experts into fused tensors with one
    quantization, and transformers 5 loaded the kept expert as zeros or garbage (NaN logits). Every expert of that
    layer stays in source precision, with a warning; the other layer's experts are FP8."""
    src = build_checkpoint(tmp_path / "src", "qwen3_moe", torch.bfloat16, seed=4)
    report = convert(src, tmp_path / "out", scheme="dynamic", ignore=[r"layers\.0\.mlp\.experts\.3\.down_proj"])
    names = tensors(tmp_path / "out")
    layer0 = [n for n in names if n.startswith("model.layers.0.mlp.experts.") and n.endswith("_proj.weight")]
    assert len(layer0) == 4 * 3 and all(names[n] == "BF16" for n in layer0)
    assert names["model.layers.1.mlp.experts.3.down_proj.weight"] == "F8_E4M3"
    assert names["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    assert any("other experts of their MoE layer" in w and "model.layers.0.mlp.experts" in w for w in report.warnings)
    result = drift(src, tmp_path / "out")
    assert 0 < result["kl"] < KL_BOUND, result


def test_ignore_pattern_matching_nothing_is_warned(llama_dir, tmp_path):
    """A pattern written against tensor names (`...o_proj.weight`) matches no module name: the layer was quantized
    without a word."""
    report = convert(llama_dir, tmp_path / "out", scheme="dynamic",
                     ignore=[r"layers\.0\.self_attn\.o_proj\.weight", r"layers\.1\.mlp"])
    assert "model.layers.0.self_attn.o_proj" in report.quantized
    warned = [w for w in report.warnings if "matched no weight" in w]
    assert len(warned) == 1 and "o_proj" in warned[0] and "layers\\\\.1" not in warned[0], warned
    # lm_head is always kept: naming it, as llm-compressor recipes do, is no mistake even where it is tied
    tied = build_checkpoint(tmp_path / "qwen3", "qwen3", torch.bfloat16, seed=1)
    report = convert(tied, tmp_path / "tied", scheme="dynamic", ignore=["lm_head"])
    assert not [w for w in report.warnings if "matched no weight" in w], report.warnings


@pytest.mark.parametrize("scheme", ["dynamic", "tensor"])
def test_linear_projections_named_after_embeddings_are_named_in_the_ignore_list(tmp_path, scheme):
    """Gemma 3n's `altup_unembed_projections.N` are Linear modules outside the decoder blocks: kept in source precision
    and named in the ignore list, as its other projections are. Left out of it (their names hold "embed", as the
    embedding tables' do), transformers wrapped them as FP8 with no scale to load: NaN logits."""
    src = build_checkpoint(tmp_path / "src", "gemma3n", torch.bfloat16, seed=1)
    report = convert(src, tmp_path / "out", scheme=scheme)
    unembed = [f"model.altup_unembed_projections.{i}" for i in range(3)]
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    assert set(unembed) <= set(ignore) and set(unembed) <= set(report.ignored)
    assert "model.altup_projections.0" in ignore and "model.per_layer_model_projection" in ignore
    assert not [name for name in ignore if name.endswith(("embed_tokens", "embed_tokens_per_layer"))]
    names = tensors(tmp_path / "out")
    assert all(names[f"{m}.weight"] == "BF16" for m in unembed)
    result = drift(src, tmp_path / "out")
    assert 0 < result["kl"] < KL_BOUND, result
