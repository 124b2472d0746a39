"""Running the source model over calibration text: the samples, and the FP8 KV-cache scales (`--kv-cache fp8`).

vLLM turns on its FP8 KV cache for a compressed-tensors checkpoint whose config declares a `kv_cache_scheme`
(unless the user names a kv_cache_dtype) and divides keys and values by the checkpoint's `self_attn.k_scale` and
`v_scale` (vLLM 0.25 attention.py, "llm-compressor models declare an FP8 KV-cache scheme"; names remapped in
weight_utils.maybe_remap_kv_scale_name). Without scales it divides by 1.0, so keys or values beyond 448
saturate. The cached keys are those after the key norm and RoPE, which only running the model produces: this is
the one step of a streaming conversion that holds the whole model (on the conversion device).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fp8kit.converter.formats import quantization_args
from fp8kit.converter.schemes import scale_from_amax
from fp8kit.converter.select import NOT_LANGUAGE
from fp8kit.errors import Fp8kitError, first_line

DEFAULT_CALIBRATION = Path(__file__).parents[1] / "data" / "sample.txt"
KV_CACHE_DTYPES = ("fp8",)


def kv_cache_scheme() -> dict:
    """The `kv_cache_scheme` llm-compressor 0.14 writes for an FP8 per-tensor KV cache, field for field."""
    return quantization_args("tensor", dynamic=False)


def calibration_ids(tokenizer, text: str, seq_len: int) -> list[list[int]]:
    ids = tokenizer(text).input_ids
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) >= 8]


def read_calibration(calibration: str | Path | None) -> tuple[Path, str]:
    """The calibration file (the shipped sample when None) and its text, or one line saying why it cannot be read."""
    calibration = Path(calibration).expanduser() if calibration else DEFAULT_CALIBRATION
    try:
        return calibration, calibration.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise Fp8kitError(f"{calibration}: cannot read the calibration text ({e})") from e


def calibration_tokenizer(src_path: Path, why: str):
    """The tokenizer calibration reads `src_path`'s text with; `why` names the option in errors."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src_path)
    except Exception as e:  # noqa: BLE001 - which error depends on the files present and on the packages installed
        # transformers' messages run over several lines: the first says what failed
        reason = first_line(e)
        raise Fp8kitError(f"{src_path}: {why} needs the model's tokenizer to calibrate and none loads from it "
                          f"({reason}); copy the model's tokenizer files (tokenizer.json, tokenizer_config.json) "
                          f"into {src_path}") from e


def calibration_samples(src_path: Path, calibration: str | Path | None, seq_len: int, why: str):
    """(tokenizer, token-id samples, calibration file) for `src_path`; `why` names the option in errors."""
    calibration, text = read_calibration(calibration)
    tokenizer = calibration_tokenizer(src_path, why)
    samples = calibration_ids(tokenizer, text, seq_len)
    if not samples:
        raise Fp8kitError(f"{calibration}: too little text to calibrate on (fewer than 8 tokens)")
    return tokenizer, samples, calibration


def checkpoint_prefix(module_name: str, checkpoint_keys) -> str:
    """The checkpoint's name for the attention module transformers calls `module_name`: the prefix of the one
    `k_proj.weight` whose name ends like it from `layers.` on (multimodal classes rename their language model,
    e.g. `model.language_model.layers.0.self_attn` is `language_model.model.layers.0.self_attn` on disk). The
    vision and audio towers' layers end alike (`vision_tower.encoder.layers.0.self_attn`) and are left out: the
    calibration text runs through the language model only."""
    tail = module_name[module_name.find("layers."):] if "layers." in module_name else module_name
    matches = [k for k in checkpoint_keys if (k == f"{tail}.k_proj.weight" or k.endswith(f".{tail}.k_proj.weight"))
               and not NOT_LANGUAGE.search(k)]
    if len(matches) != 1:
        raise Fp8kitError(f"attention module {module_name}: {len(matches)} checkpoint tensors end in "
                          f"{tail}.k_proj.weight, expected one; --kv-cache fp8 does not support this architecture")
    return matches[0][: -len(".k_proj.weight")]


def kv_cache_scales(src_path: Path, calibration: str | Path | None, device: torch.device, scale_dtype: torch.dtype,
                    tensors: dict, seq_len: int = 512) -> tuple[dict[str, torch.Tensor], str]:
    """({"<attention module>.k_scale": amax(keys) / 448, ".v_scale": ...}, what they were calibrated on): the
    largest key and value each attention layer caches over the calibration text, as llm-compressor's static
    min-max observer measures them. The keys are what transformers hands its attention function: after the key
    norm and RoPE, before grouped-query repetition, as vLLM caches them. The model runs its own attention function
    and masks (sliding windows, soft-capping), with an observer in front."""
    from transformers import AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from fp8kit.loaded_names import load_model

    _, samples, calibration = calibration_samples(src_path, calibration, seq_len, "--kv-cache fp8")
    amax: dict[str, torch.Tensor] = {}
    # entries of this call only, removed afterwards. The mask entry must be global: transformers 5 builds no mask
    # (so no sliding window) for an implementation missing from the mask table's _global_mapping
    # (masking_utils._preprocess_mask_arguments).
    observer = f"fp8kit_kv_amax_{id(amax)}"
    model = None
    try:
        model = load_model(src_path, dtype="auto", device_map=str(device))
        original = model.config._attn_implementation  # what transformers picked for this model
        names = {id(m): n for n, m in model.named_modules()}

        def observe(module, query, key, value, attention_mask, **kwargs):
            for kind, states in (("k", key), ("v", value)):
                name = f"{names[id(module)]}.{kind}_scale"
                m = states.detach().abs().amax().float()
                amax[name] = torch.maximum(amax.get(name, m), m)
            # eager attention lives in each model's own module, not in the shared table
            attend = (sys.modules[type(module).__module__].eager_attention_forward if original == "eager"
                      else ALL_ATTENTION_FUNCTIONS[original])
            return attend(module, query, key, value, attention_mask, **kwargs)

        ALL_ATTENTION_FUNCTIONS[observer] = observe
        AttentionMaskInterface.register(observer, ALL_MASK_ATTENTION_FUNCTIONS[original])
        model.set_attn_implementation(observer)
        with torch.no_grad():
            for ids in samples:
                model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
    except torch.OutOfMemoryError as e:
        raise Fp8kitError(f"{src_path}: --kv-cache fp8 runs the whole model over the calibration text and ran out of "
                          f"memory on {device}; pass --device cpu") from e
    except Fp8kitError:
        raise
    except Exception as e:  # noqa: BLE001 - an architecture transformers does not know, token ids past the vocabulary
        raise model_run_error(src_path, "--kv-cache fp8", e, "convert without --kv-cache") from e
    finally:
        if observer in ALL_ATTENTION_FUNCTIONS:
            del ALL_ATTENTION_FUNCTIONS[observer]
        AttentionMaskInterface._global_mapping.pop(observer, None)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the weight conversion that follows streams in small pieces
    if not amax:
        raise Fp8kitError(f"{src_path}: no attention layer ran through transformers' attention interface; "
                          f"--kv-cache fp8 does not support this architecture")
    keys = list(tensors)
    scales = {}
    for name, a in amax.items():
        module, _, leaf = name.rpartition(".")
        if not bool(torch.isfinite(a)):  # vLLM would serve a NaN or inf scale as NaN
            from fp8kit.converter.streaming import check_all_finite

            # a NaN or Inf weight was blamed on the activations: the weights are read only now (the conversion, which
            # names such a weight, runs after the calibration)
            check_all_finite(tensors)
            states = "keys" if leaf == "k_scale" else "values"
            raise Fp8kitError(f"{src_path}: the {states} of {module} reach {a.item()} on the calibration text (the "
                              f"model's activations overflow its dtype); convert a bfloat16 or float32 copy of it, or "
                              f"without --kv-cache; nothing was written")
        scales[f"{checkpoint_prefix(module, keys)}.{leaf}"] = scale_from_amax(a, scale_dtype).reshape(1).cpu()
    return scales, f"{len(samples)} sequences from {calibration.name}"


def model_run_error(src_path: Path, option: str, e: Exception, fix: str) -> Fp8kitError:
    """One line for a model that transformers cannot load or run over the calibration text."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return Fp8kitError(f"{src_path}: {option} runs the model in transformers, which failed ({type(e).__name__}: "
                       f"{first}); {fix}")
