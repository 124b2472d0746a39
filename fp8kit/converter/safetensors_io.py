"""Safetensors files read and written piece by piece, with positional I/O.

The format is an 8-byte little-endian header length, a JSON header (dtype, shape, data_offsets per
tensor) and the tensor bytes. Because the output header depends only on shapes and dtypes, a shard's
layout is fixed before any data exists; every piece is then pwrite()n at its final offset. Reading uses
pread() rather than a memory map: mapped pages stay in the process's resident set until the map is
dropped, which would make peak RSS grow with the shard size.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8kit.errors import Fp8kitError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
            "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "F4": 1}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes live in a source file."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    path: Path
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check one file's header against its size; tensors by name, and the metadata."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise Fp8kitError(f"{path}: not a safetensors file (shorter than 8 bytes); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise Fp8kitError(f"{path}: corrupt or truncated safetensors header; re-download the file")
            raw = f.read(n)
    except OSError as e:
        raise Fp8kitError(f"{path}: cannot read ({e.strerror}); check the path and permissions") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: [[[...]]] nested deep
        raise Fp8kitError(f"{path}: corrupt safetensors header ({type(e).__name__}); re-download the file") from e
    if not isinstance(header, dict):
        raise Fp8kitError(f"{path}: corrupt safetensors header; re-download the file")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        # safetensors reads it as a map of strings to strings, and refuses the file otherwise
        raise Fp8kitError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings); "
                          f"re-download the file")
    base = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = (isinstance(dtype, str) and all(_is_count(d) for d in shape) and _is_count(begin)
                  and _is_count(end) and begin <= end)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise Fp8kitError(f"{path}: tensor {name!r} has a malformed header entry; re-download the file")
        if dtype not in ITEMSIZE:
            raise Fp8kitError(f"{path}: tensor {name!r} has unknown dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * ITEMSIZE[dtype]:
            raise Fp8kitError(f"{path}: tensor {name!r} has a size that does not match its shape; re-download the file")
        if base + end > size:
            raise Fp8kitError(f"{path}: truncated (tensor {name!r} ends past the end of the file); re-download the file")
        tensors[name] = TensorInfo(name, dtype, shape, path, base + begin, end - begin)
    # Like safetensors itself: the tensors must tile the data section exactly, without gaps or overlaps.
    position = base
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.nbytes)):
        if info.start != position:
            raise Fp8kitError(f"{path}: corrupt header (tensor {info.name!r} overlaps another or leaves a gap); "
                              f"re-download the file")
        position += info.nbytes
    if position != size:
        raise Fp8kitError(f"{path}: corrupt or truncated (the data section is {size - base} bytes, the header "
                          f"describes {position - base}); re-download the file")
    return tensors, metadata


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


def read_bytes(fd: int, start: int, nbytes: int, path: Path) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        try:
            got = os.preadv(fd, [view[done:]], start + done)
        except OSError as e:
            raise Fp8kitError(f"{path}: cannot read ({e.strerror})") from e
        if got == 0:
            raise Fp8kitError(f"{path}: truncated while reading; re-download the file")
        done += got
    return buf


def to_tensor(buf: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not buf:
        return torch.empty(shape, dtype=DTYPES[dtype])
    return torch.frombuffer(buf, dtype=DTYPES[dtype]).reshape(shape)


@dataclass
class OutTensor:
    """One tensor of an output shard: its layout, and the job that produces its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0  # relative to the data section

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def layout(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> bytes:
    """Assign data offsets (widest dtype first, as safetensors does, so every tensor is aligned)
    and return the full header, padded with spaces to 8 bytes. The metadata keys are sorted: the same
    tensors give the same bytes (safetensors' own writer orders metadata as a hash map, differently per run)."""
    order = sorted(tensors, key=lambda t: (-ITEMSIZE[t.dtype], t.name))
    offset = 0
    header: dict[str, object] = {"__metadata__": dict(sorted({"format": "pt", **(metadata or {})}.items()))}
    for t in order:
        t.offset = offset
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def save_small(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Small tensors (an adapter) written whole into `path`, byte for byte reproducible."""
    names = {v: k for k, v in DTYPES.items()}
    outs = [OutTensor(name, names[t.dtype], tuple(t.shape)) for name, t in tensors.items()]
    header = layout(outs, metadata)
    with open(path, "wb") as f:
        f.write(header)
        for out in sorted(outs, key=lambda o: o.offset):
            f.write(tensors[out.name].detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def write_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
