"""The quantization formula against a float64 reference, and the chunked writer against whole-tensor math."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8kit import convert
from fp8kit.converter import streaming
from fp8kit.converter.schemes import FP8_MAX, SCHEMES, dequantize_weight, quantize_weight

E4M3_HALF_ULP = 2.0 ** -4  # 3 mantissa bits: rounding error <= 2^-4 of the value for normals
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # subnormal spacing 2^-9, in units of the scale


def reference_scale(w64, scheme):
    if scheme.weight_strategy == "channel":
        amax = w64.abs().amax(dim=1, keepdim=True)
    elif scheme.weight_strategy == "block":
        r, c = scheme.block
        amax = w64.abs().reshape(w64.shape[0] // r, r, w64.shape[1] // c, c).amax(dim=(1, 3))
    else:
        amax = w64.abs().amax().reshape(1)
    return amax / FP8_MAX


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_against_float64(name, dtype):
    scheme = SCHEMES[name]
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=g) * torch.logspace(-3, 1, 384)).to(dtype)
    w[7] = 0  # an all-zero channel gets the dtype's eps as its scale, not a division by zero
    q, scale = quantize_weight(w, scheme, dtype)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == dtype and scale.shape == scheme.scale_shape(w.shape)
    w64 = w.double()
    ref_scale = reference_scale(w64, scheme)
    nonzero = ref_scale > 0
    # scale = amax/448 rounded once to the scale dtype
    assert torch.allclose(scale.double()[nonzero], ref_scale[nonzero], rtol=torch.finfo(dtype).eps, atol=0)
    assert (q.float().abs() <= FP8_MAX).all()
    assert (q.float().abs().amax() == FP8_MAX) or name == "tensor"
    deq = dequantize_weight(q, scale, scheme, torch.float64)
    full_scale = dequantize_weight(torch.ones_like(q), scale, scheme, torch.float64)
    # Error bound: FP8 rounding (half an ulp, or half a subnormal step), plus one rounding of w/scale in
    # the source dtype (compressed-tensors divides in that dtype) and of the scale itself.
    slack = 2 * torch.finfo(dtype).eps
    bound = (w64.abs() * (E4M3_HALF_ULP + slack) + full_scale * E4M3_SUBNORMAL_HALF_STEP) * (1 + slack)
    assert ((deq - w64).abs() <= bound).all()
    assert (deq[7] == 0).all()


@pytest.mark.parametrize("name", list(SCHEMES))
def test_chunked_conversion_equals_whole_tensor(tmp_path, monkeypatch, name):
    """Weights far larger than a chunk go through many row chunks; the bytes must not depend on that."""
    scheme = SCHEMES[name]
    g = torch.Generator().manual_seed(1)
    src = tmp_path / "src"
    src.mkdir()
    # a model_type transformers does not know: no architecture to check the lone weight against
    (src / "config.json").write_text('{"model_type": "fp8kit-test"}')
    w = (torch.randn(1024, 256, generator=g) * torch.linspace(0.01, 3, 1024)[:, None]).to(torch.bfloat16)
    save_file({"model.layers.0.mlp.up_proj.weight": w, "model.norm.weight": torch.ones(256, dtype=torch.bfloat16)},
              src / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(streaming, "CHUNK_BYTES", 128 * 256 * 4)  # 128-row chunks: 8 of them
    convert(src, tmp_path / "out", scheme=name)
    got = load_file(tmp_path / "out" / "model.safetensors")
    q, scale = quantize_weight(w, scheme, torch.bfloat16)
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight_scale"], scale)
    assert torch.equal(got["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_negative_zero_becomes_positive_zero(name, dtype):
    """As compressed-tensors quantizes (w / scale + zero point): -0.0 gives what +0.0 gives, FP8 code 0x00; a
    negative value that underflows keeps its sign (0x80) there too."""
    w = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    w[0, :5] = 0.0
    w[3, 7] = -1e-30
    positive, _ = quantize_weight(w, SCHEMES[name], dtype)
    w[0, :5] = -0.0
    q, _ = quantize_weight(w, SCHEMES[name], dtype)
    assert torch.equal(q.view(torch.uint8), positive.view(torch.uint8))
    assert (q.view(torch.uint8)[0, :5] == 0).all() and q.view(torch.uint8)[3, 7] == 0x80
