"""Output directories that appear whole or not at all.

Everything is written into a fresh folder beside OUT (same filesystem, so the final rename is
atomic) and renamed into place at the end; on any failure, Ctrl-C and SIGTERM included, only that folder is
removed. A run killed outright (SIGKILL, the OOM killer, a power cut) cannot remove its folder: the next run into
the same OUT does, knowing it abandoned by the lock its writer held on a file inside it (the kernel releases a
lock when its holder dies, whatever killed it; a process id would not tell another container's live writer on a
shared volume from a dead one). Where a filesystem's locks are local to each machine (NFS mounted with
local_lock=flock), two machines converting into one OUT at once do not see each other's lock; where no lock can be
had at all (Windows, which has no flock, or a filesystem without locks) a killed run's folder stays for the user to
delete, as a live writer's could not be told from it.
Nothing the user owns is ever deleted in its place, and an existing OUT is replaced only when asked.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from fp8kit.errors import Fp8kitError


def check_out(out: str | Path, overwrite: bool, src: Path | None = None) -> Path:
    if isinstance(out, str) and not out.strip():  # Path("") is the current directory, which --overwrite replaced
        raise Fp8kitError("OUT is empty; name the directory to write the FP8 checkpoint to")
    out = Path(out).expanduser().resolve()
    if not out.name:
        raise Fp8kitError(f"{out}: OUT must name a new directory")
    if overwrite and out.exists():
        # --overwrite replaces OUT whole: never the folder the user works in, their home, or one holding either
        places = ((Path.cwd().resolve(), "the current directory"), (Path.home().resolve(), "your home directory"))
        what = (next((what for folder, what in places if out == folder), None)
                or next((f"a folder holding {what}" for folder, what in places if out in folder.parents), None))
        if what:
            raise Fp8kitError(f"{out}: is {what}, which --overwrite would delete; choose a new directory for OUT")
    if out.exists() and not overwrite:
        raise Fp8kitError(f"{out}: already exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise Fp8kitError(f"{out}: exists and is not a directory; remove it or choose another OUT")
    blocker = next((p for p in out.parents if p.exists() or p.is_symlink()), None)
    if blocker is not None and not blocker.is_dir():
        raise Fp8kitError(f"{out}: cannot be created, {blocker} is not a directory; choose another OUT")
    if src is not None:
        src = src.resolve()
        if out == src or src in out.parents or out in src.parents:
            raise Fp8kitError(f"{out}: OUT must not be SRC, lie inside it, or contain it")
    return out


# the interrupts _raise_interrupt has raised in this sigterm_as_interrupt scope: a KeyboardInterrupt raised while a C
# extension imports a module can be cleared by it (torch's, importing numpy: the conversion then ran to the end and
# wrote OUT, exit 0), so atomic_directory looks here before it starts and before it renames
_raised: list[int] = []


def _raise_interrupt(signum, frame):
    _raised.append(signum)
    raise KeyboardInterrupt


def interrupt_raised() -> bool:
    """Whether a Ctrl-C or SIGTERM has been raised as KeyboardInterrupt in this sigterm_as_interrupt scope."""
    return bool(_raised)


def raise_swallowed_interrupt() -> None:
    """A KeyboardInterrupt for a Ctrl-C or SIGTERM that something swallowed, raised again."""
    if interrupt_raised():
        raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While active, SIGTERM (and SIGHUP) unwinds like Ctrl-C (KeyboardInterrupt), so the same `finally` blocks
    remove partial output: the one interrupt mechanism of fp8kit, used by the console scripts for their whole run and by
    atomic_directory around every write. Both are recorded (raise_swallowed_interrupt). Set only from the main
    thread and only over the default actions (a handler of the host application, or of an enclosing use of this,
    is left alone); restored on exit."""
    try:
        active = (threading.current_thread() is threading.main_thread()
                  and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    except (AttributeError, ValueError):  # no SIGTERM on this platform
        active = False
    if not active:
        yield
        return
    _raised.clear()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    # a closed terminal (SIGHUP) killed the run where it stood, its partial folder left behind; under nohup it is
    # ignored (SIG_IGN), and stays so
    hangup = getattr(signal, "SIGHUP", None)
    hangup = hangup if hangup is not None and signal.getsignal(hangup) == signal.SIG_DFL else None
    if hangup is not None:
        signal.signal(hangup, _raise_interrupt)
    ctrl_c = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ctrl_c:
        signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if hangup is not None:
            signal.signal(hangup, signal.SIG_DFL)
        if ctrl_c:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _raised.clear()


WRITING = ".fp8kit-writing"  # inside a partial folder, locked by its writer until the folder has become OUT
NO_LOCK = ".fp8kit-writing-unlocked"  # in its place where no lock can be had: whether its writer lives cannot be told
MARKERS = (WRITING, NO_LOCK)
# a partial folder with neither is one being made (its writer adds WRITING right after the mkdir) or the rest of a
# removal or a run cut short in between: taken for a live writer's this long after its last change
MAKING_S = 60.0


@contextlib.contextmanager
def atomic_directory(out: Path, overwrite: bool, removed: list | None = None, written: list | None = None):
    """Yields the folder to fill; on a clean exit it becomes OUT (replacing OUT only with `overwrite`).
    Parent folders it had to create are removed again on failure (only while they are empty). SIGTERM counts as
    Ctrl-C meanwhile (sigterm_as_interrupt), in the library as in the command line. Partial folders of OUT that a
    killed run left are removed first; `removed` gets (folder, bytes) for each. `written` gets OUT once it is in
    place: the caller's work after it (its report) runs under whole_once_written."""
    written = [] if written is None else written
    with sigterm_as_interrupt(), whole_once_written(out, written):
        with _atomic_directory(out, overwrite, removed, written) as partial:
            yield partial


@contextlib.contextmanager
def whole_once_written(out: Path, written: list):
    """A Ctrl-C or SIGTERM once OUT is in place (`written`, as atomic_directory fills it) goes up as
    InterruptedAfterWriting: fp8-convert said "nothing was written" of a whole OUT when one came while the converter
    closed its files or measured the output for its report, and the cache left that entry unrecorded."""
    try:
        yield
    except KeyboardInterrupt as e:
        if written and not isinstance(e, InterruptedAfterWriting):
            raise InterruptedAfterWriting(out) from e
        raise


class InterruptedAfterWriting(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM that arrived once OUT was complete and in place (held while the renames ran, or while the
    folder it replaced was deleted): still an interrupt, but one after which OUT holds the whole output."""

    def __init__(self, out: Path):
        super().__init__(f"interrupted after {out} was written completely")
        self.out = out


def _try_lock(fd: int) -> bool:
    """An exclusive lock on the open file, without waiting; False where it cannot be had: held by another, or a
    platform (no fcntl) or filesystem without locks."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _hold_writing_lock(partial: Path, held: list) -> None:
    """Opens and locks the WRITING file of a folder this process is filling, its fd appended to `held` (closed, so
    unlocked, once the folder is renamed). Locked under another name and then renamed: no other run ever sees it
    unlocked. Where no lock can be had the file is NO_LOCK instead, and the folder is never taken for abandoned."""
    unlocked = partial / f"{WRITING}.{secrets.token_hex(4)}"
    held.append(os.open(unlocked, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    if _try_lock(held[-1]):
        os.rename(unlocked, partial / WRITING)
    else:
        os.close(held.pop())  # Windows renames no open file
        os.rename(unlocked, partial / NO_LOCK)


def remove_abandoned(out: Path) -> list[tuple[Path, int]]:
    """Remove the partial folders of `out` whose writer is gone: those holding a WRITING file that no process holds
    locked. A folder without one (an older fp8kit's, or one being made or renamed this instant) is left alone."""
    removed = []
    for folder in sorted(out.parent.glob(f".{glob.escape(out.name)}.partial-*")):
        if folder.is_symlink() or not folder.is_dir() or not (folder / WRITING).exists() or writer_alive(folder):
            continue
        try:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
            remove_partial(folder)
            removed.append((folder, size))
        except OSError:  # removed meanwhile by another run, or not ours to remove
            continue
    return removed


def remove_partial(folder: Path) -> None:
    """Delete a partial folder, its WRITING (or NO_LOCK) file last: a removal cut short (a second Ctrl-C, a SIGKILL)
    leaves a folder the next run still knows abandoned, not one without a lock file that no run would ever remove."""
    for child in folder.iterdir():
        if child.name not in MARKERS:
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    for marker in MARKERS:
        if (folder / marker).exists():
            (folder / marker).unlink()
    folder.rmdir()


def writer_alive(folder: Path) -> bool:
    """Whether this temporary folder of OUT may be a live process's: a partial folder whose WRITING file is held
    locked, one made where no lock can be had (NO_LOCK: never taken for abandoned), or one with neither file changed
    in the last MAKING_S seconds (being made; older, it is what a removal or a run cut short at that point left). A
    folder an overwrite moved the old OUT aside to (`.OUT.old-*`) holds none and is taken for dead: its writer
    deletes it within the run (deleting it meanwhile takes nothing that run needs, unless its final rename fails in
    the same instant), and one a run killed outright left is the cache's to remove. The registry cache asks before
    removing a conversion's leftovers: its entry lock does not cover an fp8-convert whose OUT names the entry
    through another path (a symlink, another mount)."""
    try:
        fd = os.open(folder / WRITING, os.O_RDWR)
    except FileNotFoundError:
        if not folder.name.rpartition(".")[2].startswith("partial-"):
            return False
        try:
            return (folder / NO_LOCK).exists() or time.time() - folder.stat().st_mtime < MAKING_S
        except OSError:  # gone meanwhile: most likely renamed to OUT by its writer, which may still be finishing
            return True
    except OSError:  # another account's, say: whether it lives cannot be told, so it is never removed
        return True
    try:
        return not _try_lock(fd)  # where no lock can be had at all, taken for alive: never removed
    finally:
        os.close(fd)


def _taken_meanwhile(out: Path, overwrite: bool) -> Fp8kitError:
    fix = "run again to replace it" if overwrite else "pass --overwrite to replace it"
    return Fp8kitError(f"{out}: made by another process while this one converted; {fix}, or choose another OUT")


@contextlib.contextmanager
def _atomic_directory(out: Path, overwrite: bool, removed: list | None = None, written: list | None = None):
    made = [p for p in reversed(out.parents) if not p.exists()]  # outermost first
    # The folder is named before it is made and made inside the try: a Ctrl-C or SIGTERM landing right after the
    # mkdir (tempfile.mkdtemp returns the name only afterwards) still finds it in the finally below.
    partial = old = None
    writing = []  # the fd of partial's WRITING file, locked while this process fills it
    ok = False
    failure = stranded = None  # why the write failed; why the replaced OUT could not be put back
    raise_swallowed_interrupt()  # one that came while torch was imported
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            abandoned = remove_abandoned(out)  # before this run's folder: a killed run's may hold the disk it needs
            if removed is not None:
                removed.extend(abandoned)
            made_partial = False
            while not made_partial:
                partial = out.parent / f".{out.name}.partial-{secrets.token_hex(8)}"
                with contextlib.suppress(FileExistsError):
                    partial.mkdir()  # the umask's mode, not mkdtemp's 0700 that would lock a vLLM server out
                    made_partial = True
            _hold_writing_lock(partial, writing)
        except OSError as e:
            _remove_empty(made)  # before naming the folder to make writable: the one that existed
            nearest = next((p for p in out.parents if p.exists()), None)  # the folder OUT would be made in
            if nearest is not None and not nearest.is_dir():
                raise Fp8kitError(f"{out}: cannot create the output directory ({nearest} is not a directory); "
                                  f"choose another OUT") from e
            raise Fp8kitError(f"{out}: cannot create the output directory ({e.strerror or e}); choose another OUT "
                              f"or make {nearest or out.parent} writable") from e
        yield partial
        raise_swallowed_interrupt()  # one that came while a module was imported along the way: OUT is not made
        _modes_from_umask(partial)
        with interrupts_deferred():  # OUT is never left moved aside with the new folder not yet in its place
            if out.exists() and overwrite:
                old = out.parent / f".{out.name}.old-{secrets.token_hex(8)}"
                out.rename(old)
            elif out.exists() or out.is_symlink():  # made by another run meanwhile: rename() would replace an empty one
                raise _taken_meanwhile(out, overwrite)
            try:
                partial.rename(out)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # appeared between the test above and the rename
                    raise _taken_meanwhile(out, overwrite) from e
                raise
            ok = True
            # WRITING went along, still locked: until here the folder was a live writer's under its partial name (the
            # cache removes the folders of dead ones), and a rename that failed left it removable
            for marker in MARKERS:
                with contextlib.suppress(OSError):
                    (out / marker).unlink(missing_ok=True)
            if written is not None:
                written.append(out)
    except OSError as e:
        failure = e.strerror or e
        raise Fp8kitError(f"{out}: cannot write ({failure}); free disk space or choose another OUT") from e
    except Exception as e:  # noqa: BLE001 - only a failed write is reworded; the rest goes up as it is
        failure = safetensors_os_error(e)
        if failure is None:
            raise
        raise Fp8kitError(f"{out}: cannot write ({failure}); free disk space or choose another OUT") from e
    finally:
        for fd in writing:  # unlocked first: a cleanup cut short leaves a folder the next run removes
            os.close(fd)
        if partial is not None and partial.exists():
            with contextlib.suppress(OSError):
                remove_partial(partial)
        if old is not None and old.exists():
            if ok:
                # OUT is complete and in place: a Ctrl-C or SIGTERM is raised once the replaced folder is gone (cut
                # short, it stayed for good), as InterruptedAfterWriting
                with interrupts_deferred():
                    shutil.rmtree(old, ignore_errors=True)
            elif not out.exists():  # the new folder could not take OUT's place: the replaced one goes back
                try:
                    old.rename(out)
                except OSError as e:
                    stranded = e
            else:
                shutil.rmtree(old, ignore_errors=True)
        if not ok:
            _remove_empty(made)
        if stranded is not None:  # named: the next run into OUT would remove it as a killed run's .old-* folder
            why = f"cannot write ({failure})" if failure is not None else "the new folder could not take its place"
            raise Fp8kitError(f"{out}: {why}, and the replaced {out.name} could not be put back "
                              f"({stranded.strerror or stranded}): it is {old}; rename it to {out}") from stranded


@contextlib.contextmanager
def stdout_to_stderr():
    """What libraries print on stdout goes to stderr meanwhile (llm-compressor logs there, through loguru), so that
    stdout holds the caller's own output alone: fp8-convert --json's one document, the path a script prints."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no stdout to keep clean (a closed descriptor)
        yield
        return
    try:
        os.dup2(2, 1)
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            if sys.stdout is not None:
                sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl-C and SIGTERM arriving inside are raised on the way out, once the renames they would have split are
    done. Only the main thread receives signals in Python, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = [s for s in (signal.SIGINT, getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None))
            if s is not None]
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)  # KeyboardInterrupt for Ctrl-C and for sigterm_as_interrupt's SIGTERM
            elif handler == signal.SIG_DFL:
                signal.raise_signal(caught[0])


def safetensors_os_error(e: BaseException) -> str | None:
    """The operating system's reason inside a SafetensorError (safetensors' writer, which transformers'
    save_pretrained uses, reports a full disk as "Error while serializing: I/O error: No space left on device
    (os error 28)", not as an OSError); None for any other error."""
    if type(e).__name__ != "SafetensorError":
        return None
    m = re.search(r"\(os error (\d+)\)", str(e))
    return os.strerror(int(m.group(1))) if m else None


def _modes_from_umask(folder: Path) -> None:
    """Files and folders get the modes open() and mkdir give under the umask: safetensors' save_file (transformers'
    save_pretrained, for tensor-static) creates 0600 files that another account could not read."""
    folder_mode = _mkdir_mode()
    for p in folder.rglob("*"):
        if not p.is_symlink() and p.name not in MARKERS:
            p.chmod(folder_mode if p.is_dir() else folder_mode & 0o666)


def _mkdir_mode() -> int:
    """The mode os.mkdir gives a new folder under this process's umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o777 & ~umask


def _remove_empty(folders: list[Path]) -> None:
    """rmdir `folders`, innermost first, stopping at the first that is not empty (or is gone)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return
