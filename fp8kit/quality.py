"""How far an FP8 checkpoint is from its source: weight error and next-token distribution drift.

Shared by the demo, the tests and (later) publishing, so that every number fp8kit prints about
quality comes from one definition.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import torch

from fp8kit.converter.schemes import SCHEMES, dequantize_weight


def static_activations(quantization_config: dict) -> bool:
    """Whether a checkpoint quantizes activations with static scales (`tensor-static`, or `activation_scheme: static`
    in the fp8 format): vLLM uses them, while fp8kit's training layers quantize activations per token."""
    qc = quantization_config if isinstance(quantization_config, dict) else {}
    if qc.get("quant_method") == "fp8":
        return qc.get("activation_scheme") == "static"
    groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
    return any(isinstance(g, dict) and isinstance(g.get("input_activations"), dict)
               and g["input_activations"].get("dynamic") is False for g in groups.values())


# what scheme_of's names are, for messages: "dynamic" next to "static activation scales" read as a contradiction
WEIGHT_SCALES = {"dynamic": "per-channel", "block": "128x128 block", "tensor": "per-tensor"}


def scheme_of(quantization_config: dict, where: str = "quantization_config") -> str:
    """The FP8 scheme of a checkpoint's quantization_config: 'dynamic' (per-channel weights), 'block' (128x128) or
    'tensor'. Anything else (INT8 W8A8 or INT4 compressed-tensors, FP4, config groups with different schemes,
    other block sizes, an e5m2 or unknown quant_method) raises Fp8kitError, one line starting with `where` (the
    file, or what the dict is) that says what the checkpoint is and what fp8kit reads."""
    from fp8kit.errors import Fp8kitError

    strategies = {"channel": "dynamic", "block": "block", "tensor": "tensor"}

    def refuse(what: str) -> Fp8kitError:
        return Fp8kitError(f"{where}: {what}; fp8kit reads FP8 checkpoints: compressed-tensors with 8-bit float "
                           f"weights (strategy channel, tensor, or block of 128x128) or quant_method fp8 (e4m3)")

    qc = quantization_config
    if not isinstance(qc, dict):
        raise refuse(f"quantization_config is not an object but {type(qc).__name__} {qc!r:.40}")
    method = qc.get("quant_method")
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2's config spells it as the torch dtype
            raise refuse(f"quant_method fp8 with fmt {fmt!r}, not e4m3")
        block = qc.get("weight_block_size")
        if not block:
            return "tensor"
        if not isinstance(block, (list, tuple)) or list(block) != [128, 128]:
            raise refuse(f"quant_method fp8 with weight_block_size {block!r}, not [128, 128]")
        return "block"
    if method != "compressed-tensors":
        raise refuse(f"quant_method {method!r}, not an FP8 format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("compressed-tensors without config_groups")
    schemes = {}
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise refuse(f"config group {name!r} has no weights quantization")
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if kind != "float" or bits != 8:
            known = kind in ("int", "float") and isinstance(bits, int)
            label = f"{'INT' if kind == 'int' else 'FP'}{bits}" if known else "a format other than FP8"
            if kind == "int" and bits == 8:
                label += " (W8A8 or W8A16)"
            raise refuse(f"compressed-tensors config group {name!r} quantizes weights to {label} (type {kind!r}, "
                         f"num_bits {bits!r}), not FP8")
        activations = group.get("input_activations")
        if isinstance(activations, dict) and (activations.get("type") != "float" or activations.get("num_bits") != 8):
            raise refuse(f"compressed-tensors input activations of type {activations.get('type')!r} with num_bits "
                         f"{activations.get('num_bits')!r} in config group {name!r}, not FP8")
        strategy = strategy.lower() if isinstance(strategy, str) else strategy  # compressed-tensors lowers it too
        if strategy not in strategies:
            raise refuse(f"compressed-tensors FP8 weights with strategy {strategy!r} in config group {name!r}")
        if strategy == "block":
            block = weights.get("block_structure")
            if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):  # the legacy "128x128" spelling
                block = [int(n) for n in block.split("x")]
            if not isinstance(block, (list, tuple)) or list(block) != [128, 128]:
                raise refuse(f"compressed-tensors FP8 blocks of {block!r} in config group {name!r}, not [128, 128]")
        schemes[name] = strategies[strategy]
    if len(set(schemes.values())) > 1:
        mixed = ", ".join(f"{n}: {s}" for n, s in schemes.items())
        raise refuse(f"config groups with different FP8 schemes ({mixed}); one scheme per checkpoint")
    return next(iter(schemes.values()))


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
    # a token both models give -inf contributes 0 (0 * log 0/0), not 0 * NaN
    kl = torch.where(torch.isneginf(ref), 0.0, ref.exp() * (ref - got)).sum(-1).mean().item()
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
    """transformers' loader, quietly (compressed-tensors decompresses FP8 weights on CPU), through the class
    from_pretrained would pick for a causal LM (Mistral 3's is no AutoModelForCausalLM)."""
    import transformers

    from fp8kit.loaded_names import load_model

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model = load_model(path, dtype=dtype).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
    if dtype == torch.float32:
        # an fp8-format multimodal checkpoint (Gemma 3 it, Mistral 3) loads with its norms, towers and embeddings in
        # bfloat16 whatever dtype is asked, beside float32 dequantized Linears: the forward then fails on the mixed
        # matmul. float32 holds every 16-bit value exactly.
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.dtype in (torch.bfloat16, torch.float16):
                tensor.data = tensor.data.float()
    return model
