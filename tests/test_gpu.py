"""The CUDA path of the converter computes the same bytes as the CPU path; vLLM serves the scales it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["dynamic", "block"])
def test_cuda_conversion_of_tiny_float16_rows_equals_cpu(tmp_path, scheme):
    """Rows whose float16 scale underflows or is subnormal (amax 3e-7 to 1e-3) get the same scales on both devices."""
    import torch
    from safetensors.torch import load_file, save_file

    from fp8kit.models import build_checkpoint

    src = build_checkpoint(tmp_path / "src", "llama", torch.float16, seed=3)
    weights = load_file(src / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    w = weights[name].float()
    weights[name] = (w / w.abs().amax(dim=1, keepdim=True) * torch.logspace(-6.5, -3, w.shape[0])[:, None]).half()
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    convert(src, tmp_path / "cpu", scheme=scheme, device="cpu")
    convert(src, tmp_path / "gpu", scheme=scheme, device="cuda")
    for path in sorted((tmp_path / "cpu").iterdir()):
        assert path.read_bytes() == (tmp_path / "gpu" / path.name).read_bytes(), path.name


@pytest.mark.gpu
def test_vllm_uses_the_kv_cache_scales(tmp_path):
    """A --kv-cache fp8 checkpoint turns on vLLM's FP8 KV cache with the checkpoint's per-layer scales."""
    pytest.importorskip("vllm")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "vllm_load.json"
    proc = subprocess.run([sys.executable, str(root / "evals/vllm_load.py"), "--variants",
                           "bf16,dynamic/compressed-tensors+kv-fp8", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(root), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())["results"]["dynamic/compressed-tensors+kv-fp8"]
    assert run["ok"], run
    agreement = run["kv_scale_agreement"]
    assert agreement["mismatched"] == [] and agreement["kv_cache_dtypes"] == ["fp8"]
    assert agreement["scales_equal"] == agreement["checkpoint_scales"] == 2 * agreement["layers"] > 0
    assert run["prompt_logprob_mean_abs_diff_vs_bf16"] < 0.5


@pytest.mark.gpu
def test_vllm_serves_a_moe_layer_kept_in_bf16_unquantized(tmp_path):
    """One --ignore'd expert keeps its whole MoE layer in BF16, and the ignore list names the layer itself: vLLM
    gives that fused MoE layer an unquantized method and the other layer an FP8 one, and scores like the BF16
    model does."""
    pytest.importorskip("vllm")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "vllm_load.json"
    kept = "dynamic/compressed-tensors moe (layer 0 experts kept bf16)"
    proc = subprocess.run([sys.executable, str(root / "evals/vllm_load.py"), "--variants",
                           f"bf16-moe,dynamic/compressed-tensors moe,{kept}", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(root), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    run, fp8 = results[kept], results["dynamic/compressed-tensors moe"]
    assert run["ok"] and fp8["ok"], (run, fp8)
    methods = sorted(run["moe_methods"].items())
    assert len(methods) == 2 and "Unquantized" in methods[0][1] and "Unquantized" not in methods[1][1], methods
    assert all("Unquantized" not in m for m in fp8["moe_methods"].values()), fp8["moe_methods"]
    assert run["prompt_logprob_mean_abs_diff_vs_bf16"] < 0.5 and fp8["prompt_logprob_mean_abs_diff_vs_bf16"] < 0.5
