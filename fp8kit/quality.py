"""How far an FP8 checkpoint is from its source: weight error and next-token distribution drift.

Shared by the demo, the tests and (later) publishing, so that every number fp8kit prints about
quality comes from one definition.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import torch

from fp8kit.converter.schemes import SCHEMES, dequantize_weight


def scheme_of(quantization_config: dict) -> str:
    if quantization_config.get("quant_method") == "fp8":
        return "block" if quantization_config.get("weight_block_size") else "tensor"
    strategy = quantization_config["config_groups"]["group_0"]["weights"]["strategy"]
    return {"channel": "dynamic", "block": "block", "tensor": "tensor"}[strategy]


def _tensors(directory: Path) -> dict[str, Path]:
    from safetensors import safe_open

    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                found[name] = path
    return found


def weight_error(src: str | Path, fp8: str | Path) -> float:
    """Mean over quantized weights of ||W - dequant(Q)|| / ||W||, computed in float32."""
    from safetensors import safe_open

    src, fp8 = Path(src), Path(fp8)
    scheme = SCHEMES[scheme_of(json.loads((fp8 / "config.json").read_text())["quantization_config"])]
    src_files, out_files = _tensors(src), _tensors(fp8)
    errors = []
    for name, path in out_files.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ("weight_scale", "weight_scale_inv"):
            continue
        with safe_open(path, "pt") as f:
            scale = f.get_tensor(name)
        with safe_open(out_files[module + ".weight"], "pt") as f:
            q = f.get_tensor(module + ".weight")
        with safe_open(src_files[module + ".weight"], "pt") as f:
            w = f.get_tensor(module + ".weight").float()
        errors.append(((w - dequantize_weight(q, scale, scheme)).norm() / w.norm().clamp_min(1e-30)).item())
    return sum(errors) / len(errors)


def logit_drift(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """Mean per-token KL(ref || fp8) in nats, and top-1 agreement, over all positions."""
    ref = ref_logits.double().log_softmax(-1)
    got = logits.double().log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    return {"kl": kl, "top1": top1}


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean next-token negative log-likelihood of `ids` under `logits` ([batch, seq, vocab])."""
    logp = logits[:, :-1].double().log_softmax(-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return float(nll.mean().exp())


@contextlib.contextmanager
def quiet():
    """transformers' and compressed-tensors' progress bars (on stderr) would bury our own output."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32):
    """transformers' loader, quietly (compressed-tensors decompresses FP8 weights on CPU)."""
    import transformers
    from transformers import AutoModelForCausalLM

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
