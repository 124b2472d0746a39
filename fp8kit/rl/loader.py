"""`load_fp8_model`: a transformers model whose quantized Linears are FP8LoRALinear, filled straight from
an FP8 checkpoint (ours, llm-compressor's, or the `fp8` format of Qwen3-*-FP8).

The architecture is built with its parameters on the meta device; every tensor is then placed from the
safetensors files as it is read, so no full-precision copy of a quantized weight ever exists.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from fp8kit.converter.select import NOT_LANGUAGE
from fp8kit.errors import Fp8kitError
from fp8kit.rl.bf16_lora import LoRALinear
from fp8kit.rl.fp8_linear import GROUP, FP8LoRALinear, check_lora_settings, scale_shape_error
from fp8kit.rl.fp8_mlp import fuse_gated_mlps

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
RECONVERT = "re-download the checkpoint or convert it again"
DEFAULT_SEED = 3407  # Unsloth's random_state default


def _one_line(e: BaseException) -> str:
    """An exception's text on one line (OSError: just its reason), for inclusion in an Fp8kitError."""
    text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return " ".join(text.split()) or type(e).__name__


def _short_repr(value, width: int) -> str:
    """repr(value) on one line, cut to `width` characters: an error message stays one line."""
    return " ".join(repr(value).split())[:width]


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters are created on the meta device, buffers (rotary tables) for real, as accelerate's
    init_empty_weights(include_buffers=False) does."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _scheme(qc: dict, where: str = "config.json") -> str:
    """The FP8 scheme, or one Fp8kitError line naming `where` for anything else (INT8 W8A8, FP4, e5m2, ...)."""
    from fp8kit.quality import scheme_of

    return scheme_of(qc, where)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, file: str) -> None:
    """`value` in the place the model has for `name`, with the shape the config gives it (`file`: where it was read,
    for the error line)."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError as e:
        raise Fp8kitError(f"checkpoint tensor {name!r} has no place in the model (fused MoE experts and extra "
                          f"heads such as MTP layers are not supported by load_fp8_model yet)") from e
    if leaf in module._parameters:
        _check_shape(name, value, module._parameters[leaf], file)
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        _check_shape(name, value, module._buffers[leaf], file)
        module._buffers[leaf] = value
    else:
        raise Fp8kitError(f"checkpoint tensor {name!r} has no place in the model")


def _check_shape(name: str, value: torch.Tensor, expected: torch.Tensor | None, file: str) -> None:
    """A tensor whose shape is not the config's failed at the first forward, as a torch error far from its cause."""
    if expected is not None and value.shape != expected.shape:
        raise Fp8kitError(f"{file}: {name} has shape {list(value.shape)}, but config.json gives the model "
                          f"{list(expected.shape)}: the weights and config.json do not belong together; {RECONVERT}")


def _source_precision(tensors: dict, name: str, expected: torch.Tensor | None, where: str) -> torch.Tensor:
    """A tensor stored in source precision, checked: an FP8 weight whose scale is missing would otherwise be taken
    for its values (FP8 codes up to 448 where the weights are ~1e-2), a model that loads and computes garbage."""
    file = _file_of(tensors[name], where)
    value = tensors[name]()
    if value.dtype in FP8_DTYPES:
        raise Fp8kitError(f"{file}: {name} is {str(value.dtype).removeprefix('torch.')} with no weight scale beside "
                          f"it, so its values cannot be recovered; {RECONVERT}")
    _check_shape(name, value, expected, file)
    return value


def checkpoint_tensors(path: Path, device: torch.device) -> dict[str, Callable[[], torch.Tensor]]:
    """Every tensor of the checkpoint's weight files, read only when asked for (straight to `device`): the files
    transformers reads (model.safetensors alone, else the index's shards, else every *.safetensors but Mistral's
    consolidated one), as fp8-convert reads them."""
    from safetensors import SafetensorError, safe_open

    from fp8kit.converter.source import weight_files

    getters = {}
    for f in weight_files(path):
        try:
            with safe_open(f, "pt") as sf:
                keys = list(sf.keys())
        except (OSError, SafetensorError) as e:
            raise Fp8kitError(f"{f}: not a readable safetensors file, truncated or corrupt ({_one_line(e)}); "
                              f"{RECONVERT}") from e
        for k in keys:
            getters[k] = functools.partial(_read_tensor, f, k, str(device))
    return getters


def _read_tensor(file: Path, key: str, device: str) -> torch.Tensor:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, "pt", device=device) as sf:
            return sf.get_tensor(key)
    except (OSError, SafetensorError) as e:
        raise Fp8kitError(f"{file}: cannot read tensor {key!r} ({_one_line(e)}); {RECONVERT}") from e


def check_device(device) -> torch.device:
    """'cpu', 'cuda', 'cuda:N', an index or a torch.device, checked against the GPUs visible here; as a torch.device
    (an index means that CUDA GPU, also on machines where torch.device(int) would fail for want of one; 'cpu:N' is
    the CPU)."""
    shown = repr(str(device)) if isinstance(device, torch.device) else repr(device)
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
            else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise Fp8kitError(f"device={shown}: not a device; use 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type not in ("cpu", "cuda"):
        raise Fp8kitError(f"device={shown}: the FP8 layers run on 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise Fp8kitError(f"device={shown}: no CUDA GPU is visible here; use device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise Fp8kitError(f"device={shown}: only {torch.cuda.device_count()} CUDA GPU(s) are visible here")
    return torch.device("cpu") if dev.type == "cpu" else dev  # safetensors refuses 'cpu:N'; there is one CPU device


def check_seed(seed) -> int:
    """The LoRA initialisation seed: an integer >= 0 (a bool, float or string is refused in one line)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise Fp8kitError(f"seed={seed!r}: expected an integer >= 0 (the LoRA initialisation seed, default "
                          f"{DEFAULT_SEED})")
    return seed


def seed_lora(model: nn.Module, seed: int = DEFAULT_SEED) -> None:
    """Every LoRA A drawn afresh with PEFT's initialisation (Kaiming-uniform; B stays as it is, zero after loading),
    from `seed` and the module's name, in float32 on the CPU and then cast: the same seed gives the same A on any
    device and in any dtype, in the FP8 model and the BF16 baseline alike, whichever other modules carry LoRA.
    The global random state is neither read nor advanced."""
    with torch.no_grad():
        for name, module in lora_modules(model).items():
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            a = torch.empty(tuple(module.lora_A.shape), dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            module.lora_A.copy_(a)


def _rng_devices(device: torch.device | None) -> list[int]:
    """The CUDA devices whose random state building the layers may advance (init_lora draws on the weights'
    device): the load's device, or for views of a vLLM engine (device None) the current one."""
    if device is not None:
        return [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
    return [torch.cuda.current_device()] if torch.cuda.is_initialized() else []


def _file_of(getter, where: str) -> str:
    """The safetensors file a tensor getter reads (a vLLM view has none: `where` then)."""
    return str(getter.args[0]) if isinstance(getter, functools.partial) and getter.args else where


def lora_targets(lora_rank, lora_alpha, target_modules, lora_dropout=0.0, device=None) -> set[str]:
    """The LoRA arguments checked before anything is loaded or converted (each mistake otherwise surfaces as a
    torch error, or as a model without LoRA); the target leaf names as a set."""
    check_lora_settings(lora_rank, lora_alpha, lora_dropout, "lora_")
    if device is not None:
        check_device(device)
    if target_modules is None:
        return set(DEFAULT_TARGETS)
    names = [target_modules] if isinstance(target_modules, str) else target_modules
    if not isinstance(names, (list, tuple, set)) or not names:
        raise Fp8kitError(f"target_modules={target_modules!r}: expected a list of Linear leaf names such as "
                          f"['q_proj', 'v_proj'], or None for every projection")
    for name in names:
        if not isinstance(name, str) or not name or "." in name:
            raise Fp8kitError(f"target_modules: {name!r} is not a leaf name; name Linears by their last part, such "
                              f"as 'q_proj' (vLLM's LoRA matches the same names)")
    return set(names)


def assemble(config, tensors: dict[str, Callable[[], torch.Tensor]], scheme: str | None, dtype: torch.dtype,
             lora_rank: int, lora_alpha: float | None, targets: set[str], lora_dropout: float,
             backend: str | None, where: str, seed: int = DEFAULT_SEED,
             device: torch.device | None = None) -> nn.Module:
    """The transformers model for `config` built on the meta device and filled from `tensors` (name -> getter):
    the checkpoint's files, or views of a vLLM engine's parameters. Quantized Linears (those with a scale)
    become FP8LoRALinear; Linears in source precision (all of them with scheme None; in an FP8 checkpoint those
    the converter kept, e.g. block FP8's MLP of a width that is no multiple of 128) named in `targets` become the
    BF16 LoRALinear, so an FP8 model and its BF16 baseline carry LoRA on the same modules. LoRA A is drawn from
    `seed` (seed_lora); `device`: where the tensors live (None: vLLM's GPU)."""
    from fp8kit.loaded_names import key_renamer

    with _parameters_on_meta():
        model = _model_for(config, dtype, where)
    # the checkpoint's names as the model has them (Gemma 3 multimodal's `language_model.model.layers.N` is
    # `model.language_model.layers.N` once built), as from_pretrained renames them
    rename = key_renamer(model)
    tensors = {rename(k): get for k, get in tensors.items()}
    scale_suffix = next((s for s in ("weight_scale_inv", "weight_scale") if any(k.endswith("." + s) for k in tensors)),
                        None) if scheme else None
    quantized = {k[: -len(".weight")] for k in tensors if k.endswith(".weight")
                 and k[: -len("weight")] + str(scale_suffix) in tensors} if scheme else set()
    # a vision or audio tower's Linears stay as they are: text-only GRPO never runs them, and vLLM puts LoRA on the
    # language model alone
    plain = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n + ".weight" in tensors
             and n not in quantized and not NOT_LANGUAGE.search(n)}
    leaves = {n.rsplit(".", 1)[-1] for n in quantized | plain if not NOT_LANGUAGE.search(n)}
    if lora_rank:
        # every target named by the caller must exist; of the defaults, at least one (architectures differ)
        unmatched = sorted(targets - leaves) if targets != set(DEFAULT_TARGETS) else []
        if "lm_head" in unmatched and isinstance(getattr(model, "lm_head", None), nn.Linear):
            # tied: its weight is the embeddings' (no lm_head.weight in the checkpoint), which LoRALinear cannot
            # share, and vLLM puts no LoRA on lm_head
            raise Fp8kitError(f"{where}: target_modules 'lm_head': this model ties lm_head to its input embeddings, "
                              f"and LoRA on a tied lm_head is not supported; leave 'lm_head' out")
        if unmatched or not targets & leaves:
            raise Fp8kitError(f"{where}: target_modules {(unmatched or sorted(targets))[0]!r} matches no Linear of the "
                              f"model; its Linears are {', '.join(sorted(leaves))}")
    if scheme == "block":  # before any weight is read
        for name in sorted(quantized):
            module = _submodule(model, name)
            if isinstance(module, nn.Linear) and module.in_features % GROUP:
                raise Fp8kitError(
                    f"{_file_of(tensors[name + '.weight'], where)}: {name} is block FP8 with in_features "
                    f"{module.in_features}, not a multiple of {GROUP} (partial blocks along K, as llm-compressor "
                    f"writes them), which fp8kit's block layers cannot compute; convert the source model again with "
                    f"`fp8-convert SRC OUT --scheme block`, which keeps such Linears in source precision")
    # every quantized Linear becomes an FP8 layer (LoRA only on targets); of the others only the targets change
    lora_linears = quantized | ({n for n in plain if n.rsplit(".", 1)[-1] in targets} if lora_rank else set())
    # the layers' own LoRA initialisation draws from the global generators: forked, so the caller's random state
    # stays as it was; seed_lora then draws every A from the seed
    with torch.random.fork_rng(devices=_rng_devices(device)):
        for name in sorted(lora_linears):
            module = _submodule(model, name)
            if module is None:
                raise Fp8kitError(f"{where}: quantized module {name} has no counterpart in the model (fused MoE "
                                  f"experts are not supported by load_fp8_model yet)")
            if not isinstance(module, nn.Linear):
                raise Fp8kitError(f"{where}: {name} is quantized in the checkpoint but is a {type(module).__name__} "
                                  f"here")
            bias = None
            if module.bias is not None:
                if name + ".bias" not in tensors:
                    raise Fp8kitError(f"{where}: lacks {name}.bias, which config.json gives the model; {RECONVERT}")
                bias = _source_precision(tensors, name + ".bias", module.bias, where).to(dtype)
            elif name + ".bias" in tensors:  # dropped silently, it changed every output of the layer
                raise Fp8kitError(f"{_file_of(tensors[name + '.bias'], where)}: checkpoint tensor {name}.bias has no "
                                  f"place in the model: config.json gives {name} no bias (attention_bias, mlp_bias); "
                                  f"the weights and config.json do not belong together")
            # the language model only: a checkpoint that quantized a vision tower's q_proj gave it LoRA, which the
            # adapter's exclude_modules then told peft to drop
            rank = lora_rank if name.rsplit(".", 1)[-1] in targets and not NOT_LANGUAGE.search(name) else 0
            if name in quantized:
                weight, scale = tensors[name + ".weight"](), tensors[f"{name}.{scale_suffix}"]()
                _check_fp8_layer(name, weight, scale, scheme, module, scale_suffix,
                                 _file_of(tensors[name + ".weight"], where))
                layer = FP8LoRALinear(weight, scale, scheme, bias, rank=rank, alpha=lora_alpha, dropout=lora_dropout,
                                      dtype=dtype, backend=backend)
            else:
                layer = LoRALinear(_source_precision(tensors, name + ".weight", module.weight, where).to(dtype), bias,
                                   rank=rank, alpha=lora_alpha, dropout=lora_dropout, dtype=dtype)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, layer)
    seed_lora(model, seed)
    fuse_gated_mlps(model)
    placed = {f"{m}.{leaf}" for m in lora_linears for leaf in ("weight", scale_suffix, "bias")}
    for key in tensors:
        # static activation and KV-cache scales serve vLLM; the trainer quantizes activations dynamically and
        # keeps its attention in the compute dtype. Rotary tables that older transformers saved per layer are
        # recomputed from the config (transformers skips them too).
        if key in placed or re.search(r"\.(input_scale|weight_zero_point|k_scale|v_scale)$|rotary_emb\.inv_freq$", key):
            continue
        tensor = _source_precision(tensors, key, None, where)  # its shape: checked where _set_tensor places it
        _set_tensor(model, key, tensor.to(dtype) if tensor.is_floating_point() else tensor,
                    _file_of(tensors[key], where))
    if getattr(config, "tie_word_embeddings", False) or getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise Fp8kitError(f"{where}: lacks {len(missing)} tensors the model needs, e.g. {missing[0]}")
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith(("lora_A", "lora_B")))
    model.eval()  # as from_pretrained returns a model: LoRA dropout off until training turns it on
    model.fp8_scheme = scheme
    # transformers' own would write the frozen base (FP8 weights under a config without their quantization_config,
    # which loads as another model); peft's PeftModel.save_pretrained writes the adapter alone, and so does this
    # (partials, not bound methods: pickle names them, so torch.save of the model loads back)
    model.save_pretrained = functools.partial(_save_pretrained, model)
    model.push_to_hub = functools.partial(_push_to_hub, model)
    return model


def _check_fp8_layer(name: str, weight: torch.Tensor, scale: torch.Tensor, scheme: str, module: nn.Linear,
                     scale_suffix: str, file: str) -> None:
    """The FP8 weight and its scale as the scheme and the config's Linear shape want them, checked before the layer
    is built (a wrong one failed at the first forward, as a torch error)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise Fp8kitError(f"{file}: {name}.weight is {str(weight.dtype).removeprefix('torch.')} beside its "
                          f"{scale_suffix}; FP8 weights are float8_e4m3fn; {RECONVERT}")
    _check_shape(f"{name}.weight", weight, module.weight, file)
    if why := scale_shape_error(*module.weight.shape, scale, scheme):
        raise Fp8kitError(f"{file}: {name}.{scale_suffix} has shape {list(scale.shape)}; {why}; {RECONVERT}")


def _model_for(config, dtype: torch.dtype, where: str) -> nn.Module:
    """The model from_pretrained would build (loaded_names.build_model), or one line saying there is none."""
    import transformers

    from fp8kit.loaded_names import build_model

    try:
        return build_model(config, dtype)
    except ValueError as e:  # its message lists every config class transformers has: not repeated here
        raise Fp8kitError(f"{where}: transformers {transformers.__version__} builds no causal language model for "
                          f"model_type {config.model_type!r}; fp8kit.rl trains decoder language models (a model_type "
                          f"newer than this transformers needs an upgrade)") from e


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _save_pretrained(model: nn.Module, save_directory=None, *args, **kwargs) -> None:
    """model.save_pretrained(folder) for models of load_fp8_model, load_lora_model and load_model: the LoRA adapter in
    PEFT's format (save_adapter), as peft's PeftModel.save_pretrained saves only the adapter; the base is the
    checkpoint the model came from. transformers' Trainer calls it with state_dict= (transformers 5.17,
    Trainer._save), peft's callers with safe_serialization= or selected_adapters=: those and the other options of
    the two are taken and change nothing (the adapter is read from the model's own LoRA parameters, always as
    safetensors), except is_main_process=False, which writes nothing as in both; push_to_hub=True is refused."""
    if args:
        raise Fp8kitError(f"save_pretrained: {len(args)} positional argument(s) after the folder; pass options by name")
    if kwargs.get("push_to_hub", False) is not False:
        raise Fp8kitError("save_pretrained(push_to_hub=True): fp8kit does not upload; save the adapter with "
                          "save_pretrained(folder), then upload the folder (huggingface_hub's upload_folder)")
    selected = kwargs.get("selected_adapters")
    if selected is not None and list(selected) != ["default"]:
        raise Fp8kitError(f"save_pretrained(selected_adapters={selected!r}): these models carry one adapter, "
                          f"'default'; drop the option")
    is_main_process = kwargs.get("is_main_process", True)
    if not isinstance(is_main_process, bool):
        raise Fp8kitError(f"save_pretrained(is_main_process={is_main_process!r}): expected True or False")
    if not isinstance(save_directory, (str, os.PathLike)):
        raise Fp8kitError(f"save_pretrained({save_directory!r:.60}): expected a folder path (str or pathlib.Path)")
    if is_main_process:
        save_adapter(model, save_directory)


def _push_to_hub(model: nn.Module, *args, **kwargs):
    raise Fp8kitError("push_to_hub: fp8kit does not upload; model.save_pretrained(folder) writes the LoRA adapter in "
                      "PEFT's format, then upload that folder (huggingface_hub's upload_folder)")


def read_config(path: Path):
    """(config without its quantization_config, FP8 scheme or None for a full-precision checkpoint)."""
    from transformers import AutoConfig

    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise Fp8kitError(f"{file}: missing; pass a Hugging Face checkpoint directory (config.json and "
                          f"*.safetensors)") from e
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 or not JSON
        raise Fp8kitError(f"{file}: unreadable or not JSON ({_one_line(e)}); {RECONVERT}") from e
    if not isinstance(raw, dict):
        raise Fp8kitError(f"{file}: not a JSON object; {RECONVERT}")
    from huggingface_hub.errors import StrictDataclassError  # a field of the wrong type (tie_word_embeddings "false")

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StrictDataclassError) as e:
        raise Fp8kitError(f"{file}: transformers cannot build a config from it ({_one_line(e)}); check its model_type "
                          f"(a newer transformers may be needed) or {RECONVERT}") from e
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return config, None
    qc = qc if isinstance(qc, dict) else qc.to_dict()  # a non-object one fails in AutoConfig above
    scheme = _scheme(qc, str(file))
    del config.quantization_config
    return config, scheme


def static_activation_scales(path: Path) -> bool:
    """fp8kit.quality.static_activations of the checkpoint's quantization_config."""
    from fp8kit.quality import static_activations

    try:
        qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return static_activations(qc)


def load_fp8_model(path_or_name: str | Path, dtype: torch.dtype = torch.bfloat16, lora_rank: int = 16,
                   lora_alpha: float | None = None, target_modules: list[str] | tuple[str, ...] | None = None,
                   lora_dropout: float = 0.0, device: str | torch.device = "cpu", backend: str | None = None,
                   seed: int = DEFAULT_SEED):
    """Returns the transformers causal LM with FP8 base weights and LoRA on `target_modules` (leaf names;
    default every projection, also those the checkpoint keeps in source precision). A name goes through the
    registry (an FP8 upload, or a cached conversion). `seed` draws the LoRA initialisation (Unsloth's
    random_state default, 3407) without touching the global random state. model.save_pretrained(folder) saves
    the adapter in PEFT's format (as save_adapter)."""
    _check_dtype(dtype)
    lora_targets(lora_rank, lora_alpha, target_modules, lora_dropout, device)
    check_seed(seed)
    path = Path(path_or_name).expanduser()
    local = path.is_dir()
    if not local:
        from fp8kit.registry import ensure

        path = ensure(str(path_or_name), "auto")
    config, scheme = read_config(path)
    if scheme is None:
        raise Fp8kitError(f"{path}: not an FP8 checkpoint (no quantization_config); convert it with fp8-convert")
    model = _load(path, config, scheme, dtype, lora_rank, lora_alpha, target_modules, lora_dropout, device, backend,
                  seed)
    # saved adapters name their base by it: peft opens neither '~' nor a path relative to another folder, nor
    # fp8kit's cache folder on another machine, so a name stays the name given (as load_model records it)
    model.name_or_path = str(path.resolve()) if local else str(path_or_name)
    return model


def load_lora_model(path: str | Path, dtype: torch.dtype = torch.bfloat16, lora_rank: int = 16,
                    lora_alpha: float | None = None, target_modules: list[str] | tuple[str, ...] | None = None,
                    lora_dropout: float = 0.0, device: str | torch.device = "cpu", seed: int = DEFAULT_SEED):
    """The full-precision baseline: the checkpoint's weights in `dtype`, LoRA on `target_modules`, A drawn from
    `seed` as load_fp8_model draws it (the same seed: the same initial adapter)."""
    _check_dtype(dtype)
    lora_targets(lora_rank, lora_alpha, target_modules, lora_dropout, device)
    check_seed(seed)
    path = Path(path).expanduser()
    config, scheme = read_config(path)
    if scheme is not None:
        raise Fp8kitError(f"{path}: an FP8 checkpoint; the BF16/FP16 baseline needs the original model")
    model = _load(path, config, None, dtype, lora_rank, lora_alpha, target_modules, lora_dropout, device, None, seed)
    model.name_or_path = str(path.resolve())
    return model


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise Fp8kitError(f"dtype {dtype}: expected torch.bfloat16, torch.float16 or torch.float32")


def _load(path, config, scheme, dtype, lora_rank, lora_alpha, target_modules, lora_dropout, device, backend, seed):
    device = check_device(device)
    model = assemble(config, checkpoint_tensors(path, device), scheme, dtype, lora_rank, lora_alpha,
                     lora_targets(lora_rank, lora_alpha, target_modules, lora_dropout), lora_dropout, backend,
                     str(path), seed=seed, device=device)
    load_generation_config(model, path)
    return model.to(device)


def load_generation_config(model: nn.Module, path: Path) -> None:
    """The checkpoint's generation_config.json on the model: its stop tokens, as vLLM reads them (from_config, which
    builds the model, skips the file)."""
    if (path / "generation_config.json").exists():
        from transformers import GenerationConfig

        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001 - JSON and validation errors of several kinds
            raise Fp8kitError(f"{path / 'generation_config.json'}: unreadable ({_one_line(e)}); fix or remove it") from e


def checkpoint_mismatches(model: nn.Module, path: str | Path) -> list[str]:
    """The model's base tensors whose values differ from the checkpoint's. For a model assembled from another
    engine's parameters (vLLM) this proves the views are the checkpoint's own values, split and transposed
    right. Per-tensor FP8 layers are skipped: vLLM re-quantizes fused shards to one shared scale."""
    from fp8kit.loaded_names import key_renamer

    rename = key_renamer(model)  # the checkpoint's names as the model has them (assemble)
    tensors = {rename(k): get for k, get in checkpoint_tensors(Path(path), torch.device("cpu")).items()}
    differing = []
    for name, mine in list(model.named_parameters()) + list(model.named_buffers()):
        module_name, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B") or "rotary" in name:
            continue
        if getattr(model.get_submodule(module_name), "scheme", None) == "tensor":
            continue
        key = name if name in tensors else f"{module_name}.weight_scale_inv" if leaf == "weight_scale" else None
        if key not in tensors:  # e.g. a tied lm_head, saved once as embed_tokens
            continue
        ref, mine = tensors[key](), mine.detach().cpu()
        if mine.dtype == torch.float8_e4m3fn:
            mine, ref = mine.view(torch.uint8), ref.view(torch.uint8)
        if mine.shape != ref.shape or not torch.equal(mine, ref.to(mine.dtype)):
            differing.append(name)
    return differing


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The reference policy: the base model alone, LoRA scaled to zero for the duration."""
    modules = lora_modules(model)
    saved = {n: m.scaling for n, m in modules.items()}
    for m in modules.values():
        m.scaling = 0.0
    try:
        yield model
    finally:
        for n, m in modules.items():
            m.scaling = saved[n]


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (FP8LoRALinear, LoRALinear)) and m.rank}


def check_not_unloaded(model: nn.Module, what: str) -> None:
    """unload_model moved the model's tensors to the meta device: saving would fail inside torch (no data to copy)
    and loading an adapter or training would silently do nothing on them."""
    if getattr(model, "unloaded", False):
        raise Fp8kitError(f"model: freed by unload_model; {what}")


def save_adapter(model: nn.Module, directory: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """PEFT's adapter layout (adapter_model.safetensors + adapter_config.json), readable by peft and vLLM.
    `directory` is created if missing; each of the two files is replaced atomically and every other file
    in the directory is left alone."""
    directory = Path(directory)
    tensors, config = _adapter_payload(model, base_model_name_or_path)  # refuses before anything is created
    if directory.exists() and not directory.is_dir():
        raise Fp8kitError(f"{directory}: exists and is not a directory; choose another adapter directory")
    created = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Fp8kitError(f"{directory}: cannot create ({_one_line(e)}); choose another adapter directory") from e
    try:
        _write_adapter_files(directory, tensors, config)
    except Fp8kitError:
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()  # only the folder made here, and only while it is empty
        raise
    return directory


def write_adapter(model: nn.Module, folder: Path, base_model_name_or_path: str | None = None) -> None:
    """The adapter files written into the existing `folder`, each replaced atomically; other files stay."""
    _write_adapter_files(Path(folder), *_adapter_payload(model, base_model_name_or_path))


def _adapter_payload(model: nn.Module, base_model_name_or_path: str | None) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter's tensors under PEFT's names, and its adapter_config.json. Without a base named, the model's own
    (load_model's name, or the checkpoint loaded): peft's AutoPeftModelForCausalLM opens the base from it."""
    check_not_unloaded(model, "its adapter went with it: save the adapter before unload_model")
    if base_model_name_or_path is None:
        base_model_name_or_path = str(getattr(model, "name_or_path", "") or "")
    elif isinstance(base_model_name_or_path, os.PathLike):  # a local base: peft reads a string
        base_model_name_or_path = str(base_model_name_or_path)
    elif not isinstance(base_model_name_or_path, str):
        raise Fp8kitError(f"base_model_name_or_path={base_model_name_or_path!r}: expected the base model's Hub name "
                          f"or folder as a string (peft opens the base from it), or None for the model's own")
    modules = lora_modules(model)
    if not modules:
        raise Fp8kitError("the model has no LoRA modules to save; load it with lora_rank > 0")
    tensors = {}
    for name, m in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = m.lora_A.detach().contiguous().cpu()
        tensors[f"base_model.model.{name}.lora_B.weight"] = m.lora_B.detach().contiguous().cpu()
    first = next(iter(modules.values()))
    if not first.scaling:  # lora_alpha is written as scaling * r: an adapter saved now would do nothing
        raise Fp8kitError("the adapters are disabled (inside adapters_disabled): save the adapter outside that block")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank, "lora_alpha": first.scaling * first.rank,
              "lora_dropout": getattr(first, "lora_dropout_rate", getattr(first.lora_dropout, "p", 0.0)),
              "bias": "none", "fan_in_fan_out": False,
              "target_modules": sorted({n.rsplit(".", 1)[-1] for n in modules}),
              "base_model_name_or_path": base_model_name_or_path, "inference_mode": True}
    leaves = set(config["target_modules"])
    if any(isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in leaves and NOT_LANGUAGE.search(n)
           for n, m in model.named_modules()):
        # a vision tower's q_proj has a target's name but no LoRA here (assemble): peft would add one to it, and warn
        # that the adapter lacks its weights (a regex, fully matched, as peft reads a string; vLLM ignores the key)
        config["exclude_modules"] = f".*(?:{NOT_LANGUAGE.pattern}).*"  # a group: the pattern has alternatives
    return tensors, config


def _write_adapter_files(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Both files written to temporary names in `folder`, flushed, then renamed over the old ones: a reader
    sees the previous file or the new one, never a part; no temporary file survives a failure."""
    from fp8kit.converter.safetensors_io import save_small

    weights, config_file = folder / ADAPTER_WEIGHTS, folder / ADAPTER_CONFIG
    temps: list[Path] = []
    try:
        tmp_weights = _new_temp_beside(weights, temps)
        save_small(tensors, tmp_weights, _scaling_stamp(config))
        tmp_config = _new_temp_beside(config_file, temps)
        tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for tmp in temps:
            _fsync(tmp)
        os.replace(tmp_weights, weights)
        os.replace(tmp_config, config_file)
    except OSError as e:
        raise Fp8kitError(f"{folder}: cannot write the adapter ({_one_line(e)}); free disk space or choose another "
                          f"adapter directory") from e
    finally:
        for tmp in temps:
            with contextlib.suppress(OSError):
                tmp.unlink()
    with contextlib.suppress(OSError):  # the renames themselves durable, where the platform allows
        _fsync(folder)


def _scaling_stamp(config: dict) -> dict[str, str]:
    """The weights file's metadata records the config fields that set the scaling, so that load_adapter can tell
    a folder whose two files come from different saves (a save interrupted between its two renames) from a
    whole one: the same rank with another lora_alpha would otherwise load with the wrong scaling, silently.
    peft ignores metadata beyond `format`."""
    return {"format": "pt", "fp8kit.lora_alpha": repr(float(config["lora_alpha"]))}


def _new_temp_beside(final: Path, temps: list[Path]) -> Path:
    """A new empty file next to `final` (same filesystem, so os.replace is atomic), with the permissions an
    ordinary new file gets; recorded in `temps` for cleanup."""
    tmp = final.with_name(f".{final.name}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    temps.append(tmp)
    return tmp


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_adapter(model: nn.Module, directory: str | Path) -> None:
    """Load a PEFT LoRA adapter into the model's LoRA modules: ranks and shapes must match; the scaling
    (lora_alpha / r) is taken from adapter_config.json. Everything is checked before the model is touched."""
    from safetensors import SafetensorError, safe_open

    check_not_unloaded(model, "load the adapter into a model from load_model (call it again to reload this one)")
    directory = Path(directory)
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    redo = "pass a folder written by save_adapter or peft's save_pretrained"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError as e:
        raise Fp8kitError(f"{config_file}: missing; {redo}") from e
    except (OSError, ValueError) as e:  # ValueError: not UTF-8 or not JSON
        raise Fp8kitError(f"{config_file}: unreadable or not JSON ({_one_line(e)}); {redo}") from e
    if not isinstance(config, dict):
        raise Fp8kitError(f"{config_file}: not a JSON object; {redo}")
    if "r" not in config:
        raise Fp8kitError(f"{config_file}: has no LoRA rank `r`; add the adapter's rank or save the adapter again")
    rank = config["r"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise Fp8kitError(f"{config_file}: the LoRA rank `r` must be a positive integer, got {rank!r}; set it to the "
                          f"adapter's rank or save the adapter again")
    alpha = config.get("lora_alpha", 8)  # peft's LoraConfig default, so both read one adapter alike
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise Fp8kitError(f"{config_file}: `lora_alpha` must be a number, got {alpha!r}; set it or save the adapter "
                          f"again")
    # peft's per-module overrides would give some modules another rank or scaling than r and lora_alpha say
    patterns = [k for k in ("rank_pattern", "alpha_pattern") if config.get(k)]
    if patterns:
        raise Fp8kitError(f"{config_file}: `{patterns[0]}` gives some modules their own rank or alpha, which "
                          f"load_adapter does not support; use one r and lora_alpha for every module")
    # peft's LoraLayer.update_layer: rank-stabilized LoRA scales by alpha / sqrt(r) instead of alpha / r
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if not weights_file.exists():
        pickled = " (adapter_model.bin is a pickle, never read: save it with safe_serialization=True)" if (
            directory / "adapter_model.bin").exists() else ""
        raise Fp8kitError(f"{weights_file}: missing{pickled}; {redo}")
    try:
        with safe_open(weights_file, "pt") as f:
            stamp = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise Fp8kitError(f"{weights_file}: not a readable safetensors file, truncated or corrupt ({_one_line(e)}); "
                          f"save the adapter again") from e
    expected = _scaling_stamp({"lora_alpha": alpha})
    torn = [k for k in expected if k in stamp and stamp[k] != expected[k]]  # peft's files carry no stamp
    if torn:
        raise Fp8kitError(f"{weights_file}: saved with {torn[0].split('.', 1)[1]}={stamp[torn[0]]}, but "
                          f"{config_file.name} says {expected[torn[0]]}: the two files come from different saves "
                          f"(an interrupted save_adapter, or an edited config); save the adapter again")
    modules = lora_modules(model)
    updates = []
    seen = set()
    for key, value in tensors.items():
        base = re.fullmatch(r"base_model\.model\.(.+)\.base_layer\.weight", key)
        if base and base[1] in modules:
            # peft's save of an adapter on lm_head or the embeddings (save_embedding_layers="auto") adds the layer's
            # own weight: taken where it is the model's, refused where it is not (a resized vocabulary)
            own = modules[base[1]].weight
            if own.dtype not in FP8_DTYPES and own.shape == value.shape and torch.equal(own, value.to(own.device, own.dtype)):
                continue
            raise Fp8kitError(f"{weights_file}: {key} is a weight other than the model's {base[1]} (peft's "
                              f"save_embedding_layers); load the adapter onto the model it was trained on, or save "
                              f"it with save_embedding_layers=False")
        m = re.fullmatch(r"base_model\.model\.(.+)\.(lora_[AB])(?:\.default)?\.weight", key)
        if not m or m[1] not in modules:
            raise Fp8kitError(f"{weights_file}: adapter tensor {key!r} matches no LoRA module of the model")
        target = getattr(modules[m[1]], m[2])
        if target.shape != value.shape:
            raise Fp8kitError(f"{weights_file}: {key} has shape {tuple(value.shape)}, the model's is "
                              f"{tuple(target.shape)} (adapter r={rank}, model r={modules[m[1]].rank})")
        updates.append((target, value))
        seen.add((m[1], m[2]))
    missing = sorted(n for n in modules if (n, "lora_A") not in seen or (n, "lora_B") not in seen)
    if missing:
        raise Fp8kitError(f"{weights_file}: the adapter has no weights for {len(missing)} LoRA modules, e.g. "
                          f"{missing[0]}")
    with torch.no_grad():
        for target, value in updates:
            target.copy_(value)
    for m in modules.values():
        m.scaling = scaling
