"""The model card of an FP8 variant, built with huggingface_hub's ModelCard so the Hub parses it.

License and gating fields are copied from the source card: a quantized copy carries the same terms.
"""

from __future__ import annotations

from pathlib import Path

SCHEME_TEXT = {
    "dynamic": "**FP8-Dynamic**: float8_e4m3fn weights with one scale per output channel; activations are "
               "quantized to FP8 per token at run time. The fastest general-purpose FP8 layout on Ada, Hopper "
               "and Blackwell GPUs.",
    "block": "**FP8-Block**: float8_e4m3fn weights with one scale per 128x128 block (the blocks of DeepSeek-V3 and "
             "Qwen3-FP8); activations are quantized per 1x128 group at run time.",
    "tensor": "**FP8 per-tensor**: float8_e4m3fn weights with one scale per tensor; activations are quantized "
              "per token at run time.",
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
        data = ModelCard(readme.read_text()).data.to_dict()
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


def _kept_text(kept: list[str], fmt: str) -> str:
    if not kept:
        return ""
    key = "ignore" if fmt == "compressed-tensors" else "modules_to_not_convert"
    return (f" {len(kept)} more Linear layer{'s' if len(kept) > 1 else ''} could not take this scheme and stay in the "
            f"source precision too (`quantization_config.{key}`), e.g. `{kept[0]}`.")


def build_card(repo_id: str, base_model: str, scheme: str, fmt: str, metrics: dict, command: str, terms: dict,
               kept: list[str] = ()):
    from huggingface_hub import ModelCard, ModelCardData

    from fp8kit import __version__

    data = ModelCardData(base_model=base_model, base_model_relation="quantized", library_name="transformers",
                         pipeline_tag="text-generation", tags=["fp8", fmt, "vllm", scheme, "fp8kit"], **terms)
    ppl = f"{metrics['ppl_ratio']:.4f}"
    body = f"""
# {repo_id.split('/')[-1]}

FP8 weights of [{base_model}](https://huggingface.co/{base_model}), made with fp8kit {__version__}.

{SCHEME_TEXT[scheme]} Format: {FORMAT_TEXT[fmt]}. Embeddings, `lm_head`, norms and MoE routers stay in the source precision.{_kept_text(list(kept), fmt)}

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
