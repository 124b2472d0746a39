"""Running the source model over calibration text: the samples, and the FP8 KV-cache scales (`--kv-cache fp8`).

vLLM turns on its FP8 KV cache for a compressed-tensors checkpoint whose config declares a `kv_cache_scheme`
(unless the user names a kv_cache_dtype) and divides keys and values by the checkpoint's `self_attn.k_scale` and
`v_scale` (vLLM 0.25 attention.py, "llm-compressor models declare an FP8 KV-cache scheme"; names remapped in
weight_utils.maybe_remap_kv_scale_name). Without scales it divides by 1.0, so keys or values beyond 448
saturate. The cached keys are those after the key norm and RoPE, which only running the model produces: this is
the one step of a streaming conversion that holds the whole model (on the conversion device).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp8kit.converter.schemes import scale_from_amax
from fp8kit.errors import Fp8kitError

DEFAULT_CALIBRATION = Path(__file__).parents[1] / "data" / "sample.txt"
KV_CACHE_DTYPES = ("fp8",)


def kv_cache_scheme() -> dict:
    """The `kv_cache_scheme` llm-compressor 0.14 writes for an FP8 per-tensor KV cache, field for field."""
    from fp8kit.converter.formats import quantization_args

    return quantization_args("tensor", dynamic=False)


def calibration_ids(tokenizer, text: str, seq_len: int) -> list[list[int]]:
    ids = tokenizer(text).input_ids
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) >= 8]


def calibration_samples(src_path: Path, calibration: str | Path | None, seq_len: int, why: str):
    """(tokenizer, token-id samples, calibration file) for `src_path`; `why` names the option in errors."""
    from transformers import AutoTokenizer

    calibration = Path(calibration) if calibration else DEFAULT_CALIBRATION
    try:
        text = calibration.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise Fp8kitError(f"{calibration}: cannot read the calibration text ({e})") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_path)
    except (OSError, ValueError) as e:
        raise Fp8kitError(f"{src_path}: {why} needs the model's tokenizer to calibrate ({e})") from e
    samples = calibration_ids(tokenizer, text, seq_len)
    if not samples:
        raise Fp8kitError(f"{calibration}: too little text to calibrate on (fewer than 8 tokens)")
    return tokenizer, samples, calibration


def kv_cache_scales(src_path: Path, calibration: str | Path | None, device: torch.device, scale_dtype: torch.dtype,
                    seq_len: int = 512) -> tuple[dict[str, torch.Tensor], int]:
    """({"<attention module>.k_scale": amax(keys) / 448, ".v_scale": ...}, number of samples): the largest key and
    value each attention layer caches over the calibration text, as llm-compressor's static min-max observer
    measures them. The keys are what transformers hands its attention function: after the key norm and RoPE,
    before grouped-query repetition, as vLLM caches them."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _, samples, _ = calibration_samples(src_path, calibration, seq_len, "--kv-cache fp8")
    attend = ALL_ATTENTION_FUNCTIONS["sdpa"]
    amax: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}

    def observe(module, query, key, value, attention_mask, **kwargs):
        for kind, states in (("k", key), ("v", value)):
            name = f"{names[id(module)]}.{kind}_scale"
            m = states.detach().abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, m), m)
        return attend(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("fp8kit_kv_amax", observe)
    model = AutoModelForCausalLM.from_pretrained(src_path, dtype="auto", device_map=str(device),
                                                 attn_implementation="fp8kit_kv_amax")
    names.update((id(m), n) for n, m in model.named_modules())
    with torch.no_grad():
        for ids in samples:
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the weight conversion that follows streams in small pieces
    if not amax:
        raise Fp8kitError(f"{src_path}: no attention layer ran through transformers' attention interface; "
                          f"--kv-cache fp8 does not support this architecture")
    return {k: scale_from_amax(a, scale_dtype).reshape(1).cpu() for k, a in amax.items()}, len(samples)
