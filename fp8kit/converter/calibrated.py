"""`--scheme tensor-static`: per-tensor FP8 weights and static per-tensor activation scales.

Static activation scales let vLLM skip the per-token amax of dynamic schemes, its fastest FP8 path. The
scales are measured on calibration text by running the model, which a streaming converter cannot do, so
this scheme goes through llm-compressor's oneshot with its FP8 preset (static min-max observers), with
fp8kit's own rules for what stays in source precision and its atomic output.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from fp8kit.converter import source
from fp8kit.converter.calibration import calibration_samples, kv_cache_scheme, model_run_error
from fp8kit.converter.formats import ignore_list
from fp8kit.converter.output import atomic_directory, check_out, whole_once_written
from fp8kit.converter.schemes import SCHEMES
from fp8kit.converter.select import natural_key, select
from fp8kit.errors import Fp8kitError

RUN_FIX = "use --scheme tensor or dynamic, which read the weights without running the model"


def convert_static(src, out, calibration: str | Path | None = None, ignore=(), overwrite: bool = False,
                   seq_len: int = 512, kv_cache: str | None = None, device: str = "auto",
                   max_shard_size: str | int = "5GB"):
    """`device`: where the model is loaded and calibrated. llm-compressor's oneshot takes no device: its
    sequential pipeline moves each layer onto its own main device, the first accelerator whenever one is
    visible (llmcompressor.utils.dev.get_main_device), so "cpu" is refused on a machine with one."""
    import torch

    from fp8kit.converter.streaming import (ConvertReport, abandoned_warnings, check_all_finite, parse_size,
                                            peak_rss_bytes, read_source, resolve_device)

    start = time.perf_counter()
    dev = resolve_device(device)
    shard_bytes = parse_size(max_shard_size)
    if device == "cpu" and _accelerator_available():
        raise Fp8kitError("--device cpu: --scheme tensor-static calibrates through llm-compressor, which runs on the "
                          "GPU whenever one is visible; use --device auto or cuda, or hide the GPU "
                          "(CUDA_VISIBLE_DEVICES=) to calibrate on the CPU")
    out = check_out(out, overwrite)
    src_path = source.resolve(src).resolve()
    check_out(out, overwrite, src_path)
    _, tensors = read_source(src_path)
    sel = select(tensors, SCHEMES["tensor"], list(ignore), src=src_path)
    check_all_finite(tensors)

    from torch.utils.data import DataLoader

    from fp8kit.loaded_names import load_model

    tokenizer, samples, calibration = calibration_samples(src_path, calibration, seq_len, "--scheme tensor-static")
    # imported once the input is known good: on a machine without a GPU, importing it logs a warning
    try:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError as e:
        raise Fp8kitError("--scheme tensor-static calibrates with llm-compressor: pip install llmcompressor") from e
    # A plain DataLoader of token ids: a `datasets.Dataset` would be fingerprinted by pickling, which fails
    # with some pyarrow/dill combinations (seen with pyarrow 26 on Python 3.12).
    loader = DataLoader([{"input_ids": torch.tensor(s), "attention_mask": torch.ones(len(s), dtype=torch.long)}
                         for s in samples], batch_size=1)
    # on the GPU unless --device cpu: calibration runs the whole model over the text
    try:
        model = load_model(src_path, dtype="auto", device_map=str(dev) if dev.type == "cuda" else None)
    except Fp8kitError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a model_type transformers does not know
        raise model_run_error(src_path, "--scheme tensor-static", e, RUN_FIX) from e
    # the KV-cache scales as llm-compressor measures them, with the static min-max observer that our streaming
    # schemes' --kv-cache fp8 matches (its default observer averages over batches)
    kv_scheme = {**kv_cache_scheme(), "observer": "static_minmax"} if kv_cache else None
    # llm-compressor matches its ignore list against the loaded model's module names, which transformers renames
    # from the checkpoint's (Gemma 3's `vision_tower.encoder...` is `model.vision_tower.encoder...` in memory): every
    # Linear it must leave alone is named as it is loaded
    names = linear_checkpoint_names(model)
    # transformers 5 loads MoE experts fused (Qwen3-MoE's 3-D Qwen3MoeExperts, no Linear to name), and llm-compressor
    # splits them back into per-expert Linears under the checkpoint's names: the experts kept in source precision
    # (--ignore) are named as the checkpoint names them
    unloaded = sorted(set(sel.keep) - set(names.values()), key=natural_key)
    recipe = QuantizationModifier(targets="Linear", scheme="FP8",
                                  ignore=_leave_alone(names, set(sel.quantize)) + unloaded, kv_cache_scheme=kv_scheme)
    try:
        with torch.no_grad():
            oneshot(model=model, dataset=loader, processor=tokenizer, recipe=recipe,
                    num_calibration_samples=len(samples), max_seq_length=seq_len)
    except Fp8kitError:
        raise
    except torch.OutOfMemoryError as e:
        raise Fp8kitError(f"{src_path}: --scheme tensor-static runs the whole model over the calibration text and ran "
                          f"out of memory on {dev}; free GPU memory, or calibrate on the CPU "
                          f"(CUDA_VISIBLE_DEVICES=)") from e
    except Exception as e:  # noqa: BLE001 - e.g. token ids past the embedding table
        raise model_run_error(src_path, "--scheme tensor-static", e, RUN_FIX) from e
    _check_finite_scales(src_path, model)
    warnings = list(sel.warnings)
    # a full disk inside save_pretrained (a SafetensorError, not an OSError) is one line: see atomic_directory
    # transformers 5 refuses to save a generation config with sampling fields (temperature, top_p) but no do_sample,
    # which it loads without a word (and it would rewrite one it saves): a default one is saved, then replaced by
    # the source's own file byte for byte, as the streaming schemes copy it
    if getattr(model, "generation_config", None) is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig()
    abandoned, placed = [], []
    with whole_once_written(out, placed):  # an interrupt once OUT is in place says so
        with atomic_directory(out, overwrite, abandoned, placed) as partial:
            model.save_pretrained(partial, save_compressed=True, max_shard_size=shard_bytes)
            generation = src_path / "generation_config.json"
            if generation.is_file():
                shutil.copyfile(generation, partial / generation.name)
            else:
                (partial / generation.name).unlink(missing_ok=True)
            source.copy_extra_files(src_path, partial, keep_existing=True)  # save_pretrained wrote some already
            for stray in ("recipe.yaml",):
                (partial / stray).unlink(missing_ok=True)
            quantized = _fp8_modules(partial)  # what was written, not what was asked for
            if not quantized:
                raise Fp8kitError(f"{src_path}: llm-compressor quantized none of the {len(sel.quantize)} Linear "
                                  f"weights selected (they are not torch Linear modules in this architecture); nothing "
                                  f"was written")
            written = set(quantized)
            unwanted = sorted(written - set(sel.quantize), key=natural_key)
            if unwanted:
                raise Fp8kitError(f"{src_path}: llm-compressor quantized {len(unwanted)} weights that stay in source "
                                  f"precision ({', '.join(unwanted[:3])}{' ...' if len(unwanted) > 3 else ''}): its "
                                  f"module names did not match the checkpoint's, so nothing was written; {RUN_FIX}")
            missed = [m for m in sel.quantize if m not in written]
            if missed:
                more = " ..." if len(missed) > 4 else ""
                warnings.append(f"{len(missed)} weights stay in source precision because llm-compressor quantizes "
                                f"torch Linear modules only: {', '.join(missed[:4])}{more}")
            ignored = _write_ignore(partial, names, sel.keep + missed, written)
        files = source.folder_files(out)
        return ConvertReport(
            src=str(src), out=str(out), scheme="tensor-static", format="compressed-tensors", device=str(model.device),
            quantized=quantized, ignored=ignored, bytes_in=sum(t.nbytes for t in tensors.values()),
            bytes_out=sum((out / f).stat().st_size for f in files), seconds=time.perf_counter() - start,
            peak_rss_bytes=peak_rss_bytes(), peak_gpu_bytes=None, files=files,
            warnings=warnings + [f"calibrated on {len(samples)} sequences from {calibration.name}"]
            + abandoned_warnings(abandoned),
            unmatched_ignore=sel.unmatched_ignore)


def _is_linear(module) -> bool:
    """What llm-compressor's target "Linear" matches: a class of that name anywhere in the module's bases."""
    return any(cls.__name__ == "Linear" for cls in type(module).__mro__)


def linear_checkpoint_names(model) -> dict[str, str]:
    """{loaded model's name of each Linear: the module name save_pretrained writes it under}, which is the
    checkpoint's (transformers reverts the renaming it applied on loading); "" where that cannot be told."""
    import torch

    linears = {name: module for name, module in model.named_modules()
               if _is_linear(module) and isinstance(getattr(module, "weight", None), torch.Tensor)}
    on_disk = _checkpoint_names(model, {f"{name}.weight": m.weight for name, m in linears.items()})
    return {name: on_disk.get(f"{name}.weight", "")[: -len(".weight")] for name in linears}


def _leave_alone(names: dict[str, str], selected: set[str]) -> list[str]:
    """The loaded model's names (linear_checkpoint_names) of every Linear whose checkpoint name is not among
    `selected`; a Linear whose checkpoint name cannot be told is left alone as well."""
    return [name for name, on_disk in names.items() if on_disk not in selected]


def _checkpoint_names(model, weights: dict) -> dict[str, str]:
    """{name in the loaded model: name save_pretrained writes}, from transformers' own reverse renaming, run on
    shape-only copies; names as they are where transformers has none (before 5.0) or it fails."""
    try:
        from transformers.core_model_loading import revert_weight_conversion

        shadows = {name: w.detach().to("meta") for name, w in weights.items()}
        owner = {id(t): name for name, t in shadows.items()}
        reverted = revert_weight_conversion(model, shadows)
        return {owner[id(t)]: name for name, t in reverted.items() if id(t) in owner}
    except Exception:  # noqa: BLE001 - an older transformers or a conversion it cannot run on shapes alone
        return {name: name for name in weights}


def _write_ignore(folder: Path, names: dict[str, str], kept: list[str], quantized: set[str]) -> list[str]:
    """The config's ignore list made to say what was written: every Linear weight left in source precision, by
    its name in the checkpoint and, where transformers renames it on loading, by that name too (`names`, from
    linear_checkpoint_names, as streaming conversions get them from fp8kit.loaded_names; llm-compressor lists only
    the loaded names of the modules it matched, and misses torch Linear subclasses such as nn.MultiheadAttention's
    out_proj). Returns the checkpoint names."""
    import json

    path = folder / "config.json"
    config = json.loads(path.read_text())
    qc = config["quantization_config"]
    loaded = {on_disk: name for name, on_disk in names.items() if on_disk and on_disk != name}
    # llm-compressor's own entries may be loaded names: each is counted once, by its checkpoint name
    theirs = [names.get(name) or name for name in qc.get("ignore") or []]
    kept = sorted(set(kept) | {name for name in theirs if name not in quantized})
    qc["ignore"] = ignore_list(kept, loaded=loaded)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return ignore_list(kept)


def _fp8_modules(folder: Path) -> list[str]:
    """The modules whose weight the output holds in FP8."""
    from fp8kit.converter.safetensors_io import read_header

    return sorted(name[: -len(".weight")] for f in folder.glob("*.safetensors")
                  for name, info in read_header(f)[0].items() if name.endswith(".weight") and info.dtype == "F8_E4M3")


def _accelerator_available() -> bool:
    """Whether llm-compressor will calibrate on an accelerator (its get_main_device's test)."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def _check_finite_scales(src_path: Path, model) -> None:
    """A scale llm-compressor measured from activations that overflowed the source dtype (an fp16 model on this
    text) is NaN or inf, which vLLM would load and serve as NaN: refused, naming the first."""
    import torch

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        values = t.detach().float().flatten() if name.endswith("_scale") else None
        if values is not None and not bool(torch.isfinite(values).all()):
            bad = values[~torch.isfinite(values)][0].item()
            raise Fp8kitError(f"{src_path}: the calibrated {name} is {bad}: the model's activations overflow "
                              f"{str(model.dtype).removeprefix('torch.')} on the calibration text; convert a bfloat16 "
                              f"or float32 copy of it; nothing was written")
