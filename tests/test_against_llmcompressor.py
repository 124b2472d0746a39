"""Our FP8 bytes, scales and config against what llm-compressor's oneshot writes for the same model."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fp8kit import convert
from fp8kit.quality import load_causal_lm, logit_drift

pytest.importorskip("llmcompressor")


def oneshot_fp8(src, out, preset):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"]))
    model.save_pretrained(out, save_compressed=True)
    return out


def as_bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("scheme,preset", [("dynamic", "FP8_DYNAMIC"), ("block", "FP8_BLOCK")])
def test_same_tensors_and_config_as_oneshot(llama_dir, tmp_path, scheme, preset):
    ref = oneshot_fp8(llama_dir, tmp_path / "ref", preset)
    ours = convert(llama_dir, tmp_path / "ours", scheme=scheme)
    a, b = load_file(tmp_path / "ours" / "model.safetensors"), load_file(ref / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        # Exact: same formula in the same dtype (see fp8kit/converter/schemes.py).
        assert torch.equal(as_bytes(a[name]), as_bytes(b[name])), name
    assert sum(n.endswith(".weight_scale") for n in a) == len(ours.quantized) == 14
    qa = json.loads((tmp_path / "ours" / "config.json").read_text())["quantization_config"]
    qb = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert qa == qb


def test_logits_match_oneshot_output(llama_dir, tmp_path):
    """Loaded with transformers + compressed-tensors, ours is exactly as close to the source as llm-compressor's."""
    ref_dir = oneshot_fp8(llama_dir, tmp_path / "ref", "FP8_DYNAMIC")
    convert(llama_dir, tmp_path / "ours", scheme="dynamic")
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        src = load_causal_lm(llama_dir)(input_ids=ids).logits
        ours = logit_drift(src, load_causal_lm(tmp_path / "ours")(input_ids=ids).logits)
        theirs = logit_drift(src, load_causal_lm(ref_dir)(input_ids=ids).logits)
    assert ours["kl"] <= theirs["kl"] * (1 + 1e-6) + 1e-9
    assert 0 < ours["kl"] < 5e-3


@pytest.mark.parametrize("scheme,preset", [("dynamic", "FP8_DYNAMIC"), ("block", "FP8_BLOCK")])
def test_negative_zero_weights_as_oneshot_writes_them(tmp_path, scheme, preset):
    """compressed-tensors adds the zero point (0) after dividing by the scale, which turns -0.0 into +0.0 (FP8 code
    0x00, not 0x80); values too small for FP8 keep their sign in both. Every byte stays equal."""
    from safetensors.torch import save_file

    from fp8kit.models import build_checkpoint

    src = build_checkpoint(tmp_path / "src", "llama", torch.bfloat16, seed=1)
    tensors = load_file(src / "model.safetensors")
    w = tensors["model.layers.0.self_attn.q_proj.weight"]
    w[0, :7] = -0.0
    w[1, :128] = -0.0  # a whole 1x128 row of a block, and most of a channel
    w[2, 3] = -1e-30  # underflows to -0 in FP8
    tensors["model.layers.1.mlp.down_proj.weight"][:, 5] = -0.0
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    ref = oneshot_fp8(src, tmp_path / "ref", preset)
    convert(src, tmp_path / "ours", scheme=scheme)
    a, b = load_file(tmp_path / "ours" / "model.safetensors"), load_file(ref / "model.safetensors")
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(as_bytes(a[name]), as_bytes(b[name])), name
    q = a["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8)
    assert (q[0, :7] == 0).all() and (q[1, :128] == 0).all() and q[2, 3] == 0x80
