"""`ensure()`: a local FP8 copy of a model, downloaded or converted once and reused.

Conversions are cached under FP8KIT_CACHE (default ~/.cache/fp8kit) as
`{org}--{name}/{source commit}/{scheme}-{format}-fp8kit{version}/`. A file lock makes concurrent callers
convert once (the others wait); an entry counts only once its completion marker is written, and is
rebuilt when its files no longer match the marker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from filelock import FileLock, Timeout

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
    short = source.snapshot_commit(repo_id, revision)  # a short commit hash, if downloaded
    if short:
        return short
    ref = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / (revision or "main")
    try:
        return ref.read_text().strip() or None
    except OSError:
        return None


def verify(entry: Path) -> bool:
    """The marker exists and every file it lists is there with its size and a readable safetensors header."""
    try:
        files = json.loads((entry / MARKER).read_text())["files"]
        if not isinstance(files, dict):  # edited by hand: rebuilt like a missing file
            return False
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
    return ensure_resolved(resolve(name, scheme))


def ensure_resolved(answer) -> Path:
    """ensure() for a registry answer already in hand: load_model reads the answer first, so that an upload it
    refuses (tensor-static, for vLLM rollouts) is neither downloaded nor resolved twice."""
    if answer.repo_id is not None:
        path = source.resolve(answer.repo_id)
        check_upload(path, answer)
        return path
    return cached_conversion(answer.name, answer.scheme)


def check_upload(path: Path, answer) -> None:
    """The upload holds what its registry entry says: a block upload listed as dynamic, or one without any
    quantization_config, would be handed out as something it is not."""
    from fp8kit.quality import WEIGHT_SCALES, scheme_of, static_activations

    where = "the shipped catalog" if answer.source == "catalog" else "the registry overlay (FP8KIT_REGISTRY)"
    listed = f"{answer.variant_scheme} ({answer.format})"
    try:
        qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError) as e:
        raise Fp8kitError(f"{answer.repo_id}: its config.json cannot be read ({e}); the upload is broken") from e
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if not isinstance(qc, dict):
        found = "no quantization_config"
    elif method == "torchao":
        found = "torchao (torchao)"
    else:
        try:
            scheme = scheme_of(qc)
            # static activation scales (what `fp8kit publish --scheme tensor-static` uploads) are not `tensor`: the
            # GRPO runtime, which asks for dynamic or tensor, refuses them; on channel or block weights (vLLM serves
            # those too) they are no scheme a registry entry can name, so no request gets them
            if static_activations(qc):
                scheme = ("tensor-static" if scheme == "tensor"
                          else f"{WEIGHT_SCALES[scheme]} weights with static activation scales")
            found = f"{scheme} ({method})"
        except Fp8kitError:
            found = f"a quantization_config fp8kit does not read (quant_method {method!r})"
    if found != listed:
        raise Fp8kitError(f"{answer.repo_id}: {where} lists it as {listed}, but its config.json declares {found}; "
                          f"fix or remove that entry, or convert the base model yourself (fp8kit resolve prints how)")


def cached_conversion(name: str, scheme: str, fmt: str = "compressed-tensors") -> Path:
    """Our conversion of `name` (Hub id or local directory), made once per source commit and reused."""
    _usable_root("nothing was converted")
    src = source.resolve(name)
    entry = model_dir(name) / _source_commit(src) / entry_name(scheme, fmt)
    if verify(entry):  # complete: used as it is, also from a cache this user cannot write
        _tidy(entry)
        return entry
    if scheme == "tensor-static":  # calibrates on text: refused before any folder or lock is made for it
        from fp8kit.converter.calibration import calibration_tokenizer

        calibration_tokenizer(src, "--scheme tensor-static")
    # filelock (huggingface_hub's own dependency): flock on POSIX, msvcrt locking on Windows
    lock = FileLock(entry.parent / (entry.name + ".lock"))
    try:
        for attempt in range(3):
            entry.parent.mkdir(parents=True, exist_ok=True)
            try:
                lock.acquire()  # a second process waits here while the first converts
                break
            except FileNotFoundError:  # `cache rm` removed the folder while this waited: made again
                if attempt == 2:
                    raise
    except OSError as e:
        fix = "set FP8KIT_CACHE to a folder you can write" if os.environ.get("FP8KIT_CACHE") else \
            "make it writable, or set FP8KIT_CACHE to a folder you can write"
        raise Fp8kitError(f"cache {cache_root()}: cannot write there ({e.strerror or e}); {fix}; nothing was "
                          f"converted") from e
    try:
        _record_local_name(name, entry.parent.parent)
        if verify(entry):  # another process finished it while this one waited
            return entry
        if _adopt_legacy(name, entry):  # made before pinned names moved into the repo's folder
            return entry
        remove_unfinished(entry)  # left by a conversion killed outright: no other process holds this lock
        from fp8kit.converter import convert
        from fp8kit.converter.output import InterruptedAfterWriting, interrupts_deferred

        started = time.perf_counter()
        try:
            report = convert(src, entry, scheme=scheme, format=fmt, overwrite=True)
        except InterruptedAfterWriting as interrupted:  # the entry is whole: recorded, so the next ensure() uses it
            # a second interrupt meanwhile (the marker is a stat of each file) neither stops it nor replaces this one
            with contextlib.suppress(KeyboardInterrupt), interrupts_deferred():
                _write_marker(entry, name, src, scheme, fmt, time.perf_counter() - started)
            raise interrupted
        _write_marker(entry, name, src, scheme, fmt, report.seconds)
    finally:
        lock.release()
    return entry


SOURCE_NAME = "fp8kit-source.json"


def _record_local_name(name: str, model: Path) -> None:
    """A local checkpoint's absolute path, kept in its model folder before the first conversion: `cache list` names
    a conversion killed outright by it (no completion marker beside it records it)."""
    local = Path(name).expanduser()
    if not local.is_dir() or (model / SOURCE_NAME).exists():
        return
    tmp = model / f".{SOURCE_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"name": str(local.resolve())}) + "\n")
    tmp.replace(model / SOURCE_NAME)


def _recorded_name(file: Path) -> str | None:
    """The NAME a model folder's source file or an entry's marker records, if it is readable."""
    try:
        info = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return info.get("name") if isinstance(info, dict) and isinstance(info.get("name"), str) else None


def _write_marker(entry: Path, name: str, src: Path, scheme: str, fmt: str, seconds: float) -> None:
    """The completion marker (written last, by rename) and the conversions log line."""
    # A local checkpoint is recorded by its absolute path: `cache rm` of the same relative name in another
    # folder must not match it.
    local = Path(name).expanduser()
    marker = {"name": str(local.resolve()) if local.is_dir() else name, "source": str(src), "scheme": scheme,
              "format": fmt, "files": {f: (entry / f).stat().st_size for f in source.folder_files(entry)},
              "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": seconds}
    tmp = entry / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    tmp.rename(entry / MARKER)
    with open(cache_root() / LOG, "a") as log:
        log.write(f"{marker['converted_at']} {marker['name']} {scheme} -> {entry}\n")


def _legacy_model_dir(name: str) -> Path | None:
    """Where earlier fp8kit kept a pinned name, a folder of its own: `{org}--{name}@{revision}`."""
    if "@" not in name or Path(name).expanduser().is_dir():
        return None
    return cache_root() / name.replace("/", "--")


def _adopt_legacy(name: str, entry: Path) -> bool:
    """Move a complete entry of the old pinned layout (`org--name@rev/<commit>/<entry>`) to `entry`; the caller
    holds `entry`'s lock. The legacy folders go once empty."""
    legacy_model = _legacy_model_dir(name)
    if legacy_model is None or legacy_model.is_symlink():
        return False
    legacy = legacy_model / entry.parent.name / entry.name
    if legacy.parent.is_symlink() or legacy.is_symlink() or not verify(legacy):
        return False
    if entry.exists():  # an incomplete entry of the new layout: the complete one replaces it
        shutil.rmtree(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    legacy.rename(entry)
    (legacy.parent / (legacy.name + ".lock")).unlink(missing_ok=True)
    for folder in (legacy.parent, legacy_model):
        try:
            folder.rmdir()
        except OSError:
            pass
    return True


def entry_lock(out: str | Path, name: str) -> FileLock | None:
    """The lock `ensure()` takes for a cache entry, when `out` lies inside the cache (an `fp8-convert NAME OUT` into
    the cache, as `fp8kit resolve` prints it); None elsewhere. NAME is resolved first, so that one which cannot be had
    (offline, a typo) leaves no folder or lock file in the cache; and OUT must lie in the folder of NAME's commit,
    the only one ensure() looks in: a conversion anywhere else in the cache would never be used, only kept."""
    # inside the cache as spelled (a model folder linked to another disk) or once resolved (a link to the entry),
    # and compared resolved, as check_out resolves OUT
    spelled, out = Path(out).expanduser().absolute(), Path(out).expanduser().resolve()
    root = cache_root().expanduser().absolute()
    if not any(path != folder and folder in path.parents for path, folder in ((spelled, root), (out, root.resolve()))):
        return None
    commit = (model_dir(name) / _source_commit(source.resolve(name))).expanduser().resolve()
    # the entry's name, whose lock ensure() takes: as spelled in its commit folder (the entry itself may link to
    # another disk), or the name OUT resolves to there (a link to it from elsewhere), an entry's name first (a link
    # of another name beside the entry)
    names = [n for n, here in ((spelled.name, spelled.parent.resolve() == commit), (out.name, out.parent == commit))
             if here]
    entry = next((n for n in names if _ENTRY.fullmatch(n)), names[0] if names else None)
    if entry is None:
        inside = spelled if root in spelled.parents else out
        raise Fp8kitError(f"{inside}: inside the fp8kit cache, but {name} is cached in {commit} (its source commit), "
                          f"the only folder ensure() looks in; convert into that folder or outside the cache; nothing "
                          f"was converted")
    commit.mkdir(parents=True, exist_ok=True)
    _record_local_name(name, commit.parent)  # `cache list` names a killed conversion by it, `cache rm` takes it
    return FileLock(commit / (entry + ".lock"))


def record_conversion(name: str, out: str | Path, scheme: str, fmt: str, seconds: float) -> bool:
    """After `fp8-convert NAME OUT` made exactly the entry `ensure(NAME)` would (OUT is that entry's folder, default
    options), write its completion marker so that ensure() uses it; the caller holds the entry's lock."""
    out = Path(out).expanduser().resolve()
    try:
        src = source.resolve(name)
        expected = model_dir(name) / _source_commit(src) / entry_name(scheme, fmt)
    except (Fp8kitError, OSError):
        return False
    if expected.expanduser().resolve() != out or not out.is_dir():
        return False
    _write_marker(out, name, src, scheme, fmt, seconds)
    return True


_UNFINISHED = re.compile(r"\.(?P<entry>.+)\.(?:partial|old)-[^/]*")
_ENTRY = re.compile(r"(?P<scheme>.+?)-(?P<format>compressed-tensors|fp8)-fp8kit.*")


def _unfinished_of(entry: Path) -> list[Path]:
    """The converter's temporary folders of `entry` (fp8kit.converter.output.atomic_directory's names) that no live
    conversion is filling: the entry's lock does not cover an `fp8-convert` whose OUT names the entry through a
    symlink or another mount, but the lock its writer holds inside the folder does."""
    from fp8kit.converter.output import writer_alive

    return [p for p in sorted(entry.parent.glob(".*")) if (m := _UNFINISHED.fullmatch(p.name))
            and m["entry"] == entry.name and p.is_dir() and not p.is_symlink() and not writer_alive(p)]


def remove_unfinished(entry: Path) -> None:
    """Remove what a conversion of `entry` that was killed outright (SIGKILL, power loss) left; the caller holds
    the entry's lock, so no live conversion writes there. Ctrl-C and SIGTERM clean up after themselves."""
    for folder in _unfinished_of(entry):
        shutil.rmtree(folder, ignore_errors=True)


def _tidy(entry: Path) -> None:
    """A complete entry's leftovers of a conversion killed outright (one into the cache by `fp8-convert`, which writes
    no marker until it finishes): removed under the entry's lock when no conversion holds it, else left for later."""
    if not _unfinished_of(entry):
        return
    lock = FileLock(entry.parent / (entry.name + ".lock"))
    try:
        lock.acquire(timeout=0)
    except (Timeout, OSError):  # a conversion is running, or this user cannot write the cache
        return
    try:
        remove_unfinished(entry)
    finally:
        lock.release()


def _size(files) -> int:
    """Bytes of these files; a file a running conversion renames or removes meanwhile counts 0."""
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total


def _unfinished_name(model: Path, commit: Path) -> str | None:
    """The NAME `cache rm` takes for an unfinished folder in `model/commit`: `org/name@commit` for a Hub repo (the
    legacy `org--name@rev` folder: `org/name@rev`); a local checkpoint's path as a finished entry beside it
    records it, else None."""
    if model.name.startswith("local--"):
        return next(filter(None, map(_recorded_name, [model / SOURCE_NAME, *sorted(model.glob(f"*/*/{MARKER}"))])),
                    None)
    org, sep, repo = model.name.partition("--")
    if not sep:
        return None
    return f"{org}/{repo}" if "@" in repo else f"{org}/{repo}@{commit.name}"


def list_unfinished() -> list[dict]:
    """Temporary folders of conversions in progress or killed outright: shown by `cache list`, removed by the next
    conversion of that entry or by `cache rm` (of the NAME given here). A folder that a conversion renames or
    removes while this runs is left out."""
    root = cache_root()
    if not root.is_dir():
        return []
    rows = []
    for folder in sorted(root.glob("*/*/.*")):
        m = _UNFINISHED.fullmatch(folder.name)
        if not m:
            continue
        try:
            if not folder.is_dir() or folder.is_symlink():
                continue
            size = _size(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
        except OSError:  # renamed or removed by its conversion meanwhile
            continue
        if not folder.is_dir():
            continue
        kind = _ENTRY.fullmatch(m["entry"])
        rows.append({"name": _unfinished_name(folder.parent.parent, folder.parent),
                     "scheme": kind["scheme"] if kind else None, "format": kind["format"] if kind else None,
                     "commit": folder.parent.name, "path": str(folder), "bytes": size, "ok": False,
                     "status": "unfinished"})
    return rows


def list_entries() -> list[dict]:
    root = _usable_root("nothing is listed")
    rows = []
    for marker in sorted(root.glob(f"*/*/*/{MARKER}")):
        entry = marker.parent
        try:
            size = _size(entry / f for f in source.folder_files(entry))
        except OSError:  # replaced (overwritten) or removed by a conversion meanwhile
            continue
        try:
            info = json.loads(marker.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            info = {}
        if not isinstance(info, dict):
            info = {}
        # a marker edited by hand: a field that is not a string is shown as unknown, not printed as a traceback
        info = {k: v for k, v in info.items() if isinstance(v, str)}
        rows.append({"name": info.get("name"), "scheme": info.get("scheme"), "format": info.get("format"),
                     "commit": entry.parent.name, "path": str(entry), "bytes": size, "ok": verify(entry)})
    return rows


def remove(name: str | None = None) -> list[Path]:
    """Delete the cached conversions of `name` (all of them when None). Only folders fp8kit made: ones that
    hold a conversion marker or lock. A name also matches the entries whose marker records it, so a local
    checkpoint that has since moved or been deleted can still be removed by the name `cache list` shows."""
    root = _usable_root("nothing was removed")
    ours = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
            and (any(p.glob(f"*/*/{MARKER}")) or any(p.glob(f"*/{ENTRY_LOCKS}")))] if root.exists() else []
    if name:
        local = Path(name).expanduser()
        # an existing folder means that checkpoint (recorded by its absolute path); otherwise the name as recorded
        recorded_as = str(local.resolve()) if local.is_dir() else name
        if "@" in name and not local.is_dir():  # a pinned revision: its own entries, not the repo's other commits
            # those recorded under this name, and those in its commit's folder, made under another name of that commit
            # (the unpinned name, another branch) but the same weights
            commit = known_commit(name)
            here = model_dir(name) / commit if commit else None
            entries = [Path(row["path"]) for row in list_entries()
                       if row["name"] == name or Path(row["path"]).parent == here]
            # never through a link: like an unpinned rm, what a linked folder points to is not ours to delete
            entries = [e for e in entries if not (e.is_symlink() or e.parent.is_symlink()
                                                  or e.parent.parent.is_symlink())]
            unfinished = _remove_unfinished_of_revision(name, {e.parent for e in entries})
            removed, busy = _remove_entries(entries)
            _refuse_busy(busy, unfinished + removed)
            return unfinished + removed
        recorded = {Path(row["path"]).parent.parent for row in list_entries() if row["name"] == recorded_as}
        # a local checkpoint whose only conversion was killed (no marker records it) is named by its source file
        recorded |= {p for p in ours if _recorded_name(p / SOURCE_NAME) == recorded_as}
        targets = [p for p in ours if p == model_dir(name) or p in recorded]
    else:
        targets = ours
    busy = [target for target in targets if not _remove_unlocked(target)]
    removed = [target for target in targets if target not in busy]
    if name and model_dir(name).is_symlink():  # a model folder linked from elsewhere: the link goes, not its target
        model_dir(name).unlink()
        removed.append(model_dir(name))
    _refuse_busy(busy, removed)
    return removed


def _refuse_busy(busy: list[Path], removed: list[Path]) -> None:
    """A folder left because a conversion holds its entry lock: one error line, after the others were removed."""
    if busy:
        done = f"; removed {len(removed)} other folder(s)" if removed else ""
        raise Fp8kitError(f"{busy[0]}: a conversion is running there (it holds its entry's lock or its folder's, or "
                          f"its folder was made where no lock can be had: one a killed run left so stays for you to "
                          f"delete); run the same `cache rm` again once it has finished{done}")


ENTRY_LOCKS = "*-fp8kit*.lock"  # `{entry_name}.lock`, as cached_conversion() and entry_lock() name them


def _delete(folder: Path) -> None:
    """rmtree, its failure one line naming the file: a file that cannot be deleted (read-only mount, immutable
    flag) stopped `cache rm` with a traceback after the marker was gone, so that later `cache rm`s no longer
    recognised the folder as the cache's."""
    for _ in range(3):
        try:
            shutil.rmtree(folder)
            return
        except FileNotFoundError:  # files removed meanwhile by another `cache rm`: done once the folder is gone
            if not folder.exists():
                return
        except OSError as e:
            raise Fp8kitError(f"{e.filename or folder}: cannot delete ({e.strerror or e}); make it deletable, then "
                              f"delete {folder} by hand") from e
    try:
        shutil.rmtree(folder)
    except OSError as e:
        raise Fp8kitError(f"{e.filename or folder}: cannot delete ({e.strerror or e}); make it deletable, then delete "
                          f"{folder} by hand") from e


def _remove_unlocked(target: Path) -> bool:
    """Delete a model folder while holding every entry lock in it; False (nothing deleted) when a conversion holds
    one, as the pinned form's removal of unfinished folders does."""
    from fp8kit.converter.output import writer_alive

    held = []
    try:
        for path in sorted(target.glob(f"*/{ENTRY_LOCKS}")):
            lock = FileLock(path)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                return False
            held.append(lock)
        # a conversion whose OUT names an entry through a symlink holds no entry lock, only its folder's
        if any(writer_alive(p) for p in target.glob("*/.*") if _UNFINISHED.fullmatch(p.name) and p.is_dir()):
            return False
        _delete(target)
        return True
    finally:
        for lock in held:
            lock.release()


def _remove_unfinished_of_revision(name: str, commits: set[Path]) -> list[Path]:
    """Unfinished folders of a pinned name: in its commit's folder (the commit as the HF cache knows it, and those of
    its finished entries) and in the legacy `org--name@rev` folder. Each is removed under its entry's lock, taken
    without waiting: one whose lock is held belongs to a conversion in progress and stays."""
    from fp8kit.converter.output import writer_alive

    commit = known_commit(name)
    if commit:
        commits.add(model_dir(name) / commit)
    legacy = _legacy_model_dir(name)
    if legacy is not None and legacy.is_dir() and not legacy.is_symlink():
        commits.update(p for p in legacy.iterdir() if p.is_dir())
    removed = []
    for folder in sorted(commits):
        if folder.is_symlink() or folder.parent.is_symlink() or not folder.is_dir():
            continue
        for unfinished in sorted(folder.glob(".*")):
            m = _UNFINISHED.fullmatch(unfinished.name)
            if not m or unfinished.is_symlink() or not unfinished.is_dir() or writer_alive(unfinished):
                continue
            lock_path = folder / (m["entry"] + ".lock")
            lock = FileLock(lock_path)
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue
            try:
                shutil.rmtree(unfinished, ignore_errors=True)
                if not (folder / m["entry"]).exists():
                    lock_path.unlink(missing_ok=True)
            finally:
                lock.release()
            removed.append(unfinished)
        for f in (folder, folder.parent):  # empty commit and model folders go too
            try:
                f.rmdir()
            except OSError:
                pass
    return removed


def _remove_entries(entries: list[Path]) -> tuple[list[Path], list[Path]]:
    """Delete these entries with their locks and unfinished folders, each under its entry lock taken without waiting
    (one a conversion holds is left: the second list), then their commit and model folders once nothing else is left
    in them."""
    removed, busy = [], []
    for entry in entries:
        lock_path = entry.parent / (entry.name + ".lock")
        lock = FileLock(lock_path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            busy.append(entry)
            continue
        try:
            for unfinished in _unfinished_of(entry):
                shutil.rmtree(unfinished, ignore_errors=True)
            _delete(entry)
            lock_path.unlink(missing_ok=True)
        finally:
            lock.release()
        removed.append(entry)
    for folder in {e.parent for e in removed} | {e.parent.parent for e in removed}:
        for f in sorted([folder, *folder.glob("*")], key=lambda p: -len(p.parts)):  # commit folders first
            try:
                f.rmdir()
            except OSError:
                pass
    return removed, busy
