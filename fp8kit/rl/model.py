"""`load_model`: the one call that gives an RL run its policy, in FP8 or the BF16/FP16 baseline, with the
rollout engine attached (vLLM sharing the policy's weights on a GPU, transformers' generate elsewhere)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

from fp8kit.errors import Fp8kitError
from fp8kit.quality import WEIGHT_SCALES
from fp8kit.rl.loader import (DEFAULT_SEED, _one_line, _short_repr, check_device, check_seed, load_fp8_model,
                               load_lora_model, lora_targets, read_config, static_activation_scales)
from fp8kit.rl.rollout import HFRollout
from fp8kit.rl.vllm_engine import (VLLM_MULTIMODAL, check_engine_kwargs, check_no_live_engine, check_rollout_arguments, check_rollout_model,
                                   has_tower)


# what AutoTokenizer reads: a fast tokenizer's file, the config naming the class, or a slow tokenizer's vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt", "tekken.json")


def _vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def load_model(name: str | Path, load_in_fp8: bool | str = True, dtype: torch.dtype = torch.bfloat16,
               max_seq_length: int = 2048, lora_rank: int = 32, lora_alpha: float | None = None,
               target_modules: list[str] | None = None, fast_inference: bool = True,
               gpu_memory_utilization: float = 0.6, device: str | None = None, backend: str | None = None,
               vllm_kwargs: dict | None = None, seed: int = DEFAULT_SEED):
    """Returns (model, tokenizer). `model.rollout_engine` samples for GRPO.

    load_in_fp8: True (or "dynamic") for the registry's dynamic answer, "block" for 128x128 blocks, False for the
    full-precision baseline. The name goes through the registry: a pre-quantized upload that serves the request,
    whatever its weight scales (Qwen's own FP8 uploads are 128x128 blocks, which vLLM serves with dynamic
    activations), or else our per-channel conversion (row-wise, the fastest on SM89+), made once and cached; a local
    FP8 checkpoint is used as it is. With fast_inference and vLLM
    installed on a CUDA machine, vLLM is started in this process and the model's weights are views of vLLM's
    (one copy on the GPU; vllm_kwargs reach vllm.LLM, e.g. kv_cache_memory_bytes); otherwise rollouts use
    transformers' generate on the model itself. `seed` draws the LoRA initialisation (default 3407, Unsloth's
    random_state) without touching the global random state. model.save_pretrained(folder) saves the adapter in
    PEFT's format."""
    if not isinstance(name, (str, os.PathLike)):  # None (an unset variable) was a TypeError from pathlib
        raise Fp8kitError(f"name={_short_repr(name, 60)}: expected a Hub repo id org/name[@revision] or a checkpoint "
                          f"folder")
    if not isinstance(fast_inference, bool):  # 'no' is truthy: it started vLLM
        raise Fp8kitError(f"fast_inference={_short_repr(fast_inference, 40)}: expected True (vLLM rollouts where vLLM "
                          f"runs) or False (transformers' generate)")
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
            or not 0 < gpu_memory_utilization <= 1:  # vLLM's own refusal came after a conversion
        raise Fp8kitError(f"gpu_memory_utilization={_short_repr(gpu_memory_utilization, 40)}: expected a fraction of "
                          f"the GPU's memory in (0, 1], e.g. 0.6")
    if vllm_kwargs is not None and not isinstance(vllm_kwargs, dict):
        raise Fp8kitError(f"vllm_kwargs={_short_repr(vllm_kwargs, 60)}: expected a dict of vllm.LLM arguments")
    if not (load_in_fp8 is True or load_in_fp8 is False or load_in_fp8 in ("block", "dynamic")):  # 0 == False
        raise Fp8kitError(f"load_in_fp8={load_in_fp8!r}: expected True (or 'dynamic'), 'block' or False")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise Fp8kitError(f"dtype {dtype}: expected torch.bfloat16 or torch.float16 (float32 for CPU reference work)")
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 2:
        raise Fp8kitError(f"max_seq_length={max_seq_length!r}: expected an integer >= 2 (prompt and completion tokens)")
    device = check_device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    targets = lora_targets(lora_rank, lora_alpha, target_modules, 0.0, device)  # before any conversion or engine start
    check_seed(seed)
    with_vllm = fast_inference and device.type == "cuda" and _vllm_available()
    if with_vllm and device.index not in (None, 0):
        # vLLM's single-GPU worker takes cuda:<local rank> = cuda:0 of this process (vllm/v1/worker/gpu_worker.py),
        # and the trainer's weights are views of its parameters: they cannot live on another GPU.
        raise Fp8kitError(f"device={str(device)!r}: vLLM rollouts run on cuda:0 of this process; pick the GPU with "
                          f"CUDA_VISIBLE_DEVICES={device.index} and pass device='cuda', or pass fast_inference=False")
    if with_vllm:  # before _checkpoint, which may convert the model
        check_no_live_engine()
        check_rollout_arguments(dtype, lora_rank)
        check_engine_kwargs(vllm_kwargs or {})
        if lora_rank and "lm_head" in targets:
            # vLLM's lm_head LoRA (LogitsProcessorWithLoRA) keeps one stacked tensor, not one per packed slice as
            # VLLMRollout.sync_lora writes them: the first sync would fail after a whole rollout and training step
            raise Fp8kitError("target_modules 'lm_head': vLLM rollouts carry no LoRA on lm_head; leave it out, or pass "
                              "fast_inference=False")
    local = Path(name).expanduser()
    source_config, source_scheme = read_config(local) if local.is_dir() else (None, None)
    tokenizer = None
    if local.is_dir() and source_scheme is None:  # an original to convert: its tokenizer before minutes of work
        # loaded, not just found (a broken one was blamed on the cached conversion's copy); the conversion copies
        # the tokenizer files as they are, so this one is the model's
        tokenizer = _tokenizer(local)
        if with_vllm:
            _check_vllm_model(source_config, local, dtype, max_seq_length, vllm_kwargs)
    path = _checkpoint(str(name), load_in_fp8, source_scheme, with_vllm)
    config, scheme = (source_config, source_scheme) if path == local else read_config(path)
    check_loaded_scheme(path, scheme, load_in_fp8)  # a Hub repo the registry does not list, once downloaded
    if with_vllm:
        _check_vllm_model(config, path, dtype, max_seq_length, vllm_kwargs)
    if with_vllm and static_activation_scales(path):
        raise Fp8kitError(f"{path}: static activation scales ({WEIGHT_SCALES[scheme]} weights): vLLM's rollouts would "
                          f"quantize with them while the trainer quantizes per token, so their log-probabilities would "
                          f"disagree; for GRPO convert with --scheme tensor or dynamic")
    tokenizer = tokenizer or _tokenizer(path)  # before any weight is read or vLLM starts
    lora = dict(lora_rank=lora_rank, lora_alpha=lora_alpha, target_modules=target_modules)
    if with_vllm:
        from fp8kit.rl.vllm_engine import VLLMRollout

        engine = VLLMRollout(path, dtype=dtype, max_seq_length=max_seq_length,
                             gpu_memory_utilization=gpu_memory_utilization, lora_rank=lora_rank,
                             target_modules=target_modules, **(vllm_kwargs or {}))
        try:
            model = engine.training_model(scheme, dtype, backend=backend, seed=seed, **lora)
        except BaseException:
            engine.close()  # else it holds the GPU, unreachable, and the next load_model is refused
            raise
    else:
        if scheme:
            model = load_fp8_model(path, dtype, device=device, backend=backend, seed=seed, **lora)
        else:
            model = load_lora_model(path, dtype, device=device, seed=seed, **lora)
        engine = None
    model.rollout_engine = engine or HFRollout(model, tokenizer)
    model.max_seq_length = max_seq_length
    # saved adapters name their base by it: peft opens neither '~' nor a relative path
    model.name_or_path = str(local.resolve()) if local.is_dir() else str(name)
    return model, tokenizer


def unload_model(model: torch.nn.Module) -> None:
    """Free the device memory load_model took, for other work in this process (evaluating the adapter with another
    tool, a model loaded with fast_inference=False). `del model` frees none of vLLM's: its engine freezes its objects
    out of the garbage collector's reach (gc.freeze) until it is shut down. Here the engine is shut down and the
    model's tensors, views of vLLM's weights, are dropped, whatever else still references the model: it is unusable
    afterwards. vLLM's pool is left empty: the next load_model with vLLM rollouts starts an engine in this process."""
    if not isinstance(model, torch.nn.Module):
        raise Fp8kitError(f"unload_model({_short_repr(model, 60)}): expected a model from load_model")
    engine = getattr(model, "rollout_engine", None)
    if hasattr(engine, "close"):
        engine.close()
    model.to("meta")
    model.unloaded = True
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _check_vllm_model(config, path: Path, dtype: torch.dtype, max_seq_length: int, vllm_kwargs: dict | None) -> None:
    """What the shared-weight vLLM rollouts cannot take of this model, refused before its conversion (an original)
    and before the engine starts: a tower other than Gemma 3's, and what vLLM itself refuses (check_rollout_model)."""
    architecture = (getattr(config, "architectures", None) or [config.model_type])[0]
    if has_tower(config) and architecture not in VLLM_MULTIMODAL:
        raise Fp8kitError(f"{path}: {architecture} has a vision or audio tower; vLLM rollouts sharing the trainer's "
                          f"weights take text models and {', '.join(VLLM_MULTIMODAL)} so far: pass "
                          f"fast_inference=False (rollouts with transformers' generate on the same model)")
    check_rollout_model(config, path, dtype, max_seq_length, vllm_kwargs)


def _check_tokenizer_files(path: Path) -> None:
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise Fp8kitError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); GRPO needs the "
                          f"model's tokenizer: copy the original model's tokenizer files into this folder")


def _tokenizer(path: Path):
    """The checkpoint's tokenizer, pad token defaulting to EOS; one error line if it has none or it cannot load."""
    from transformers import AutoTokenizer

    _check_tokenizer_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, ImportError (sentencepiece), JSON errors, ...
        raise Fp8kitError(f"{path}: transformers cannot load its tokenizer ({_one_line(e)}); copy the original "
                          f"model's tokenizer files into this folder") from e
    if tokenizer.pad_token_id is None and tokenizer.eos_token is None:  # pads with the first stop token vLLM reads
        eos = _generation_eos(path)
        if eos is None:
            raise Fp8kitError(f"{path}: the tokenizer has neither a pad nor an EOS token, and generation_config.json "
                              f"names no eos_token_id; set eos_token in tokenizer_config.json (completions end there)")
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(eos)
    elif tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _generation_eos(path: Path) -> int | None:
    """The first eos_token_id of generation_config.json (an int or a list), if any."""
    import json

    try:
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def check_not_static_upload(answer) -> None:
    """A registry answer that is a tensor-static upload (its own name: `fp8kit publish --scheme tensor-static`
    registers such repos) is refused for vLLM rollouts before it is downloaded, as the checkpoint would be after."""
    if answer.variant_scheme == "tensor-static":
        raise Fp8kitError(f"{answer.repo_id}: registered with static activation scales (tensor-static): vLLM's rollouts "
                          f"would quantize with them while the trainer quantizes per token, so their log-probabilities "
                          f"would disagree; for GRPO load its base model (converted per channel) or a dynamic variant")


def check_loaded_scheme(where, scheme: str | None, load_in_fp8: bool | str) -> None:
    """What load_in_fp8 asked for against the FP8 scheme a checkpoint (or a registered upload, before it is
    downloaded) holds: the baseline needs the original, and block needs a block checkpoint."""
    if scheme is not None and load_in_fp8 is False:
        raise Fp8kitError(f"{where}: already an FP8 checkpoint ({scheme}); the load_in_fp8=False baseline needs the "
                          f"original model")
    if load_in_fp8 == "block" and scheme not in (None, "block"):
        raise Fp8kitError(f"{where}: a {scheme} FP8 checkpoint, not block; pass load_in_fp8=True or the original model "
                          f"to convert")


def _registered_upload(name: str):
    """The registry's variant whose repo is `name` itself (pinned or not), if any: known FP8 before any download."""
    from fp8kit.registry import load

    key = name.strip().partition("@")[0].lower()
    try:
        variants = load()
    except Fp8kitError:  # a broken overlay: the checkpoint's own config.json is checked once it is downloaded
        return None
    return next((v for v in variants if v.repo_id.lower() == key), None)


def _checkpoint(name: str, load_in_fp8: bool | str, local_scheme: str | None, with_vllm: bool) -> Path:
    """The local directory to load: an FP8 variant from the registry, or the original for the baseline.
    local_scheme: the FP8 scheme of `name` when it is a local FP8 checkpoint (read_config's), else None. load_model
    checks the scheme of what this returns; an upload the registry lists by its own name is checked here, before
    it is downloaded."""
    local = Path(name).expanduser()
    if local_scheme is not None:
        check_loaded_scheme(local, local_scheme, load_in_fp8)
        return local
    if local.is_dir():
        return local if load_in_fp8 is False else _ensure(name, load_in_fp8, with_vllm)
    upload = _registered_upload(name)
    if upload is not None:
        check_loaded_scheme(upload.repo_id, upload.scheme, load_in_fp8)
    if load_in_fp8 is False:
        from fp8kit.converter.source import resolve as source_resolve

        return source_resolve(name)
    return _ensure(name, load_in_fp8, with_vllm)


def _ensure(name: str, load_in_fp8: bool | str, with_vllm: bool) -> Path:
    """The registry's answer for `name`: its upload, or its conversion; a Hub repo the registry does not list that is
    FP8 already (a third party's upload) is used as it is, like a local FP8 folder (the converter refuses it)."""
    import json

    from fp8kit.converter.source import resolve as source_resolve
    from fp8kit.registry import ensure_resolved, resolve

    answer = resolve(name, "block" if load_in_fp8 == "block" else "dynamic")
    if with_vllm:
        check_not_static_upload(answer)
    if answer.repo_id is None and not Path(name).expanduser().is_dir():
        src = source_resolve(name)  # downloaded, as the conversion would; load_model reads its scheme next
        try:
            quantized = bool(json.loads((src / "config.json").read_text()).get("quantization_config"))
        except (OSError, ValueError, AttributeError):  # the converter names what is wrong with it
            quantized = False
        if quantized:
            return src
    return ensure_resolved(answer)
