"""The names transformers gives a checkpoint's tensors once it loads them.

transformers 5 renames some architectures' weights on loading (Gemma 3's `language_model.model.layers.N` and
`vision_tower.encoder` are `model.language_model.layers.N` and `model.vision_tower.encoder` in memory; Qwen2.5-VL's
`visual.` is `model.visual.`) and writes the checkpoint's names back on saving. Whatever meets the loaded model
(compressed-tensors' ignore list, our training loader filling a model built from config) needs the loaded names.
The renaming is transformers' own, the conversion mapping from_pretrained applies (transformers.conversion_mapping),
never a table of ours.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Callable

import torch


def key_renamer(model: torch.nn.Module) -> Callable[[str], str]:
    """checkpoint tensor name -> the name `model` (built from its config, on any device) has for it: what
    from_pretrained would do. The identity where transformers renames nothing for the architecture, or predates
    5.0. Renamings only: a converter (MoE experts fused into 3-D tensors) changes shapes, not just names, and
    such a tensor keeps its name."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return lambda name: name
    conversions = [c for c in get_model_conversion_mapping(model) if isinstance(c, WeightRenaming)]
    if not conversions:
        return lambda name: name
    meta = dict.fromkeys(model.state_dict(), True)  # decides whether the base model's prefix is added or stripped
    converters: list[WeightConverter] = []
    prefix = model.base_model_prefix  # not the model: the vLLM engine keeps this function, and it would keep the model

    def rename(name: str) -> str:
        renamed = rename_source_key(name, conversions, converters, prefix, meta)[0]
        module, _, leaf = name.rpartition(".")
        if renamed == name and module and leaf != "weight":
            # a tensor the model does not have (weight_scale, input_scale) takes its module's weight's renaming: the
            # base model's prefix is added or stripped only for names the model has
            weight = rename_source_key(f"{module}.weight", conversions, converters, prefix, meta)[0]
            if weight != f"{module}.weight":
                return f"{weight.removesuffix('.weight')}.{leaf}"
        return renamed
    return rename


def _causal_lm_classes(config) -> list:
    """Where from_pretrained would find the model of `config` as a causal LM: AutoModelForCausalLM, else the class
    config.json's `architectures` names (Mistral 3's Mistral3ForConditionalGeneration, which no causal-LM auto class
    maps), else the image-text-to-text auto class."""
    import transformers

    named = (getattr(config, "architectures", None) or [""])[0]
    model_class = getattr(transformers, named, None) if named else None
    return [transformers.AutoModelForCausalLM, *([model_class] if hasattr(model_class, "_from_config") else []),
            transformers.AutoModelForImageTextToText]


def _first_that_takes(config, make):
    """make(cls) for the first of _causal_lm_classes(config) whose auto mapping takes the config (ValueError)."""
    first = None
    for cls in _causal_lm_classes(config):
        try:
            return make(cls)
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e):
                raise
            first = first or e
    raise first


def build_model(config, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model from_pretrained would build for `config` as a causal LM, without weights (_causal_lm_classes).
    Raises ValueError when none takes the config."""
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return _first_that_takes(config, lambda cls: cls.from_config(config, **kwargs) if hasattr(cls, "from_config")
                             else cls._from_config(config, **kwargs))


def meta_model(src: Path) -> torch.nn.Module:
    """The model of src's config.json as from_pretrained would build it (build_model), on the meta device: no weight
    is read. Raises what transformers raises for a config it cannot read or an architecture it cannot build."""
    import transformers

    from fp8kit.quality import quiet

    with quiet():
        # never the checkpoint's own code (auto_map): transformers would ask on the terminal whether to run it
        config = transformers.AutoConfig.from_pretrained(src, trust_remote_code=False)
        with torch.device("meta"):
            return build_model(config)


def load_model(src: Path, **kwargs) -> torch.nn.Module:
    """The checkpoint's model with its weights, from the class build_model picks (calibration runs the whole model:
    AutoModelForCausalLM alone refused Mistral 3). Safetensors only: where transformers finds none it can use (a
    lone shard without its index), it fell back to a pytorch_model.bin beside them, unpickling it and calibrating
    other weights than the ones converted."""
    import transformers

    from fp8kit.errors import Fp8kitError

    config = transformers.AutoConfig.from_pretrained(src, trust_remote_code=False)
    # its loading bar and load report went to the converter's stderr, around our one line (fp8-convert --kv-cache)
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        with _without_adapter(src) as base:
            model = _first_that_takes(config, lambda cls: cls.from_pretrained(base, config=config,
                                                                              use_safetensors=True, **kwargs))
        # not the view, gone by now: llm-compressor's oneshot reads both again (its config, then the recipe beside it)
        model.config.name_or_path = model.name_or_path = str(src)
        return model
    except OSError as e:
        if "no file named" not in str(e):
            raise
        raise Fp8kitError(f"{src}: transformers loads safetensors weights only as model.safetensors or as the shards "
                          f"model.safetensors.index.json lists, and finds neither (pickle files are never read); "
                          f"rename the file or add the index") from e
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()


ADAPTER_CONFIG = "adapter_config.json"


@contextlib.contextmanager
def _without_adapter(src: Path):
    """`src`, or a view of it without its PEFT adapter. With peft installed, from_pretrained applies an adapter it
    finds beside the weights (transformers' integrations/peft.py, maybe_load_adapters, keyed on adapter_config.json,
    with no argument to turn it off), while fp8-convert converts the base weights alone: the KV-cache and static
    activation scales were calibrated on base + adapter, and publish's KL measured the adapter against its absence."""
    src = Path(src)
    if not (src / ADAPTER_CONFIG).is_file():
        yield src
        return
    from fp8kit.errors import Fp8kitError

    with tempfile.TemporaryDirectory(prefix="fp8kit-base-") as view:
        try:
            for entry in src.absolute().iterdir():  # links only: the weights stay where they are
                if entry.name != ADAPTER_CONFIG:
                    (Path(view) / entry.name).symlink_to(entry)
        except OSError as e:
            raise Fp8kitError(f"{src}: holds a PEFT adapter ({ADAPTER_CONFIG}), which transformers would apply to the "
                              f"weights it loads, and no folder of links without it could be made "
                              f"({e.strerror or e}); move the adapter's files out of {src}") from e
        yield Path(view)


def loaded_names(src: Path, modules: list[str]) -> dict[str, str]:
    """{checkpoint module name: its name in the model transformers loads}, for the Linear modules whose names differ.

    transformers matches compressed-tensors' `ignore` against the loaded names only (quantizer_compressed_tensors.py
    passes ct_config.ignore to compressed-tensors' apply_quantization_config), so a kept module listed by its
    checkpoint name alone got an FP8 wrapper whose scales the checkpoint lacks: NaN logits or a silently wrong vision
    tower. vLLM maps the names it reads through the model's hf_to_vllm_mapper, which takes both forms, so the ignore
    list names both. The model is built from config.json on the meta device (build_model): no weight is read.
    Empty where transformers renames nothing, cannot build the architecture, or predates 5.0."""
    if not modules:
        return {}
    try:
        model = meta_model(src)
        rename = key_renamer(model)
        linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        names = {}
        for module in modules:
            renamed = rename(f"{module}.weight").removesuffix(".weight")
            if renamed != module and renamed in linears:
                names[module] = renamed
        return names
    except Exception:  # noqa: BLE001 - an architecture transformers cannot build on meta, or a renaming it fails
        return {}
