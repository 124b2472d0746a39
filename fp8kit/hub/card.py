"""The model card of an FP8 variant, built with huggingface_hub's ModelCard so the Hub parses it.

License and gating fields are copied from the source card: a quantized copy carries the same terms.
"""

from __future__ import annotations

import re
from pathlib import Path

SCHEME_TEXT = {
    "dynamic": "**FP8-Dynamic**: float8_e4m3fn weights with one scale per output channel; activations are "
               "quantized to FP8 per token at run time. The fastest general-purpose FP8 layout on Ada, Hopper "
               "and Blackwell GPUs.",
    "block": "**FP8-Block**: float8_e4m3fn weights with one scale per 128x128 block (the blocks of DeepSeek-V3 and "
             "Qwen3-FP8); activations are quantized per 1x128 group at run time.",
    "tensor": "**FP8 per-tensor**: float8_e4m3fn weights with one scale per tensor; activations are quantized "
              "per token at run time.",
    "tensor-static": "**FP8 per-tensor, static activations** (llm-compressor's `FP8` scheme): float8_e4m3fn weights "
                     "with one scale per tensor, and one activation scale per layer calibrated ahead of time, so no "
                     "activation scale is computed at run time: vLLM's fastest FP8 layout. Activations past the "
                     "calibrated range are clipped.",
}
FORMAT_TEXT = {
    "compressed-tensors": "`compressed-tensors` (`weight_scale` beside each weight)",
    "fp8": "`fp8` (`quant_method: fp8`, 128x128 block scales as `weight_scale_inv`, the layout of DeepSeek-V3 and "
           "Qwen3-*-FP8)",
}
COPIED_FIELDS = ("license", "license_name", "license_link", "gated", "language")


def source_terms(src: Path) -> dict:
    """License and gating metadata of the source card (README.md), if it has one."""
    readme = src / "README.md"
    if not readme.exists():
        return {}
    from huggingface_hub import ModelCard

    from fp8kit.errors import Fp8kitError

    try:
        text = readme.read_text()
        if not re.match(r"\s*---[\r\n]", text):  # no metadata header: ModelCard would log a warning about it
            return {}
        data = ModelCard(text).data.to_dict()
    except Exception as e:  # noqa: BLE001 - yaml's errors, a non-mapping header, UnicodeDecodeError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise Fp8kitError(f"{readme}: its metadata header cannot be read ({first}); fix its YAML front matter "
                          f"or move the README away") from e
    return {k: v for k, v in data.items() if k in COPIED_FIELDS or k.startswith("extra_gated")}


def kept_layers(conversion: Path) -> list[str]:
    """Linear layers the conversion left in the source precision besides lm_head (its config's ignore list:
    compressed-tensors' `ignore`, the fp8 format's `modules_to_not_convert`): for block, every layer whose shape is
    not a multiple of 128."""
    import json

    from fp8kit.converter.safetensors_io import read_header
    from fp8kit.converter.select import is_candidate  # the decoder Linears a scheme quantizes (not routers)

    qc = json.loads((conversion / "config.json").read_text()).get("quantization_config") or {}
    # by the checkpoint's names only: the list also names each kept module as transformers loads it (Gemma 3's
    # `language_model.model.layers.N` as `model.language_model.layers.N`), which would count it twice
    weights = {name for f in conversion.glob("*.safetensors") for name in read_header(f)[0]}
    listed = qc.get("ignore") or qc.get("modules_to_not_convert") or []
    return [name for name in listed if is_candidate(name) and f"{name}.weight" in weights]


def _kept_text(kept: list[str], fmt: str, options: dict) -> str:
    lm_head = options.get("lm_head")
    text = (f"Embeddings, norms and MoE routers stay in the source precision; `lm_head` is FP8 too (less weight memory "
            f"on large vocabularies, less accurate logits)." if lm_head else
            "Embeddings, `lm_head`, norms and MoE routers stay in the source precision.")
    if not kept:
        return text
    key = "ignore" if fmt == "compressed-tensors" else "modules_to_not_convert"
    plural = "s" if len(kept) > 1 else ""
    if options.get("ignore"):
        patterns = ", ".join(f"`{p}`" for p in options["ignore"])
        return (f"{text} {len(kept)} more Linear layer{plural} stay in the source precision too "
                f"(`quantization_config.{key}`): those matching {patterns}, and any the scheme could not take, "
                f"e.g. `{kept[0]}`.")
    return (f"{text} {len(kept)} more Linear layer{plural} could not take this scheme and stay in the source "
            f"precision too (`quantization_config.{key}`), e.g. `{kept[0]}`.")


def _static_text(scheme: str, options: dict) -> str:
    if scheme != "tensor-static":
        return ""
    calibrated = f" on {options['calibration']['file']}" if options.get("calibration") else ""
    return (f" The activation scales were calibrated{calibrated}. For RL, whose trainer "
            f"quantizes activations per token (`fp8kit.rl.load_model`), use the dynamic or tensor variant: rollouts "
            f"with these static scales would not match the trainer's log-probabilities.")


def _kv_cache_text(options: dict) -> str:
    if not options.get("kv_cache"):
        return ""
    return (f"\n\nKV cache: FP8 scales for each layer's keys and values (`self_attn.k_scale`, `self_attn.v_scale`), "
            f"calibrated on {options['calibration']['file']}, and a `kv_cache_scheme` in `config.json`: vLLM serves "
            f"this model with an FP8 KV cache (half the bytes per cached token of a BF16 cache) unless "
            f"`--kv-cache-dtype` is given (`--kv-cache-dtype bfloat16` keeps BF16). The validation below includes "
            f"it: transformers quantizes the cached keys and values with these scales too.")


def build_card(repo_id: str, base_model: str, scheme: str, fmt: str, metrics: dict, command: str, terms: dict,
               kept: list[str] = (), options: dict | None = None):
    """`options`: fp8-convert's options the variant was made with, as publish.conversion_options records them."""
    from huggingface_hub import ModelCard, ModelCardData

    from fp8kit import __version__

    data = ModelCardData(base_model=base_model, base_model_relation="quantized", library_name="transformers",
                         pipeline_tag="text-generation", tags=["fp8", fmt, "vllm", scheme, "fp8kit"], **terms)
    ppl = f"{metrics['ppl_ratio']:.4f}"
    body = f"""
# {repo_id.split('/')[-1]}

FP8 weights of [{base_model}](https://huggingface.co/{base_model}), made with fp8kit {__version__}.

{SCHEME_TEXT[scheme]}{_static_text(scheme, options or {})} Format: {FORMAT_TEXT[fmt]}. {_kept_text(list(kept), fmt, options or {})}{_kv_cache_text(options or {})}

## Validation

Compared with {base_model} on {metrics['tokens']} tokens ({metrics['token_source']}), both loaded with transformers:

| metric | value |
|---|---|
| mean per-token KL divergence (nats) | {metrics['kl']:.3e} |
| top-1 next-token agreement | {metrics['top1']:.4f} |
| perplexity ratio (FP8 / source) | {ppl} |

## Usage

vLLM:
```bash
vllm serve {repo_id}
```

SGLang:
```bash
python -m sglang.launch_server --model-path {repo_id}
```

transformers (with `compressed-tensors` installed for the compressed-tensors format):
```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{repo_id}", device_map="auto")
tokenizer = AutoTokenizer.from_pretrained("{repo_id}")
```

## How it was made

```bash
{command}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
