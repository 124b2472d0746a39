"""The two on-disk FP8 formats: their `quantization_config` and their scale tensor names.

compressed-tensors: the dict llm-compressor 0.14 (compressed-tensors 0.19) writes for its FP8_DYNAMIC
and FP8_BLOCK presets, field for field, so that every loader of llm-compressor output reads ours.
fp8: the layout of DeepSeek-V3 and Qwen3-*-FP8 (`quant_method: fp8`); vLLM's Fp8Config reads
`ignored_layers`, transformers' FineGrainedFP8Config reads `modules_to_not_convert`, so both are written.
"""

from __future__ import annotations

from fp8kit.converter.select import natural_key
from fp8kit.converter.schemes import Scheme

FORMATS = ("compressed-tensors", "fp8")
COMPRESSED_TENSORS_VERSION = "0.19.0"  # the compressed-tensors config schema this mirrors


def quantization_args(strategy: str, dynamic: bool, group_size=None, block=None, observer=None) -> dict:
    return {"actorder": None, "block_structure": list(block) if block else None, "dynamic": dynamic,
            "group_size": group_size, "num_bits": 8, "observer": observer, "observer_kwargs": {},
            "scale_dtype": None, "strategy": strategy, "symmetric": True, "type": "float", "zp_dtype": None}


def ignore_list(kept: list[str], lm_head: bool = False, loaded: dict[str, str] | None = None) -> list[str]:
    """llm-compressor's recipes always name lm_head (tied or not) unless it is quantized; every other Linear
    left in source precision must be named too, or loaders would look for its scales. `loaded` ({checkpoint name:
    loaded name}, from fp8kit.loaded_names.loaded_names) adds the names transformers gives those modules once loaded."""
    kept = set(kept) | {(loaded or {}).get(name, name) for name in kept}
    return sorted(kept | (set() if lm_head else {"lm_head"}), key=natural_key)


def quantization_config(scheme: Scheme, fmt: str, kept: list[str], lm_head: bool = False,
                        loaded: dict[str, str] | None = None) -> dict:
    """`lm_head=True`: lm_head is quantized too. vLLM matches its ParallelLMHead by name only ("Linear" is a
    class-name target, and ParallelLMHead is not one), so the name joins the targets (vLLM 0.25
    compressed_tensors.py get_quant_method; its Fp8Config has no lm_head path, hence compressed-tensors only).
    `loaded`: see ignore_list."""
    ignore = ignore_list(kept, lm_head, loaded)
    if fmt == "fp8":
        config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "ignored_layers": ignore, "modules_to_not_convert": ignore}
        if scheme.block:
            config["weight_block_size"] = list(scheme.block)
        return config
    group = {
        "format": "float-quantized",
        "input_activations": quantization_args(scheme.activation_strategy, True, group_size=scheme.activation_group_size),
        "output_activations": None,
        "targets": ["Linear", "lm_head"] if lm_head else ["Linear"],
        "weights": quantization_args(scheme.weight_strategy, False, block=scheme.block, observer="memoryless_minmax"),
    }
    return {"config_groups": {"group_0": group}, "format": "float-quantized", "global_compression_ratio": None,
            "ignore": ignore, "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION}


def scale_name(scheme: Scheme, fmt: str) -> str:
    """Qwen's block FP8 checkpoints call the dequantization multiplier `weight_scale_inv`."""
    return "weight_scale_inv" if fmt == "fp8" and scheme.block else "weight_scale"
