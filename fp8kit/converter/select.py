"""Which weights become FP8, decided from tensor names and shapes alone.

No model is built: a name-based rule works for architectures transformers does not know yet and costs
nothing. The rule follows what serving engines expect of FP8 checkpoints (llm-compressor's recipes,
Qwen's and DeepSeek's FP8 uploads): Linear weights inside decoder blocks are quantized; embeddings,
lm_head, norms, biases, MoE routers and vision/audio parts stay in source precision. lm_head joins on request
(`lm_head=True`): vLLM serves an FP8 lm_head from compressed-tensors checkpoints, which on large vocabularies
frees memory for the KV cache (Qwen3-8B: 0.58 GiB); it bought no measurable speed (evals/README.md).
"""

from __future__ import annotations

import re
from pathlib import Path
from dataclasses import dataclass, field

from fp8kit.converter.safetensors_io import TensorInfo
from fp8kit.converter.schemes import Scheme
from fp8kit.errors import Fp8kitError

SOURCE_DTYPES = {"F32", "F16", "BF16"}
DECODER_BLOCK = re.compile(r"(^|\.)(layers|h|blocks|block)\.\d+\.")
# Towers named otherwise: Phi-4-multimodal's `embed_tokens_extend.image_embed.img_processor`, Idefics2's
# `connector.perceiver_resampler`, MiniCPM-V's `vpm`, and Granite Speech's top-level `encoder` (its language model is
# `language_model.`)
NOT_LANGUAGE = re.compile(r"(^|\.)(vision|visual|vision_tower|vision_model|audio|audio_tower|audio_model|speech|"
                          r"multi_modal_projector|mm_projector|image_newline|vqmodel|mtp|img_processor|"
                          r"embed_tokens_extend|perceiver_resampler|vpm)(\.|_|$)|^encoder\.")
ROUTERS = {"gate", "router", "shared_expert_gate"}
# DeepSeek-V3 multi-token-prediction heads: vocabulary-sized or not GEMMs that engines quantize.
KEPT_PARTS = ROUTERS | {"shared_head", "eh_proj"}
# Modules that serving engines fuse into one GEMM (qkv_proj, gate_up_proj): one status for all of them.
SIBLINGS = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("query", "key", "value"),
            ("q_a_proj", "kv_a_proj_with_mqa"),  # vLLM's fused_qkv_a_proj in DeepSeek-V3 / Kimi-K2
            # Qwen3.5's linear attention: vLLM 0.25 loads them as in_proj_qkvz and in_proj_ba (qwen3_5.py)
            ("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a")]
QUANT_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "weight_packed", "weight_zero_point",
                  "qweight", "qzeros", "weight_global_scale")


@dataclass
class Selection:
    quantize: list[str] = field(default_factory=list)  # module names (tensor name without ".weight")
    keep: list[str] = field(default_factory=list)  # 2-D non-embedding weights left in source precision
    warnings: list[str] = field(default_factory=list)
    unmatched_ignore: list[str] = field(default_factory=list)  # --ignore patterns that matched no weight (warned)


def natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def check_not_quantized(tensors: dict[str, TensorInfo]) -> None:
    for info in tensors.values():
        if info.dtype.startswith("F8") or info.name.rsplit(".", 1)[-1] in QUANT_SUFFIXES:
            raise Fp8kitError(f"{info.path}: tensor {info.name!r} ({info.dtype}) shows the checkpoint is already "
                              f"quantized; convert the original BF16/FP16/FP32 checkpoint instead")


def is_candidate(module: str) -> bool:
    if not DECODER_BLOCK.search(module) or NOT_LANGUAGE.search(module):
        return False
    parts = DECODER_BLOCK.split(module)[-1].split(".")
    # `_emb`: position tables stored 2-D (Granite Speech's `attn.rel_pos_emb`), Embeddings, not Linears
    return not any(p in KEPT_PARTS or "embed" in p or "norm" in p or p.endswith("_emb") for p in parts)


def is_embedding_table(module: str) -> bool:
    """An embedding (`embed_tokens`, `word_embeddings`, `wte`), by its own name: not a Linear, so not named in the
    ignore list (llm-compressor's lists name Linear modules only). Linear projections named after embeddings (Gemma
    3n's `altup_unembed_projections.N`, its `embed_vision.embedding_projection`) are named there: a Linear left out
    of it gets an FP8 wrapper in transformers and vLLM with no scale to load (NaN logits)."""
    leaf = module.split(".")[-1]
    return leaf in ("wte", "wpe") or leaf.endswith("_emb") or ("embed" in leaf and "unembed" not in leaf
                                                                and "proj" not in leaf)


def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def is_fused_weight(name: str, module: str, info: TensorInfo) -> bool:
    """A weight of more than two dimensions inside a decoder block that is not a convolution: experts fused into
    one tensor, [experts, out, in] or [experts, in, out] (Llama 4 and gpt-oss `experts.gate_up_proj`, without a
    .weight suffix; GraniteMoe's `block_sparse_moe.input_linear.weight`, JetMoe's). It can be neither quantized
    per 2-D weight nor copied silently in source precision. Convolutions (Mamba's depthwise conv1d
    [channels, 1, kernel]) are copied as they are, as every tensor that is not 2-D."""
    if len(info.shape) <= 2 or not is_candidate(module):
        return False
    if not (name.endswith(".weight") or "expert" in module):  # RWKV-style [1, 1, C] mixing vectors, biases
        return False
    return not any("conv" in part for part in module.split("."))


EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")


def _sibling_group(module: str) -> tuple[str, int] | None:
    parent, _, leaf = module.rpartition(".")
    for i, group in enumerate(SIBLINGS):
        if leaf in group:
            return parent, i
    return None


def expert_layer(module: str) -> str | None:
    """The MoE layer of a per-expert weight (`...mlp.experts.3.down_proj` -> `...mlp.experts`): engines load a
    layer's experts into fused tensors with one quantization (vLLM's FusedMoE takes one scheme per layer,
    transformers 5 fuses them into 3-D parameters), so one expert kept in source precision among FP8 ones loads
    as zeros or garbage."""
    match = EXPERT.match(module)
    return match.group(1) if match else None


def _share_status(wanted: dict[str, bool], reason: dict[str, str], group_of, why: str) -> None:
    """Modules of one group (group_of(module), None for none) that would be quantized stay in source precision,
    for `why`, when another member does."""
    groups: dict[object, list[str]] = {}
    for module in wanted:
        key = group_of(module)
        if key is not None:
            groups.setdefault(key, []).append(module)
    for members in groups.values():
        if not all(wanted[m] for m in members):
            for m in members:
                if wanted[m]:
                    wanted[m], reason[m] = False, why


def _vllm_padding_warning(quantized: list[str], tensors: dict[str, TensorInfo]) -> list[str]:
    """vLLM 0.25's CUTLASS FP8 kernel pads a layer whose output width (q/k/v and gate/up fused, as vLLM loads them) is
    not a multiple of 16, and with a per-channel scale its padding code then fails the load with an AssertionError
    ("Overwriting existing tensor attribute: weight_loader", vllm-project/vllm#47005; per-tensor scales pad fine)."""
    widths: dict[object, tuple[int, list[str]]] = {}
    for module in quantized:
        if expert_layer(module) is not None:  # MoE experts load into vLLM's fused-expert layers
            continue
        key = _sibling_group(module) or module
        width, members = widths.get(key, (0, []))
        widths[key] = (width + tensors[f"{module}.weight"].shape[0], members + [module])
    odd = [(members, width) for width, members in widths.values() if width % 16]
    if not odd:
        return []
    named = ", ".join(f"{'+'.join(m.rpartition('.')[2] for m in members)} of {members[0].rpartition('.')[0]} ({width})"
                      for members, width in odd[:3])
    return [f"{len(odd)} per-channel layers (as vLLM fuses them) have an output width that vLLM 0.25 pads to a "
            f"multiple of 16 and then fails to load (vllm-project/vllm#47005): {named}{' ...' if len(odd) > 3 else ''}; "
            f"to serve with vLLM 0.25 convert with --scheme tensor, or keep them with --ignore"]


def _check_source_dtype(info: TensorInfo) -> None:
    if info.dtype not in SOURCE_DTYPES:
        raise Fp8kitError(f"{info.path}: tensor {info.name!r} has dtype {info.dtype}; fp8-convert reads F32, F16 "
                          f"and BF16 weights: save the checkpoint in one of those")


def _lm_head(tensors: dict[str, TensorInfo], scheme: Scheme, tied: bool) -> str:
    if tied:  # transformers re-ties a stored lm_head.weight to the embeddings, and vLLM skips it when tied
        raise Fp8kitError("--lm-head: config.json ties the output head to the embeddings (tie_word_embeddings is "
                          "true, or unset where the architecture ties by default); an FP8 lm_head needs an untied one: "
                          "leave --lm-head out")
    tower = next((n for n in sorted(tensors) if NOT_LANGUAGE.search(n)), None)
    if tower is not None:
        # vLLM maps such models' head to language_model.lm_head (Mistral 3, Qwen2.5-VL: hf_to_vllm_mapper), which the
        # config's "lm_head" target does not match: the FP8 head went into a BF16 layer and its scale had no place
        raise Fp8kitError(f"--lm-head is for text models: this checkpoint has a vision or audio part ({tower}), and "
                          f"vLLM 0.25 loads some such models' head as language_model.lm_head, which the FP8 head "
                          f"does not load into; leave --lm-head out")
    info = tensors.get("lm_head.weight")
    if info is None:
        raise Fp8kitError("--lm-head: the checkpoint has no lm_head.weight (its lm_head is tied to embed_tokens, "
                          "or named otherwise); an FP8 lm_head needs an untied one: leave --lm-head out")
    _check_source_dtype(info)
    if len(info.shape) != 2 or not scheme.supports(info.shape):
        raise Fp8kitError(f"{info.path}: lm_head.weight {list(info.shape)} cannot take {scheme.name} FP8: leave "
                          f"--lm-head out or use dynamic")
    return "lm_head"


def select(tensors: dict[str, TensorInfo], scheme: Scheme, ignore: list[str], lm_head: bool = False,
           tied: bool = False, src: Path | str = "checkpoint") -> Selection:
    patterns = [re.compile(p[3:] if p.startswith("re:") else p) for p in ignore]
    sel = Selection()
    wanted: dict[str, bool] = {}
    reason: dict[str, str] = {}
    fused = [name for name in sorted(tensors, key=natural_key) if is_fused_weight(name, _module(name), tensors[name])
             and not any(p.search(_module(name)) for p in patterns)]
    if fused:
        info = tensors[fused[0]]
        # one pattern for every fused tensor of every layer
        every_layer = "|".join(dict.fromkeys(re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(_module(name)))
                                             for name in fused))
        more = f" (and {len(fused) - 1} more)" if len(fused) > 1 else ""
        raise Fp8kitError(f"{info.path}: tensor {fused[0]!r} is a fused {len(info.shape)}-D expert tensor "
                          f"{list(info.shape)}{more}; fp8-convert quantizes per-expert 2-D weights only: save the "
                          f"checkpoint with per-expert tensors, or pass --ignore '{every_layer}' to keep them as "
                          f"they are")
    for name in sorted(tensors, key=natural_key):
        info = tensors[name]
        module = _module(name)
        if is_fused_weight(name, module, info):  # --ignore'd: kept, and named in the ignore list
            sel.keep.append(module)
            continue
        if not name.endswith(".weight") or len(info.shape) != 2:
            continue
        if not is_candidate(module) or info.numel == 0:
            if not is_embedding_table(module):
                sel.keep.append(module)
            continue
        _check_source_dtype(info)
        if any(p.search(module) for p in patterns):
            wanted[module], reason[module] = False, "--ignore"
        elif not scheme.supports(info.shape):
            wanted[module], reason[module] = False, "shape"
        else:
            wanted[module] = True
    # Fused siblings share one status: if one member stays in source precision, all do; so do every projection of
    # every expert of one MoE layer
    _share_status(wanted, reason, _sibling_group, "sibling")
    _share_status(wanted, reason, expert_layer, "experts")
    by_shape = [m for m in wanted if reason.get(m) == "shape"]
    if by_shape:
        sel.warnings.append(
            f"{len(by_shape)} weights kept in source precision because block FP8 needs both dimensions to be "
            f"multiples of 128: {', '.join(by_shape[:4])}{' ...' if len(by_shape) > 4 else ''}")
    by_sibling = [m for m in wanted if reason.get(m) == "sibling"]
    if by_sibling:
        sel.warnings.append(
            f"{len(by_sibling)} weights kept in source precision with a fused sibling (q/k/v, gate/up): "
            f"{', '.join(by_sibling[:4])}{' ...' if len(by_sibling) > 4 else ''}")
    by_experts = [m for m in wanted if reason.get(m) == "experts"]
    if by_experts:
        layers = sorted({expert_layer(m) for m in by_experts}, key=natural_key)
        sel.warnings.append(
            f"{len(by_experts)} expert weights kept in source precision with the other experts of their MoE layer "
            f"(engines load a layer's experts with one quantization): {', '.join(layers[:4])}"
            f"{' ...' if len(layers) > 4 else ''}")
    if scheme.weight_strategy == "channel":
        sel.warnings += _vllm_padding_warning([m for m, q in wanted.items() if q], tensors)
    modules = {*map(_module, tensors), "lm_head"}  # lm_head: always kept
    unmatched = sel.unmatched_ignore = [p.pattern for p in patterns if not any(p.search(name) for name in modules)]
    if unmatched:
        sel.warnings.append(
            f"--ignore {', '.join(repr(u) for u in unmatched)} matched no weight: patterns are searched in module "
            f"names (e.g. {next((m for m in wanted), 'model.layers.0.mlp.down_proj')}), without '.weight'")
    for module, q in wanted.items():
        (sel.quantize if q else sel.keep).append(module)
    if lm_head:
        if any(p.search("lm_head") for p in patterns):
            raise Fp8kitError("--lm-head and an --ignore pattern matching lm_head contradict each other; drop one")
        sel.quantize.append(_lm_head(tensors, scheme, tied))
        sel.keep.remove("lm_head")
    if not sel.quantize and by_shape:  # the shapes left nothing (their fused siblings follow them)
        shape = list(tensors[f"{by_shape[0]}.weight"].shape)
        raise Fp8kitError(f"{src}: no weights to quantize: block FP8 needs both dimensions of a weight to be "
                          f"multiples of 128, and {len(by_shape)} Linear weights do not (e.g. "
                          f"{by_shape[0]} {shape}), which leaves none; use --scheme dynamic or tensor")
    if not sel.quantize:
        raise Fp8kitError(f"{src}: no weights to quantize: no 2-D Linear weights inside decoder layers "
                          f"(model.layers.N...) were found or all were ignored")
    sel.keep.sort(key=natural_key)
    return sel
