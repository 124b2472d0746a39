"""Output directories that appear whole or not at all.

Everything is written into a fresh private folder beside OUT (same filesystem, so the final rename is
atomic) and renamed into place at the end; on any failure, Ctrl-C included, only that folder is removed.
Nothing the user owns is ever deleted in its place, and an existing OUT is replaced only when asked.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from fp8kit.errors import Fp8kitError


def check_out(out: str | Path, overwrite: bool, src: Path | None = None) -> Path:
    out = Path(out).expanduser().resolve()
    if not out.name:
        raise Fp8kitError(f"{out}: OUT must name a new directory")
    if out.exists() and not overwrite:
        raise Fp8kitError(f"{out}: already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise Fp8kitError(f"{out}: exists and is not a directory; remove it or choose another OUT")
    if src is not None:
        src = src.resolve()
        if out == src or src in out.parents or out in src.parents:
            raise Fp8kitError(f"{out}: OUT must not be SRC, lie inside it, or contain it")
    return out


@contextlib.contextmanager
def atomic_directory(out: Path, overwrite: bool):
    """Yields the folder to fill; on a clean exit it becomes OUT (replacing OUT only with `overwrite`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield partial
        if out.exists() and overwrite:
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old)  # onto the empty folder just made
            partial.rename(out)
            shutil.rmtree(old)
        else:
            partial.rename(out)  # fails if OUT appeared meanwhile: never replaced without --overwrite
    except OSError as e:
        raise Fp8kitError(f"{out}: cannot write ({e.strerror}); free disk space or choose another OUT") from e
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
