"""`convert()`: stream a checkpoint into FP8 safetensors, a bounded piece at a time.

Each shard's header is laid out from shapes first; weights are then read in row chunks of at most
CHUNK_BYTES (as float32), quantized and written at their final offsets. Peak memory is therefore a few
chunks whatever the model or shard size (except with `kv_cache`, whose calibration runs the whole model first).
Output is assembled in OUT.partial and renamed when complete.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fp8kit.converter import source
from fp8kit.converter.calibration import KV_CACHE_DTYPES, kv_cache_scales, kv_cache_scheme
from fp8kit.converter.formats import FORMATS, ignore_list, quantization_config, scale_name
from fp8kit.converter.output import atomic_directory, check_out, stdout_to_stderr, whole_once_written
from fp8kit.converter.safetensors_io import (DTYPES, ITEMSIZE, OutTensor, TensorInfo, layout,
                                             read_bytes, save_small, to_tensor, write_all)
from fp8kit.converter.schemes import SCHEMES, Scheme, amax, quantize_with_scale, scale_from_amax
from fp8kit.converter.select import check_not_quantized, expert_layer, natural_key, select
from fp8kit.errors import Fp8kitError
from fp8kit.loaded_names import loaded_names

CHUNK_BYTES = 16 << 20  # float32 working set of one quantization piece
COPY_BYTES = 8 << 20  # one piece of a tensor copied as it is
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
TRANSPOSED_LINEARS = {"gpt2", "openai-gpt", "decision_transformer"}  # transformers' Conv1D keeps [in, out]


@dataclass
class ConvertReport:
    src: str
    out: str
    scheme: str
    format: str
    device: str
    quantized: list[str]
    ignored: list[str]
    bytes_in: int
    bytes_out: int
    seconds: float
    peak_rss_bytes: int | None  # None where the platform has no measure of it
    peak_gpu_bytes: int | None
    files: list[str]
    warnings: list[str] = field(default_factory=list)
    unmatched_ignore: list[str] = field(default_factory=list)  # --ignore patterns that matched no weight

    def to_dict(self) -> dict:
        return asdict(self)


def parse_size(size: str | int) -> int:
    """'5GB' -> 5e9 and '5GiB' -> 5*2**30, as transformers' save_pretrained reads max_shard_size."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size.upper().replace("IB", "iB"), re.I)
    if not m:
        raise Fp8kitError(f"--max-shard-size {size!r}: expected a size such as 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    nbytes = float(m.group(1)) * base ** "_KMGT".index(m.group(2) or "_")
    if not 1 <= nbytes < 2**63:  # under a byte ('0.5') truncated to 0: a shard per tensor
        raise Fp8kitError(f"--max-shard-size {size!r}: out of range; give at least one byte, such as 5GB")
    return int(nbytes)


def peak_rss_bytes(status: str = "/proc/self/status") -> int | None:
    """This process's resident-set high-water mark. VmHWM, where Linux has it: ru_maxrss also counts the
    peak of a parent this process was forked from before exec. None where neither exists (Windows)."""
    try:
        with open(status) as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        pass
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux and the BSDs KiB


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise Fp8kitError("--device cuda: no CUDA device is available; use --device cpu or auto")
    if device not in ("cpu", "cuda"):
        raise Fp8kitError(f"--device {device!r}: expected auto, cpu or cuda")
    return torch.device(device)


@dataclass
class Job:
    """One source tensor and the output tensors it becomes."""

    info: TensorInfo
    outputs: list[OutTensor]
    quantize: bool


def _scale_dtype(source_dtype: str, fmt: str) -> str:
    """The source's dtype, as llm-compressor writes scales (compressed-tensors and transformers create them so and
    would round float32 ones back), float32 in the `fp8` format."""
    return "F32" if fmt == "fp8" else source_dtype


def _plan(tensors: dict[str, TensorInfo], quantize: set[str], scheme: Scheme, fmt: str) -> list[Job]:
    jobs = []
    for name in sorted(tensors, key=natural_key):
        info = tensors[name]
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module in quantize:
            scale_dtype = _scale_dtype(info.dtype, fmt)
            outputs = [OutTensor(name, "F8_E4M3", info.shape),
                       OutTensor(f"{module}.{scale_name(scheme, fmt)}", scale_dtype, scheme.scale_shape(info.shape))]
            jobs.append(Job(info, outputs, True))
        else:
            jobs.append(Job(info, [OutTensor(name, info.dtype, info.shape)], False))
    return jobs


def _shard(jobs: list[Job], max_bytes: int) -> list[list[Job]]:
    shards: list[list[Job]] = [[]]
    size = 0
    for job in jobs:
        n = sum(t.nbytes for t in job.outputs)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += n
    return shards


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().to("cpu").contiguous().view(torch.uint8).numpy())


# model types whose vLLM loader maps `.weight_scale_inv` to `.weight_scale` (vllm/model_executor/models/mistral3.py,
# hf_to_vllm_mapper), while its block FP8 layers register `weight_scale_inv` (layers/quantization/fp8.py)
FP8_BLOCK_RENAMED = ("mistral3",)


def read_source(src_path: Path) -> tuple[dict, dict[str, TensorInfo]]:
    """The source's config and tensors, refused when fp8-convert cannot take them (every scheme checks the same)."""
    config = source.load_config(src_path)
    if not isinstance(config.get("model_type", ""), str):
        raise Fp8kitError(f"{src_path / 'config.json'}: model_type must be a string such as \"llama\", not "
                          f"{config['model_type']!r}")
    if config.get("model_type") in TRANSPOSED_LINEARS:
        raise Fp8kitError(f"{src_path / 'config.json'}: model_type {config['model_type']!r} stores its linear "
                          f"weights transposed (Conv1D, [in, out]); fp8-convert does not support it")
    tensors = source.read_tensors(src_path)
    check_not_quantized(tensors)
    source.check_against_config(src_path, tensors)
    return config, tensors


def _tied(config: dict, src: Path) -> bool:
    """Whether transformers ties the output head to the embeddings: as the (text) config says, and where it says
    nothing, as its config class's default does (False for Llama, Qwen and Mistral, True for Gemma 3)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if "tie_word_embeddings" in text or "tie_word_embeddings" in config:
        return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings")))
    from transformers import AutoConfig

    from fp8kit.quality import quiet

    try:
        with quiet():  # never the checkpoint's own code (auto_map): transformers would ask on the terminal to run it
            config = AutoConfig.from_pretrained(src, trust_remote_code=False)
        return bool(config.get_text_config().tie_word_embeddings)
    except Exception:  # noqa: BLE001 - a model_type this transformers lacks: assumed tied, which refuses --lm-head
        return True


def abandoned_warnings(abandoned: list[tuple[Path, int]]) -> list[str]:
    """The report's line for each partial folder of OUT that a killed run had left, and this one removed."""
    return [f"removed {folder.name} ({size / 2**30:.2f} GiB), left beside OUT by a conversion that was killed"
            for folder, size in abandoned]


def check_all_finite(tensors: dict[str, TensorInfo]) -> None:
    """Every float tensor read once, piece by piece: for schemes that load the model whole (tensor-static), whose
    quantization would otherwise turn one NaN into NaN scales and weights without a word."""
    for info in tensors.values():
        if info.dtype not in FLOAT_DTYPES:
            continue
        fd = os.open(info.path, os.O_RDONLY)
        try:
            for pos in range(0, info.nbytes, COPY_BYTES):
                buf = read_bytes(fd, info.start + pos, min(COPY_BYTES, info.nbytes - pos), info.path)
                _check_finite(torch.frombuffer(buf, dtype=DTYPES[info.dtype]), info)
        finally:
            os.close(fd)


def _check_finite(values: torch.Tensor, info: TensorInfo) -> None:
    if not bool(torch.isfinite(values).all()):
        raise Fp8kitError(f"{info.path}: tensor {info.name!r} contains NaN or Inf; fix the source weights")


class _Writer:
    """pwrite()s from a background thread, so that disk writes overlap reading and quantizing.

    The queue is short: at most `depth` chunks wait, which bounds the memory this adds."""

    def __init__(self, fd: int, depth: int = 2):
        self.fd = fd
        self.queue: queue.Queue = queue.Queue(depth)
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, name="fp8kit-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None:  # after an error the rest is drained unwritten
                try:
                    write_all(self.fd, *item)
                except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                    self.error = e

    def put(self, data, offset: int) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((data, offset))

    def close(self) -> None:
        """Wait for every write; raises the first write error."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        """Stop after the main thread failed: pending pieces are dropped, errors are not raised over its own."""
        self.error = self.error or Fp8kitError("aborted")
        self.queue.put(None)
        self.thread.join()


class _Inputs:
    """Source files opened as they are read, at most MAX_OPEN at once (the least recently read closed first): one
    descriptor per shard for the whole run made a checkpoint of ~1000 shards (Linux's default limit, 1024; macOS's,
    256) fail "Too many open files", reported as a write failure. Jobs run in the checkpoint's order, so a shard
    is seldom opened twice."""

    MAX_OPEN = 32

    def __init__(self):
        self.fds: OrderedDict[Path, int] = OrderedDict()

    def fd(self, path: Path) -> int:
        if path in self.fds:
            self.fds.move_to_end(path)
            return self.fds[path]
        if len(self.fds) >= self.MAX_OPEN:
            os.close(self.fds.popitem(last=False)[1])
        try:
            self.fds[path] = os.open(path, os.O_RDONLY)
        except OSError as e:  # not an OSError: the caller's handler would call it a write failure
            raise Fp8kitError(f"{path}: cannot open ({e.strerror}); check the file, or re-download it") from e
        return self.fds[path]

    def close(self):
        while self.fds:
            os.close(self.fds.popitem()[1])


def _copy(job: Job, inputs: _Inputs, out_file: _Writer, base: int, tick) -> None:
    info, out = job.info, job.outputs[0]
    for pos in range(0, info.nbytes, COPY_BYTES):
        n = min(COPY_BYTES, info.nbytes - pos)
        buf = read_bytes(inputs.fd(info.path), info.start + pos, n, info.path)
        if info.dtype in FLOAT_DTYPES:
            _check_finite(torch.frombuffer(buf, dtype=DTYPES[info.dtype]), info)
        out_file.put(buf, base + out.offset + pos)
        tick(n)


def _quantize(job: Job, inputs: _Inputs, out_file: _Writer, base: int, scheme: Scheme, device: torch.device, tick) -> None:
    info = job.info
    weight, scale_out = job.outputs
    scale_dtype = DTYPES[scale_out.dtype]
    rows, cols = info.shape
    row_bytes = cols * ITEMSIZE[info.dtype]
    step = max(scheme.row_multiple, CHUNK_BYTES // (cols * 4) // scheme.row_multiple * scheme.row_multiple)
    chunks = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]

    def load(r0: int, r1: int) -> torch.Tensor:
        buf = read_bytes(inputs.fd(info.path), info.start + r0 * row_bytes, (r1 - r0) * row_bytes, info.path)
        return to_tensor(buf, info.dtype, (r1 - r0, cols)).to(device)

    held = None
    scale = None
    if scheme.weight_strategy == "tensor":  # one scale: a first pass finds the global amax
        peak = None
        for r0, r1 in chunks:
            w = load(r0, r1)
            a = amax(w, scheme)
            _check_finite(a, info)
            peak = a if peak is None else torch.maximum(peak, a)
            held = w if len(chunks) == 1 else None
        scale = scale_from_amax(peak, scale_dtype)
        out_file.put(_as_bytes(scale), base + scale_out.offset)
    scale_row_bytes = ITEMSIZE[scale_out.dtype] * (scale_out.shape[1] if len(scale_out.shape) == 2 else 0)
    for r0, r1 in chunks:
        w = held if held is not None else load(r0, r1)
        if scale is None or scheme.weight_strategy != "tensor":
            a = amax(w, scheme)
            _check_finite(a, info)
            s = scale_from_amax(a, scale_dtype)
            out_file.put(_as_bytes(s), base + scale_out.offset + (r0 // scheme.row_multiple) * scale_row_bytes)
        else:
            s = scale
        q = quantize_with_scale(w, s, scheme)
        out_file.put(_as_bytes(q), base + weight.offset + r0 * cols)
        tick((r1 - r0) * row_bytes)


def _write_shard(path: Path, jobs: list[Job], inputs: _Inputs, scheme: Scheme, device: torch.device, tick) -> None:
    header = layout([t for job in jobs for t in job.outputs])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    writer = _Writer(fd)
    try:
        writer.put(header, 0)
        for job in jobs:
            if job.quantize:
                _quantize(job, inputs, writer, len(header), scheme, device, tick)
            else:
                _copy(job, inputs, writer, len(header), tick)
    except BaseException:
        writer.abort()
        raise
    else:
        writer.close()
    finally:
        os.close(fd)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _check_moe_layout(src_path: Path, spec: Scheme, fmt: str, quantized: list[str]) -> None:
    """vLLM's compressed-tensors MoE layers take per-tensor weights only with static per-tensor activations
    (vLLM 0.25 CompressedTensorsW8A8Fp8MoEMethod asserts on per-tensor weights with per-token activations as it builds
    the model; evals/results/vllm_load_moe_schemes_h100.json): such a checkpoint would be written and never served."""
    if spec.name != "tensor" or fmt != "compressed-tensors":
        return
    experts = [m for m in quantized if expert_layer(m)]
    if experts:
        raise Fp8kitError(f"{src_path}: --scheme tensor in the compressed-tensors format quantizes {len(experts)} "
                          f"expert weights (e.g. {experts[0]}) that vLLM's MoE layers cannot load with per-token "
                          f"activations; use --scheme dynamic or block, --scheme tensor --format fp8, or "
                          f"--scheme tensor-static; nothing was written")


def check_options(scheme: str, format: str = "compressed-tensors", ignore=(), lm_head: bool = False,
                  kv_cache: str | None = None, calibration: str | os.PathLike | None = None) -> None:
    """convert()'s options, checked without the source: also by `fp8kit publish`, for every variant of every plan
    entry before the first is converted."""
    if lm_head and scheme == "tensor-static":
        raise Fp8kitError("--lm-head is for --scheme dynamic or tensor: tensor-static calibrates the "
                          "decoder's Linear layers only and keeps lm_head in source precision; leave it out")
    if lm_head and format != "compressed-tensors":
        raise Fp8kitError("--lm-head is written in the compressed-tensors format only (vLLM's fp8 format has no FP8 "
                          "lm_head); leave --format out")
    if lm_head and scheme == "block":
        # vLLM's ParallelLMHead loads every parameter with a vocabulary dimension, the scale included, through
        # VocabParallelEmbedding.weight_loader, which asserts one row per token: 128x128 block scales fail there
        raise Fp8kitError("--lm-head takes --scheme dynamic or tensor: vLLM 0.25 loads an lm_head's scales with one "
                          "row per token, so a block lm_head does not load; leave --lm-head out or use dynamic")
    if kv_cache is not None and kv_cache not in KV_CACHE_DTYPES:
        raise Fp8kitError(f"--kv-cache {kv_cache!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if kv_cache and format != "compressed-tensors":
        raise Fp8kitError("--kv-cache fp8 is written in the compressed-tensors format only (vLLM turns on its FP8 "
                          "KV cache by itself only for compressed-tensors checkpoints)")
    for pattern in ignore:
        try:
            re.compile(pattern[3:] if pattern.startswith("re:") else pattern)
        except re.error as e:
            raise Fp8kitError(f"--ignore {pattern!r}: not a regular expression ({e})") from e
    if scheme == "tensor-static":
        if format != "compressed-tensors":
            raise Fp8kitError("--scheme tensor-static is written in the compressed-tensors format only")
        return
    if calibration is not None and not kv_cache:
        raise Fp8kitError("--calibration is for --scheme tensor-static or --kv-cache fp8; the other schemes need "
                          "no data")
    if scheme not in SCHEMES:
        raise Fp8kitError(f"--scheme {scheme!r}: expected one of {', '.join(SCHEMES)}, tensor-static")
    if format not in FORMATS:
        raise Fp8kitError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
    if format == "fp8" and scheme == "dynamic":
        raise Fp8kitError("--format fp8 has no per-channel layout; use --scheme block or tensor, or the "
                          "compressed-tensors format for dynamic")


def convert(src: str | os.PathLike, out: str | os.PathLike, scheme: str = "dynamic",
            format: str = "compressed-tensors", ignore: list[str] | tuple[str, ...] = (), device: str = "auto",
            max_shard_size: str | int = "5GB", overwrite: bool = False, progress: bool = False,
            calibration: str | os.PathLike | None = None, lm_head: bool = False,
            kv_cache: str | None = None) -> ConvertReport:
    """Convert a BF16/FP16/FP32 safetensors checkpoint (directory or Hub id) into an FP8 checkpoint at OUT.
    `lm_head=True` quantizes lm_head too (compressed-tensors; less weight memory in vLLM, at some cost in logit
    accuracy). `kv_cache="fp8"` adds calibrated FP8 KV-cache scales, which make vLLM serve with an FP8 KV cache
    (compressed-tensors; runs the whole model over `calibration` text, the shipped sample by default)."""
    start = time.perf_counter()
    check_options(scheme, format, ignore, lm_head, kv_cache, calibration)
    shard_bytes = parse_size(max_shard_size)
    dev = resolve_device(device)
    if scheme == "tensor-static":
        from fp8kit.converter.calibrated import convert_static

        with stdout_to_stderr():
            return convert_static(src, out, calibration, ignore, overwrite, kv_cache=kv_cache, device=device,
                                  max_shard_size=shard_bytes)
    spec = SCHEMES[scheme]
    out = check_out(out, overwrite)
    src_path = source.resolve(src).resolve()
    check_out(out, overwrite, src_path)
    config, tensors = read_source(src_path)
    if format == "fp8" and scheme == "block" and config.get("model_type") in FP8_BLOCK_RENAMED:
        raise Fp8kitError(f"{src_path / 'config.json'}: vLLM 0.25 cannot load a {config['model_type']} block FP8 "
                          f"checkpoint in the fp8 format (its loader renames weight_scale_inv to weight_scale, which "
                          f"block layers lack); use the compressed-tensors format: leave --format out")
    sel = select(tensors, spec, list(ignore), lm_head=lm_head, tied=lm_head and _tied(config, src_path), src=src_path)
    _check_moe_layout(src_path, spec, format, sel.quantize)
    jobs = _plan(tensors, set(sel.quantize), spec, format)
    shards = _shard(jobs, shard_bytes)
    files_out = len(shards) + (1 if kv_cache else 0)  # KV-cache scales: a shard of their own, last
    names = (["model.safetensors"] if files_out == 1 else
             [f"model-{i + 1:05d}-of-{files_out:05d}.safetensors" for i in range(files_out)])
    config["quantization_config"] = quantization_config(spec, format, sel.keep, lm_head=lm_head,
                                                        loaded=loaded_names(src_path, sel.keep))
    bytes_in = sum(info.nbytes for info in tensors.values())
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    kv_scales, warnings = {}, list(sel.warnings)
    if format == "fp8" and scheme == "tensor":
        # transformers 5.x reads quant_method fp8 as 128x128 blocks with `weight_scale_inv`: it skips this layout's
        # per-tensor `weight_scale` (vLLM's and SGLang's name) and runs the FP8 codes unscaled
        warnings.append("--format fp8 with tensor is read by vLLM and SGLang; transformers would ignore its scales "
                        "(use the compressed-tensors format to load it there)")
    if kv_cache:
        # in the weight scales' dtype
        kv_dtype = DTYPES[_scale_dtype(tensors[sel.quantize[0] + ".weight"].dtype, format)]
        kv_scales, calibrated_on = kv_cache_scales(src_path, calibration, dev, kv_dtype, tensors)
        config["quantization_config"]["kv_cache_scheme"] = kv_cache_scheme()
        warnings.append(f"FP8 KV-cache scales calibrated on {calibrated_on}")
    inputs = _Inputs()
    from tqdm.auto import tqdm

    bar = tqdm(total=bytes_in, unit="B", unit_scale=True, unit_divisor=1024, desc=f"fp8-convert {scheme}",
               disable=not progress, leave=False)
    abandoned, placed = [], []
    with whole_once_written(out, placed):  # an interrupt once OUT is in place says so
        try:
            with atomic_directory(out, overwrite, abandoned, placed) as partial:
                for name, shard in zip(names, shards):
                    try:
                        _write_shard(partial / name, shard, inputs, spec, dev, bar.update)
                    except OSError as e:
                        raise Fp8kitError(f"{out / name}: cannot write ({e.strerror}); free disk space or choose "
                                          f"another OUT") from e
                if kv_scales:  # measured after the weight shards were laid out, so not inside one
                    try:
                        save_small(kv_scales, partial / names[-1])
                    except OSError as e:
                        raise Fp8kitError(f"{out / names[-1]}: cannot write ({e.strerror or e}); free disk space or "
                                          f"choose another OUT") from e
                if len(names) > 1:
                    weight_map = {t.name: name for name, shard in zip(names, shards) for job in shard
                                  for t in job.outputs}
                    weight_map.update(dict.fromkeys(kv_scales, names[-1]))
                    total = (sum(t.nbytes for job in jobs for t in job.outputs)
                             + sum(t.nbytes for t in kv_scales.values()))
                    _write_json(partial / source.INDEX_NAME,
                                {"metadata": {"total_size": total}, "weight_map": weight_map})
                _write_json(partial / "config.json", config)
                source.copy_extra_files(src_path, partial)
        finally:
            bar.close()
            inputs.close()

        files = source.folder_files(out)
        warnings += abandoned_warnings(abandoned)
        return ConvertReport(
            src=str(src), out=str(out), scheme=scheme, format=format, device=str(dev),
            # ignored: by checkpoint name (the config adds loaded ones)
            quantized=sel.quantize, ignored=ignore_list(sel.keep, lm_head), bytes_in=bytes_in,
            bytes_out=sum((out / f).stat().st_size for f in files), seconds=time.perf_counter() - start,
            peak_rss_bytes=peak_rss_bytes(),
            peak_gpu_bytes=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            files=files, warnings=warnings, unmatched_ignore=sel.unmatched_ignore)
