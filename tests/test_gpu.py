"""The CUDA path of the converter computes the same bytes as the CPU path."""

import pytest

from fp8kit import convert


@pytest.mark.gpu
@pytest.mark.parametrize("scheme,fmt", [("dynamic", "compressed-tensors"), ("block", "compressed-tensors"),
                                        ("tensor", "compressed-tensors"), ("block", "fp8")])
def test_cuda_conversion_equals_cpu(llama_dir, tmp_path, scheme, fmt):
    convert(llama_dir, tmp_path / "cpu", scheme=scheme, format=fmt, device="cpu")
    report = convert(llama_dir, tmp_path / "gpu", scheme=scheme, format=fmt, device="cuda")
    assert report.device.startswith("cuda") and report.peak_gpu_bytes > 0
    for path in sorted((tmp_path / "cpu").iterdir()):
        assert path.read_bytes() == (tmp_path / "gpu" / path.name).read_bytes(), path.name
