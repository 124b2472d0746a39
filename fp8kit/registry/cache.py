"""`ensure()`: a local FP8 copy of a model, downloaded or converted once and reused.

Conversions are cached under FP8KIT_CACHE (default ~/.cache/fp8kit) as
`{org}--{name}/{source commit}/{scheme}-{format}-fp8kit{version}/`. A file lock makes concurrent callers
convert once (the others wait); an entry counts only once its completion marker is written, and is
rebuilt when its files no longer match the marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from filelock import FileLock

from fp8kit.converter import source
from fp8kit.converter.safetensors_io import read_header
from fp8kit.errors import Fp8kitError
from fp8kit.registry.resolution import entry_name, resolve

MARKER = "fp8kit-entry.json"
LOG = "conversions.log"


def cache_root() -> Path:
    if os.environ.get("FP8KIT_CACHE"):
        return Path(os.environ["FP8KIT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp8kit"


def _usable_root(consequence: str) -> Path:
    """The cache root, refused in one line when it is a file."""
    root = cache_root()
    if root.exists() and not root.is_dir():
        fix = ("set FP8KIT_CACHE to the cache folder, or unset it" if os.environ.get("FP8KIT_CACHE")
               else "move that file away, or set FP8KIT_CACHE to a folder")
        raise Fp8kitError(f"cache {root} is a file, not a folder: {fix}; {consequence}")
    return root


def model_dir(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():  # a local checkpoint: keyed by its absolute path
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return cache_root() / f"local--{path.resolve().name}-{digest}"
    # a pinned revision is a commit folder inside the repo's folder, as the layout says: not a folder of its own
    return cache_root() / name.partition("@")[0].replace("/", "--")


def _source_commit(src: Path) -> str:
    """The Hub commit of a snapshot in the HF cache; for a local directory, a digest of its files' names,
    sizes and modification times (a changed checkpoint gets a new entry). Only a snapshot inside the HF cache
    is keyed by its folder name: a checkpoint of one's own in a folder called `snapshots` changes in place."""
    from huggingface_hub import constants

    hub_cache = Path(constants.HF_HUB_CACHE).expanduser().resolve()
    real = src.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--") and \
            real.parent.parent.parent == hub_cache:
        return real.name
    h = hashlib.sha256()
    templates = src / source.CHAT_TEMPLATES_DIR  # copied into the conversion too
    for p in sorted(src.iterdir()) + (sorted(templates.iterdir()) if templates.is_dir() else []):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(src).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return "local-" + h.hexdigest()[:16]


def known_commit(name: str) -> str | None:
    """The source commit, where it is known without the network: a local directory's digest, or the
    HF cache's record of the Hub repo's main branch."""
    path = Path(name).expanduser()
    if path.is_dir():
        return _source_commit(path)
    from huggingface_hub import constants

    repo_id, _, revision = name.partition("@")
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    if re.fullmatch(r"[0-9a-f]{7,39}", revision) and snapshots.is_dir():  # a short commit hash, if downloaded
        found = [p.name for p in snapshots.iterdir() if p.name.startswith(revision)]
        if len(found) == 1:
            return found[0]
    ref = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / (revision or "main")
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def verify(entry: Path) -> bool:
    """The marker exists and every file it lists is there with its size and a readable safetensors header."""
    try:
        files = json.loads((entry / MARKER).read_text())["files"]
        for name, size in files.items():
            path = entry / name
            if path.stat().st_size != size:
                return False
            if name.endswith(".safetensors"):
                read_header(path)
        return True
    except (OSError, KeyError, TypeError, ValueError, Fp8kitError):
        return False


def ensure(name: str, scheme: str = "auto") -> Path:
    """A local directory holding `name` in FP8: the catalog's upload (downloaded with huggingface_hub, or
    from the HF cache offline), else our conversion, made once and cached."""
    answer = resolve(name, scheme)
    if answer.repo_id is not None:
        return source.resolve(answer.repo_id)
    return cached_conversion(name, answer.scheme)


def cached_conversion(name: str, scheme: str, fmt: str = "compressed-tensors") -> Path:
    """Our conversion of `name` (Hub id or local directory), made once per source commit and reused."""
    _usable_root("nothing was converted")
    src = source.resolve(name)
    entry = model_dir(name) / _source_commit(src) / entry_name(scheme, fmt)
    if verify(entry):  # complete: used as it is, also from a cache this user cannot write
        return entry
    # filelock (huggingface_hub's own dependency): flock on POSIX, msvcrt locking on Windows
    lock = FileLock(entry.parent / (entry.name + ".lock"))
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()  # a second process waits here while the first converts
    except OSError as e:
        fix = "set FP8KIT_CACHE to a folder you can write" if os.environ.get("FP8KIT_CACHE") else \
            "make it writable, or set FP8KIT_CACHE to a folder you can write"
        raise Fp8kitError(f"cache {cache_root()}: cannot write there ({e.strerror or e}); {fix}; nothing was "
                          f"converted") from e
    try:
        if verify(entry):  # another process finished it while this one waited
            return entry
        remove_unfinished(entry)  # left by a conversion killed outright: no other process holds this lock
        from fp8kit.converter import convert

        report = convert(src, entry, scheme=scheme, format=fmt, overwrite=True)
        # A local checkpoint is recorded by its absolute path: `cache rm` of the same relative name in another
        # folder must not match it.
        local = Path(name).expanduser()
        marker = {"name": str(local.resolve()) if local.is_dir() else name, "source": str(src), "scheme": scheme,
                  "format": fmt, "files": {f: (entry / f).stat().st_size for f in source.folder_files(entry)},
                  "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": report.seconds}
        tmp = entry / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker, indent=2) + "\n")
        tmp.rename(entry / MARKER)
        with open(cache_root() / LOG, "a") as log:
            log.write(f"{marker['converted_at']} {marker['name']} {scheme} -> {entry}\n")
    finally:
        lock.release()
    return entry


def _unfinished_of(entry: Path) -> list[Path]:
    """The converter's temporary folders of `entry` (fp8kit.converter.output.atomic_directory's names)."""
    return sorted(p for pattern in (f".{entry.name}.partial-*", f".{entry.name}.old-*")
                  for p in entry.parent.glob(pattern) if p.is_dir() and not p.is_symlink())


def remove_unfinished(entry: Path) -> None:
    """Remove what a conversion of `entry` that was killed outright (SIGKILL, power loss) left; the caller holds
    the entry's lock, so no live conversion writes there. Ctrl-C and SIGTERM clean up after themselves."""
    for folder in _unfinished_of(entry):
        shutil.rmtree(folder, ignore_errors=True)


def list_unfinished() -> list[dict]:
    """Temporary folders of conversions in progress or killed outright: shown by `cache list`, removed by the next
    conversion of that entry or by `cache rm`."""
    root = cache_root()
    if not root.is_dir():
        return []
    rows = []
    for folder in sorted(root.glob("*/*/.*")):
        if folder.is_dir() and not folder.is_symlink() and (".partial-" in folder.name or ".old-" in folder.name):
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
            rows.append({"path": str(folder), "bytes": size})
    return rows


def list_entries() -> list[dict]:
    root = cache_root()
    rows = []
    for marker in sorted(root.glob(f"*/*/*/{MARKER}")):
        entry = marker.parent
        size = sum((entry / f).stat().st_size for f in source.folder_files(entry))
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            info = {}
        if not isinstance(info, dict):
            info = {}
        rows.append({"name": info.get("name"), "scheme": info.get("scheme"), "format": info.get("format"),
                     "commit": entry.parent.name, "path": str(entry), "bytes": size, "ok": verify(entry)})
    return rows


def remove(name: str | None = None) -> list[Path]:
    """Delete the cached conversions of `name` (all of them when None). Only folders fp8kit made: ones that
    hold a conversion marker or lock. A name also matches the entries whose marker records it, so a local
    checkpoint that has since moved or been deleted can still be removed by the name `cache list` shows."""
    root = _usable_root("nothing was removed")
    ours = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
            and (any(p.glob(f"*/*/{MARKER}")) or any(p.glob("*/*.lock")))] if root.exists() else []
    if name:
        local = Path(name).expanduser()
        # an existing folder means that checkpoint (recorded by its absolute path); otherwise the name as recorded
        recorded_as = str(local.resolve()) if local.is_dir() else name
        if "@" in name and not local.is_dir():  # a pinned revision: its own entries, not the repo's other commits
            return _remove_entries([Path(row["path"]) for row in list_entries() if row["name"] == name])
        recorded = {Path(row["path"]).parent.parent for row in list_entries() if row["name"] == recorded_as}
        targets = [p for p in ours if p == model_dir(name) or p in recorded]
    else:
        targets = ours
    for target in targets:
        shutil.rmtree(target)
    if name and model_dir(name).is_symlink():  # a model folder linked from elsewhere: the link goes, not its target
        model_dir(name).unlink()
        targets.append(model_dir(name))
    return targets


def _remove_entries(entries: list[Path]) -> list[Path]:
    """Delete these entries with their locks and unfinished folders, then their commit and model folders once
    nothing else is left in them."""
    for entry in entries:
        for unfinished in _unfinished_of(entry):
            shutil.rmtree(unfinished, ignore_errors=True)
        shutil.rmtree(entry)
        (entry.parent / (entry.name + ".lock")).unlink(missing_ok=True)
    for folder in {e.parent for e in entries} | {e.parent.parent for e in entries}:
        for f in sorted([folder, *folder.glob("*")], key=lambda p: -len(p.parts)):  # commit folders first
            try:
                f.rmdir()
            except OSError:
                pass
    return entries
