"""vLLM in the training process, sharing one copy of the weights with the trainer.

vLLM loads the checkpoint once; the training model is then assembled from *views* of vLLM's parameters
(`fp8kit.rl.loader.assemble`), so the FP8 weights, scales, norms and embeddings exist once on the GPU. The
layouts this relies on (vLLM 0.25, read from its source):
- q/k/v and gate/up are fused row-wise ([q | k | v], [gate | up]); slicing rows of an [out, in] row-major
  tensor gives views, never copies;
- per-channel and per-tensor FP8 weights are stored as the transpose view [in, out] of the loaded [out, in]
  storage (compressed_tensors_w8a8_fp8.py process_weights_after_loading: `layer.weight = weight.t()`), block
  and BF16 weights stay [out, in]; fused per-tensor shards are re-quantized to one shared scale
  (w8a8_utils.requantize_with_max_scale), so the trainer uses exactly the bytes vLLM serves;
- embeddings are padded to a multiple of 64 rows (vocab_parallel_embedding.py): the trainer sees the first
  vocab_size rows.
- a multimodal model (Gemma 3 it) is served as its language model alone (`language_model_only`: vLLM builds
  no tower, interfaces.py _mark_tower_model) under the checkpoint's names (`language_model.model.layers.N`),
  which the trainer renames as transformers does; its towers are read from the checkpoint.
Parameters are replaced during vLLM's post-load processing, so views are taken after `LLM(...)` returns.

LoRA reaches vLLM every step by writing the adapter in place into vLLM's stacked LoRA buffers (B scaled by
alpha/r, which vLLM folds into B at load: lora_weights.LoRALayerWeights.optimize); the buffers are never
re-bound, so CUDA graphs stay valid, and nothing is reloaded. While the trainer runs, vLLM sleeps with only its
KV cache released (VLLMRollout.sleep): the weights stay mapped where the views point, and the KV cache comes back
at its recorded virtual addresses (device_allocator/cumem.py maps each handle there), so CUDA graphs stay valid.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from fp8kit.errors import Fp8kitError
from fp8kit.rl.rollout import Completion

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LORA_ID = 1
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.25's allowed max_lora_rank values (config/lora.py)


def split_sizes(config, fused: str) -> list[int]:
    """Row counts of the HF projections inside vLLM's fused one, in vLLM's order."""
    text = config.get_text_config()
    if fused == "qkv_proj":
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv = text.num_key_value_heads * head_dim
        return [text.num_attention_heads * head_dim, kv, kv]
    return [text.intermediate_size, text.intermediate_size]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The [out, in] row-major view of a vLLM Linear weight, whichever way vLLM stores it."""
    if t.ndim == 2 and not t.is_contiguous() and t.t().is_contiguous():
        return t.t()
    if not t.is_contiguous():
        raise Fp8kitError(f"vLLM weight of shape {tuple(t.shape)} and strides {t.stride()} is neither [out, in] nor "
                          f"its transpose; this vLLM version stores weights in a layout fp8kit cannot share")
    return t


def _unpadded(tensor: torch.Tensor, layer: nn.Module, leaf: str) -> torch.Tensor:
    """The layer's own [out, in] weight (or [out] scale) inside vLLM's storage: vLLM's CUTLASS FP8 kernel pads a
    weight whose dimensions are not multiples of 16 with zeros, and its per-channel scale with ones
    (kernels/linear/scaled_mm/cutlass.py process_weights_after_loading). With one GPU a vLLM Linear's input_size and
    output_size are the whole layer's (linear.py LinearBase); `tensor` is a weight already in [out, in] rows."""
    out_n, in_k = getattr(layer, "output_size", None), getattr(layer, "input_size", None)
    if not (isinstance(out_n, int) and isinstance(in_k, int)):
        return tensor
    if leaf == "weight" and tensor.ndim == 2 and tensor.shape != (out_n, in_k):
        return tensor[:out_n, :in_k]
    if leaf == "weight_scale" and tensor.numel() > 1 and tensor.shape[0] > out_n:
        return tensor[:out_n]
    return tensor


def shared_tensors(vllm_model: nn.Module, config, scheme: str | None) -> dict:
    """HF tensor name -> getter of a view of vLLM's storage (no copies), for loader.assemble."""
    vocab = config.get_text_config().vocab_size
    out = {}
    params = dict(vllm_model.named_parameters())
    params.update({n: b for n, b in vllm_model.named_buffers() if n.endswith(("weight_scale", "weight_scale_inv"))})
    for name, tensor in params.items():
        layer = vllm_model.get_submodule(name.rpartition(".")[0])
        name = name.replace(".base_layer.", ".")
        module, _, leaf = name.rpartition(".")
        if leaf == "input_scale" or "lora_" in name:
            continue
        if leaf == "weight_scale_inv":
            leaf = "weight_scale"
        fused = module.rpartition(".")[2] in FUSED
        if leaf == "weight" and tensor.ndim == 2 and (tensor.dtype == torch.float8_e4m3fn or fused):
            tensor = _unpadded(_rows(tensor), layer, leaf)
        elif leaf == "weight_scale" and scheme != "block":
            tensor = _unpadded(tensor, layer, leaf)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = (lambda t=tensor: t[:vocab])
            continue
        parent, _, short = module.rpartition(".")
        if fused:
            sizes = split_sizes(config, short)
            if leaf in ("weight", "bias"):
                parts = torch.split(tensor, sizes, dim=0)
            elif tensor.numel() == 1:  # per-tensor: one scale shared by the fused shards after re-quantization
                parts = [tensor] * len(sizes)
            elif scheme == "block":
                if any(s % 128 for s in sizes):
                    raise Fp8kitError(f"{module}: fused rows {sizes} are not multiples of 128; block scales cannot be split")
                parts = torch.split(tensor, [s // 128 for s in sizes], dim=0)
            else:
                parts = torch.split(tensor, sizes, dim=0)
            for sub, part in zip(FUSED[short], parts):
                out[f"{parent}.{sub}.{leaf}"] = (lambda t=part: t)
        elif leaf in ("weight", "bias", "weight_scale"):
            out[f"{module}.{leaf}"] = (lambda t=tensor: t)
    return out


def storage_pointers(model: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers()) if t.is_cuda}


# Inductor fuses vLLM's native RMSNorm (and SiLU-and-mul) with the FP8 activation quantization after them and,
# with emulate_precision_casts off (torch's default), skips the rounding to the model dtype in between, so vLLM
# quantizes slightly different values than the trainer, which rounds: 2.9% of the FP8 codes differ on CPU Inductor
# (evals/mismatch_sources.py). Keeping the casts cut the rollout/trainer mismatch KL from 0.0195 to 0.0145 on an
# H100 at no measured rollout cost (evals/results/grpo_gpu_h100_casts.json).
KEEP_PRECISION_CASTS = {"inductor_compile_config": {"emulate_precision_casts": True}}


# Tokens vLLM runs in one forward pass (longer prefills are chunked to it). vLLM's LLM class takes 16384 on 80 GB
# GPUs (engine/arg_utils.py), and a GRPO step's prefill that large was the run's memory peak: on an H100 with a
# Llama-3.1-8B-shaped FP8 model it left 2.56 GB of Inductor buffers reserved beside the trainer's optimizer state;
# in chunks of 2048 tokens 0.34 GB, and the run's peak fell from 18.43 to 16.14 GB (H100; 18.41 to 16.59 on
# an H200, BF16 24.61 to 23.75) for 1.00-1.05x the generation time (evals/results/grpo_gpu_h*_8b_prefill.json).
# 2048 is vLLM's own API-server default on smaller GPUs; prompts of any length still fit (chunked prefill).
ROLLOUT_MAX_BATCHED_TOKENS = 2048


def rollout_engine_kwargs(quantization_config: dict, engine_kwargs: dict) -> dict:
    """vLLM arguments for a rollout engine: prefill in chunks of ROLLOUT_MAX_BATCHED_TOKENS (or max_num_seqs, vLLM
    needs at least one token per sequence), and an FP8 checkpoint compiles with the model-dtype rounding kept; the
    caller's own values win (`compilation_config={}` is vLLM's default)."""
    kwargs = dict(engine_kwargs)
    if kwargs.get("enable_chunked_prefill") is not False:  # unchunked, a pass must hold a whole prompt: vLLM's value
        kwargs.setdefault("max_num_batched_tokens", max(ROLLOUT_MAX_BATCHED_TOKENS, kwargs.get("max_num_seqs") or 0))
    if quantization_config:
        kwargs.setdefault("compilation_config", KEEP_PRECISION_CASTS)
    return kwargs


def check_rollout_arguments(dtype: torch.dtype, lora_rank: int) -> None:
    """vLLM's refusals of the dtype and the LoRA rank; load_model and grpo_toy make them before converting a
    checkpoint (after, they would cost the conversion)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise Fp8kitError(f"dtype {dtype}: vLLM rollouts need torch.bfloat16 or torch.float16")
    if lora_rank and lora_rank not in LORA_RANKS:
        raise Fp8kitError(f"lora_rank={lora_rank}: vLLM serves LoRA ranks {', '.join(map(str, LORA_RANKS))}; "
                          f"pick one of them (or fast_inference=False)")


def clear_lora_pointer_caches() -> None:
    """vLLM's Triton LoRA kernels cache, per process, the adapter buffers they were called with, keyed by their
    addresses (vllm/lora/ops/triton_ops/utils.py _LORA_A_PTR_DICT, _LORA_B_PTR_DICT; the fp8 and MoE variants
    alike), and an engine's shutdown leaves them: the LoRA buffers of every layer stayed on the GPU after it."""
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm.lora.ops.") and module is not None:
            for attr, value in vars(module).items():
                if attr.endswith("_PTR_DICT") and isinstance(value, dict):
                    value.clear()


# modules vLLM first imports while it loads weights under `with torch.device("cuda")`: their import-time tensors
# (FlashInfer's FP4 lookup table, ...) are made on the GPU, in the engine's weight pool, and outlive it. Imported
# before the engine starts they are made on the CPU, as their authors meant.
EARLY_IMPORTS = ("flashinfer.quantization.fp4_quantization",)


def initialize_early(quantized: bool) -> None:
    """What vLLM would first make inside its engine's weight pool and keep after the engine's shutdown, made before
    it starts: vLLM asserts that pool empty as a new engine loads its weights, so one such allocation refused every
    later engine in the process. Besides EARLY_IMPORTS, DeepGEMM's runtime: vLLM initializes it as it builds its
    first FP8 layer (vllm/utils/deep_gemm.py _lazy_init, from is_deep_gemm_e8m0_used), and its set_pdl allocated
    32 MiB there on an H100 (evals/engine_unload.py); initialized here it lands in torch's own pool. A BF16 model's
    engine left the pool empty without it (the bf16 variant there), so only quantized checkpoints initialize it."""
    import importlib

    for name in EARLY_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed, or not importable here: vLLM will not import it either
            pass
    if quantized and torch.cuda.is_available():
        try:
            from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
        except ImportError:  # another vLLM: it fails, if at all, where the engine imports it
            return
        is_deep_gemm_e8m0_used()  # cached; set_engine_environment has set VLLM_USE_DEEP_GEMM_E8M0 already


OPEN_ENGINES: set[int] = set()  # id() of each VLLMRollout whose engine started in this process and is not shut down


def check_no_live_engine() -> None:
    """vLLM's sleep-mode allocator serves one engine per process at a time (vllm/v1/worker/gpu_worker.py asserts its
    pool is empty as the weights load), and the engine of an earlier load_model keeps its memory while its model
    lives: a second load_model with vLLM (a notebook cell run again) failed with vLLM's AssertionError, after any
    conversion. unload_model empties the pool (initialize_early); what no open engine owns only a restart frees."""
    cumem = sys.modules.get("vllm.device_allocator.cumem")  # not imported: no engine has started here
    allocator = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    held = allocator.get_current_usage() if allocator is not None else 0
    if not held:
        return
    size = f"{held / 2**30:.1f} GiB" if held >= 2**30 else f"{held / 2**20:.0f} MiB"
    if OPEN_ENGINES:
        raise Fp8kitError(f"a vLLM engine of an earlier load_model holds {size} in this process, and vLLM runs one "
                          f"engine per process at a time: call fp8kit.rl.unload_model on that model first, or pass "
                          f"fast_inference=False")
    raise Fp8kitError(f"vLLM's memory pool holds {size} that no open engine owns (one that failed to start, or what "
                      f"a shut-down engine left), and vLLM starts an engine only on an empty pool: restart Python to "
                      f"load a model with vLLM rollouts, or pass fast_inference=False")


# vLLM 0.25 refuses float16 for these model types (vllm/config/model.py, _FLOAT16_NOT_SUPPORTED_MODELS: "Numerical
# instability. Please use bfloat16 or float32 instead.")
VLLM_NO_FLOAT16 = ("gemma2", "gemma3", "gemma3_text", "plamo2", "glm4")


# config.json keys vLLM 0.25 reads a model's length from, the smallest winning (transformers_utils/
# model_arch_config_convertor.py derive_max_model_len_and_key)
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def vllm_max_model_len(config, disable_sliding_window: bool = False) -> tuple[float, str]:
    """The longest max_model_len vLLM 0.25 takes for this generative model, and why (vllm/config/model.py
    _get_and_verify_max_len): the smallest of config.json's length keys, or its model_max_length where it sets one
    (Command-R's), times the RoPE factor, except for Llama 3's, LongRoPE's and "su" RoPE (vLLM does not extend those)
    and for Gemma 3 (its positions already include the scaling); YaRN starts from original_max_position_embeddings.
    vLLM reads the tokenizer's model_max_length for pooling models only (ModelConfig.get_and_verify_max_len). With
    disable_sliding_window a shorter sliding window is the base."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = {k: v for k in LENGTH_KEYS if isinstance(v := getattr(text, k, None), (int, float))
             and not isinstance(v, bool)}
    if not found:
        return math.inf, "no length in config.json"
    key = min(found, key=found.get)
    if found.get("model_max_length"):
        key = "model_max_length"
    derived = found[key]
    why = f"{key} {derived:g} in config.json"
    if key == "max_position_embeddings":
        why = f"the model's {derived:g} positions (max_position_embeddings in config.json)"
    window = getattr(text, "sliding_window", None)
    if disable_sliding_window and isinstance(window, int) and window < derived:
        derived, why = window, f"the sliding window {window} (disable_sliding_window)"
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if isinstance(params, dict) and params and "gemma3" not in (getattr(text, "model_type", None) or ""):
        kinds = params.values() if all(isinstance(v, dict) for v in params.values()) else [params]
        factor = 1.0
        for kind in kinds:
            rope_type = kind.get("rope_type") or kind.get("type") or "default"
            if rope_type not in ("su", "longrope", "llama3"):
                factor = kind.get("factor", factor)
                if rope_type == "yarn" and isinstance(kind.get("original_max_position_embeddings"), int):
                    derived = kind["original_max_position_embeddings"]
                    why = f"YaRN's original_max_position_embeddings {derived}"
        if factor and factor != 1.0:
            derived, why = derived * factor, f"{why} times its RoPE factor {factor:g}"
    override = found.get("model_max_length")  # vLLM lets a length up to it through, past the derived one
    if override and override > derived:
        derived, why = override, f"model_max_length {override:g} in config.json"
    return derived, why


def check_rollout_model(config, path: Path, dtype: torch.dtype, max_seq_length: int,
                        engine_kwargs: dict | None = None) -> None:
    """vLLM's refusals of this model's dtype and context length, made before its engine starts (and, for an original
    checkpoint, before the conversion): float16 for the model types vLLM keeps it from, and a max_seq_length past
    what vLLM derives from the config (vllm_max_model_len), unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. With
    hf_overrides or hf_config_path in the engine's arguments vLLM derives the length from another config (a YaRN
    factor given there, as Qwen3's card does), and checks it itself."""
    engine_kwargs = engine_kwargs or {}
    model_type = getattr(config, "model_type", "")
    if dtype == torch.float16 and model_type in VLLM_NO_FLOAT16:
        raise Fp8kitError(f"{path}: vLLM does not run {model_type} in float16 (numerical instability); pass "
                          f"dtype=torch.bfloat16, or fast_inference=False")
    if engine_kwargs.get("hf_overrides") or engine_kwargs.get("hf_config_path"):
        return
    longest, why = vllm_max_model_len(config, bool(engine_kwargs.get("disable_sliding_window")))
    allowed = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")  # as vllm/envs.py
    if max_seq_length > longest and not allowed:
        raise Fp8kitError(f"{path}: max_seq_length={max_seq_length} is past {why}, which vLLM refuses; pass "
                          f"max_seq_length={int(longest)} or less")


def quantization_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    return (json.loads(config_file.read_text()).get("quantization_config") or {}) if config_file.exists() else {}


def rollout_llm_kwargs(path: str | Path, dtype: torch.dtype, max_seq_length: int, gpu_memory_utilization: float,
                       lora_rank: int, target_modules, engine_kwargs: dict) -> dict:
    """Every argument the rollout engine's vllm.LLM gets besides the path, the input checked first."""
    from fp8kit.rl.loader import DEFAULT_TARGETS

    check_rollout_arguments(dtype, lora_rank)
    check_engine_kwargs(engine_kwargs)
    qc = quantization_config(path)
    if any("lm_head" in g.get("targets", ()) for g in qc.get("config_groups", {}).values()):
        raise Fp8kitError(f"{path}: lm_head is FP8 (converted with --lm-head); the trainer shares vLLM's lm_head "
                          f"in source precision only: convert without --lm-head for GRPO")
    lora = {}
    if lora_rank:  # only the projections: left unrestricted, vLLM would also wrap embed_tokens and lm_head
        lora = dict(enable_lora=True, max_lora_rank=lora_rank, max_loras=1,
                    lora_target_modules=list(target_modules or DEFAULT_TARGETS))
    # GRPO rollouts are text: vLLM then builds no vision or audio tower (interfaces.py _mark_tower_model skips
    # them when every modality's limit is 0, which language_model_only sets), and the trainer reads the towers from
    # the checkpoint (training_model): each weight is still on the GPU once
    from transformers import AutoConfig

    towers = dict(language_model_only=True) if has_tower(AutoConfig.from_pretrained(path)) else {}
    return dict(dtype={torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], max_model_len=max_seq_length,
                gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True,
                logprobs_mode="processed_logprobs", seed=0, **lora, **towers,
                **rollout_engine_kwargs(qc, engine_kwargs))


# vllm.LLM arguments load_model sets from its own (dtype, max_seq_length, gpu_memory_utilization, lora_rank) or that
# the weight sharing needs: in vllm_kwargs they were a TypeError ("multiple values") or broke the sharing
RESERVED_ENGINE_KWARGS = {"dtype": "dtype", "max_model_len": "max_seq_length",
                          "gpu_memory_utilization": "gpu_memory_utilization", "max_lora_rank": "lora_rank",
                          "enable_lora": "lora_rank", "max_loras": None, "lora_target_modules": "target_modules",
                          "enable_sleep_mode": None, "logprobs_mode": None, "seed": None, "language_model_only": None}


def check_engine_kwargs(engine_kwargs: dict) -> None:
    """vllm_kwargs load_model cannot pass on, refused before the engine starts (and before a conversion)."""
    for key, argument in RESERVED_ENGINE_KWARGS.items():
        if key in engine_kwargs:
            instead = f"pass load_model's {argument} instead" if argument else "fp8kit sets it for the weight sharing"
            raise Fp8kitError(f"vllm_kwargs {key}={engine_kwargs[key]!r}: {instead}")
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if engine_kwargs.get(key, 1) != 1:
            raise Fp8kitError(f"vllm_kwargs {key}={engine_kwargs[key]!r}: the trainer shares the weights of one GPU's "
                              f"vLLM model; use one GPU (1)")


def tower_tensors(path: Path, config, device: torch.device) -> dict:
    """The checkpoint's vision and audio towers and projectors (name -> getter to `device`), which vLLM does not
    build for text rollouts (language_model_only): the trainer reads them once, so each weight is on the GPU once.
    Empty for a text-only model."""
    from fp8kit.converter.select import NOT_LANGUAGE
    from fp8kit.rl.loader import checkpoint_tensors

    if not has_tower(config):
        return {}
    return {k: get for k, get in checkpoint_tensors(Path(path), device).items() if NOT_LANGUAGE.search(k)}


def has_tower(config) -> bool:
    """A multimodal model: a language model beside a vision or audio tower, as transformers reads its config (also
    one that keeps the text fields at the top level, as older Qwen2-VL uploads do)."""
    return config.get_text_config() is not config


# Multimodal architectures whose vLLM model names its language model as the checkpoint does
# (`language_model.model.layers.N`, which transformers renames to the trainer's `model.language_model.layers.N`)
# and that ran on a GPU (tests/test_gpu_grpo.py). Qwen2.5-VL's and Qwen3-VL's vLLM names have no transformers
# renaming to the trainer's; vLLM 0.25's Mistral 3 does not import beside transformers 5.
VLLM_MULTIMODAL = ("Gemma3ForConditionalGeneration",)


def rollout_sampling_params(prompts: int, n: int, max_tokens: int, temperature: float, top_p: float, seed: int) -> list:
    """One SamplingParams per prompt, each with its own seed: vLLM seeds a prompt's j-th sample with seed + j, so a
    shared seed would give the same sample slot of every prompt the same random stream."""
    from vllm import SamplingParams

    return [SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, logprobs=0,
                           seed=(seed * 65537 + i * n) % (2**31 - 1)) for i in range(prompts)]


def set_engine_environment() -> None:
    """The vLLM settings the shared-weight engine needs, made where vLLM will read them. The engine core must run in
    this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): in a subprocess its weights are out of the trainer's reach,
    found only after a whole engine start (an AttributeError). vLLM reads its settings from the environment until an
    engine has run in this process and caches them from then on (vllm/envs.py enable_envs_cache, called by
    v1/engine/core.py): after an earlier engine's exit that cache is dropped (disable_envs_cache, vLLM's own reset),
    or settings cached then would override these."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        # Hopper's default block kernel (FlashInfer/DeepGEMM) re-quantizes block weights in place to power-of-two
        # (UE8M0) scales and quantizes activations with such scales (VLLM_USE_DEEP_GEMM_E8M0 on by default;
        # vLLM 0.25's vllm/utils/deep_gemm.py is_deep_gemm_e8m0_used, fp8_utils.requant_weight_ue8m0_inplace):
        # the shared weights would differ from the checkpoint's and vLLM's activations from the trainer's. SM90's
        # DeepGEMM takes the checkpoint's float32 scales as they are (UE8M0 is Blackwell's format).
        os.environ.setdefault("VLLM_USE_DEEP_GEMM_E8M0", "0")
    envs = sys.modules.get("vllm.envs")  # not imported: nothing is cached
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


class VLLMRollout:
    """A vLLM engine in this process; its weights are the training model's."""

    name = "vllm"

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.bfloat16, max_seq_length: int = 2048,
                 gpu_memory_utilization: float = 0.6, lora_rank: int = 32, target_modules=None,
                 **engine_kwargs):
        from fp8kit.rl.loader import DEFAULT_TARGETS

        set_engine_environment()
        kwargs = rollout_llm_kwargs(path, dtype, max_seq_length, gpu_memory_utilization, lora_rank, target_modules,
                                    engine_kwargs)
        initialize_early(quantized=bool(quantization_config(path)))
        from vllm import LLM

        self.path = Path(path)
        self.lora_rank = lora_rank
        self.target_modules = list(target_modules or DEFAULT_TARGETS)
        self.llm = LLM(str(path), **kwargs)
        OPEN_ENGINES.add(id(self))
        worker = self.llm.llm_engine.model_executor.driver_worker.worker
        self.runner = worker.model_runner
        self.vllm_model = worker.get_model()
        self.lora_request = None
        self._trainer_name = lambda name: name
        self._slot = None
        self._covered = False
        self.asleep = False

    def training_model(self, scheme: str | None, dtype: torch.dtype, lora_rank: int = 32,
                       lora_alpha: float | None = None, target_modules=None, backend: str | None = None,
                       seed: int | None = None) -> nn.Module:
        """The transformers model assembled on views of vLLM's weights, LoRA attached (A drawn from `seed`, default
        the loaders') and registered with vLLM."""
        from transformers import AutoConfig

        from fp8kit.loaded_names import key_renamer
        from fp8kit.rl.loader import DEFAULT_SEED, assemble, load_generation_config

        config = AutoConfig.from_pretrained(self.path)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        targets = set(target_modules or self.target_modules)
        tensors = shared_tensors(self.vllm_model, config, scheme)
        towers = tower_tensors(self.path, config, torch.device("cuda"))
        before = torch.cuda.memory_allocated()
        model = assemble(config, {**towers, **tensors}, scheme, dtype, lora_rank, lora_alpha, targets, 0.0, backend,
                         f"vLLM engine for {self.path}", seed=DEFAULT_SEED if seed is None else seed)
        model.to("cuda")  # moves only what is not vLLM's already: the rotary tables built on the CPU
        load_generation_config(model, self.path)  # the stop tokens vLLM uses, for model.generate too
        # LoRA, rotary tables and the towers vLLM did not build
        self.trainer_allocated_bytes = torch.cuda.memory_allocated() - before
        # vLLM names modules as the checkpoint did (Gemma 3's `language_model.model.layers.N`), the trainer as
        # transformers loads them (`model.language_model.layers.N`)
        self._trainer_name = key_renamer(model)
        if lora_rank:
            self._register_adapter(model)
        return model

    def _register_adapter(self, model: nn.Module) -> None:
        """vLLM loads the initial adapter once from a file through its own API; later steps write in place."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        from fp8kit.rl.loader import write_adapter

        folder = Path(tempfile.mkdtemp(prefix="fp8kit-lora-"))
        write_adapter(model, folder, str(self.path))
        self.lora_request = LoRARequest("fp8kit-policy", LORA_ID, str(folder))
        self.llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1), lora_request=self.lora_request,
                          use_tqdm=False)
        manager = self.runner.lora_manager._adapter_manager
        self._manager = manager
        self._slot = manager.lora_index_to_id.index(LORA_ID)
        manager.pin_adapter(LORA_ID)  # never evicted, so never re-read from the folder
        import shutil

        shutil.rmtree(folder, ignore_errors=True)

    @torch.no_grad()
    def sync_lora(self, model: nn.Module) -> None:
        """Write the trainer's LoRA into vLLM's active adapter slot (B scaled by alpha/r), in place. The adapter
        keeps its id (and vLLM its cache key, lora/cache_identity.py), so vLLM's prefix cache would still serve
        prompts' KV computed under the old weights: the GRPO loop calls this between sleep() (which resets the
        prefix cache) and wake(); called while awake (train()'s first sync, user code) it resets the cache itself."""
        self._check_open()
        if self.lora_request is None:
            return
        from fp8kit.rl.loader import lora_modules

        ours = lora_modules(model)
        slot = self._slot
        written = set()
        for name, module in self._manager.modules.items():
            subs = self._manager.packed_modules.get(name, [name])
            for i, sub in enumerate(subs):
                sub = self._trainer_name(sub)
                m = ours.get(sub)
                written.add(sub)
                a, b = module.lora_a_stacked[i][slot, 0], module.lora_b_stacked[i][slot, 0]
                if m is None:
                    a.zero_()
                    b.zero_()
                    continue
                a[: m.rank, : m.in_features].copy_(m.lora_A)
                b[: m.out_features, : m.rank].copy_(m.lora_B * m.scaling)
        if not self._covered:
            missing = sorted(set(ours) - written)
            if missing:
                raise Fp8kitError(f"vLLM has no LoRA slot for {len(missing)} of the model's LoRA modules, e.g. "
                                  f"{missing[0]}; restrict target_modules to projections vLLM wraps")
            self._covered = True
        torch.cuda.synchronize()
        if not self.asleep:
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and let go of its weights and KV cache (unload_model). The memory returns once
        nothing else holds a view of the weights: the training model's tensors are such views."""
        if self.llm is None:
            return
        self.wake()  # freeing an allocation unmaps it: the KV cache's must be mapped again first
        # cuBLAS keeps a workspace per handle and stream (32 MiB on Hopper; aten/src/ATen/cuda/CublasHandlePool.cpp):
        # 66 MiB of them stayed allocated after unload_model on an H100 (evals/engine_unload.py). The next GEMM on a
        # stream makes its workspace anew
        if torch.cuda.is_available():
            torch._C._cuda_clearCublasWorkspaces()
        # EngineCore.shutdown: the executor and scheduler shut down, gc.unfreeze() (its start's gc.freeze() kept
        # the engine's reference cycles, and their GPU memory, from ever being collected), its process group torn
        # down (vllm/v1/engine/core.py; vllm/distributed/parallel_state.py cleanup_dist_env_and_memory)
        self.llm.llm_engine.engine_core.shutdown()
        OPEN_ENGINES.discard(id(self))
        self.llm = self.runner = self.vllm_model = self._manager = self.lora_request = None
        clear_lora_pointer_caches()
        gc.collect()
        torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.llm is None:
            raise Fp8kitError(f"the vLLM engine for {self.path} was shut down (unload_model): load the model again "
                              f"with load_model to sample from it")

    def sleep(self) -> None:
        """Release the KV cache for training; the weights stay where they are. vLLM's level-1 sleep copies every
        weight allocation to pinned host memory and unmaps it (device_allocator/cumem.py CuMemAllocator.sleep, the
        "weights" tag), and waking them copies them back: two passes over the model's weights a step (9 GB each
        way for an 8B FP8 model) to keep bytes that never left. The allocator is shown only the KV cache's
        allocations while the engine sleeps (the scheduler paused, the prefix cache cleared, as a level-1 sleep
        does), so only those are released; the executor then counts the weights as awake."""
        if self.asleep:
            return
        self._check_open()
        from vllm.device_allocator.cumem import CuMemAllocator

        allocator = CuMemAllocator.get_instance()
        every = allocator.pointer_to_data
        allocator.pointer_to_data = {p: d for p, d in every.items() if d.tag == "kv_cache"}
        try:
            self.llm.sleep(level=1)
        finally:
            allocator.pointer_to_data = every
        self.llm.llm_engine.model_executor.sleeping_tags.discard("weights")
        self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back before the KV cache is mapped again
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def generate(self, prompt_ids: list[list[int]], n: int, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0) -> list[Completion]:
        self._check_open()
        self.wake()
        params = rollout_sampling_params(len(prompt_ids), n, max_tokens, temperature, top_p, seed)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, lora_request=self.lora_request,
                                 use_tqdm=False)
        completions = []
        for o in outs:
            for c in sorted(o.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                completions.append(Completion(ids, [d[t].logprob for d, t in zip(c.logprobs, ids)]))
        return completions
