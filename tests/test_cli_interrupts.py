"""Ctrl-C and SIGTERM outside `fp8-convert`'s own conversion: in a registry or publish conversion, in
`fp8kit publish`, and in the first second of a console script (while torch is imported). Each ends in one
line, exit 130 from the command line, and no partial folder left in the cache, the staging folder or TMPDIR."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fp8kit.models import build_checkpoint
from leftovers import killed_partial


@pytest.fixture(scope="module")
def big_src(tmp_path_factory):
    """Big enough (~400 MB in float32) that a conversion can be caught in flight."""
    return build_checkpoint(tmp_path_factory.mktemp("big") / "big", "llama", torch.float32, seed=0, hidden_size=1024,
                            intermediate_size=4096, num_hidden_layers=6, vocab_size=1024)


def partials(cache: Path) -> list[Path]:
    """The converter's temporary folders inside the conversion cache (`.{entry}.partial-*`, `.{entry}.old-*`)."""
    return [p for p in cache.glob("*/*/.*") if ".partial-" in p.name or ".old-" in p.name] if cache.exists() else []


def env_for(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(FP8KIT_CACHE=str(tmp_path / "fp8cache"), FP8KIT_REGISTRY=str(tmp_path / "overlay.toml"),
               HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return env


def signal_once_converting(proc: subprocess.Popen, cache: Path, sig: int) -> str:
    """Freeze `proc` once its conversion's partial folder exists in `cache`, send `sig`, let it run on;
    returns its stderr."""
    deadline = time.time() + 120
    while not partials(cache) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        assert partials(cache), f"no conversion in flight to interrupt (exit {proc.poll()})"
        os.kill(proc.pid, sig)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    return proc.communicate(timeout=120)[1]


ENSURE = """
import sys
from fp8kit.registry import ensure
try:
    ensure(sys.argv[1], "tensor")
except KeyboardInterrupt:
    print("KeyboardInterrupt", file=sys.stderr)
    sys.exit(130)
"""


def test_sigterm_during_ensure_removes_the_partial_folder_like_ctrl_c(tmp_path, big_src):
    proc = subprocess.Popen([sys.executable, "-c", ENSURE, str(big_src)], env=env_for(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = signal_once_converting(proc, tmp_path / "fp8cache", signal.SIGTERM)
    assert proc.returncode == 130 and err.strip() == "KeyboardInterrupt", (proc.returncode, err)
    assert partials(tmp_path / "fp8cache") == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("staging", [True, False], ids=["staging", "tmp"])
def test_interrupted_publish_is_one_line_exit_130_and_leaves_nothing_partial(tmp_path, big_src, sig, staging):
    args = [str(big_src), "--base-model", "me/big", "--scheme", "tensor", "--org", "me", "--dry-run"]
    if staging:
        args += ["--staging", str(tmp_path / "staging")]
    proc = subprocess.Popen([sys.executable, "-m", "fp8kit.cli", "publish", *args], env=env_for(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = signal_once_converting(proc, tmp_path / "fp8cache", sig)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, (proc.returncode, err)
    assert lines[0].startswith("error: interrupted while converting me/big-FP8-Tensor") and "nothing partial" in lines[0]
    assert partials(tmp_path / "fp8cache") == []
    assert list((tmp_path / "tmp").iterdir()) == []  # no fp8kit-publish-* folder
    assert not (tmp_path / "staging").exists() or list((tmp_path / "staging").iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_as_the_partial_folder_is_made_leaves_nothing(tmp_path, monkeypatch, sig):
    """The instant the tests above aim at, hit every time: the signal lands as mkdir returns, before anything
    else runs (tempfile.mkdtemp would not have returned the folder's name yet)."""
    from fp8kit.converter.output import atomic_directory

    mkdir = Path.mkdir

    def mkdir_then_signal(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if ".partial-" in self.name:
            signal.raise_signal(sig)

    monkeypatch.setattr(Path, "mkdir", mkdir_then_signal)
    out = tmp_path / "new" / "out"
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(out, overwrite=False):
            raise AssertionError("the interrupt comes first")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("when", ["before", "during"])
def test_an_interrupt_something_swallowed_still_stops_the_conversion(tmp_path, llama_dir, monkeypatch, sig, when):
    """torch's import clears a KeyboardInterrupt raised inside it (its C extension imports numpy): the conversion ran
    on and wrote OUT, exit 0. An interrupt swallowed before the conversion, or during it, is raised again before
    anything is written or before OUT is renamed into place."""
    from fp8kit import convert
    from fp8kit.converter import streaming
    from fp8kit.converter.output import sigterm_as_interrupt

    def swallowed():
        try:
            signal.raise_signal(sig)
            time.sleep(1)
        except KeyboardInterrupt:
            pass

    copy, copied = streaming._copy, []

    def copy_after_a_swallowed_interrupt(*args, **kwargs):
        if not copied:
            swallowed()
        copied.append(1)
        return copy(*args, **kwargs)

    if when == "during":
        monkeypatch.setattr(streaming, "_copy", copy_after_a_swallowed_interrupt)
    out = tmp_path / "out"
    with sigterm_as_interrupt():
        if when == "before":
            swallowed()
        with pytest.raises(KeyboardInterrupt):
            convert(llama_dir, out, scheme="dynamic")
    assert copied if when == "during" else not copied
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    with sigterm_as_interrupt():  # a new scope starts clean
        convert(llama_dir, out, scheme="dynamic")
    assert (out / "config.json").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_between_the_renames_of_overwrite_leaves_the_new_output_whole(tmp_path, monkeypatch, sig):
    """--overwrite moves the old OUT aside, then the new one into place: a signal in between waits for the second
    rename, so OUT is never missing; the interrupt still goes up, saying OUT is whole (fp8-convert reported that
    nothing was written), and the old folder is removed."""
    from fp8kit.converter.output import InterruptedAfterWriting, atomic_directory

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    rename = Path.rename

    def rename_then_signal(self, target):
        moved = rename(self, target)
        if ".old-" in Path(target).name:
            signal.raise_signal(sig)
        return moved

    monkeypatch.setattr(Path, "rename", rename_then_signal)
    with pytest.raises(InterruptedAfterWriting, match=f"^interrupted after {out} was written completely$"):
        with atomic_directory(out, overwrite=True) as partial:
            (partial / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["new.txt"]


def test_stale_partial_folder_is_removed_by_the_next_conversion_and_by_cache_rm(tmp_path, llama_dir, monkeypatch):
    """A hard kill (SIGKILL, power loss) skips all cleanup: the next conversion of that entry removes what it
    left, `cache list` shows it, and `cache rm` removes it."""
    from click.testing import CliRunner

    from fp8kit.cli import main
    from fp8kit.registry.cache import cached_conversion, model_dir

    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    src = tmp_path / "tiny"
    import shutil

    shutil.copytree(llama_dir, src)
    entry = cached_conversion(str(src), "dynamic")
    stale = killed_partial(entry.parent / f".{entry.name}.partial-abcd1234")
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    listing = CliRunner().invoke(main, ["cache", "list"])
    assert listing.exit_code == 0 and str(stale) in listing.stdout and "UNFINISHED" in listing.stdout
    (entry / "fp8kit-entry.json").unlink()  # the entry must be converted again
    assert cached_conversion(str(src), "dynamic") == entry and not stale.exists()

    # a model whose only conversion was killed: just a lock file and the partial folder
    killed_partial(stale)
    shutil.rmtree(entry)
    result = CliRunner().invoke(main, ["cache", "rm", str(src)])
    assert result.exit_code == 0, result.stderr
    assert not model_dir(str(src)).exists()


@pytest.mark.skipif(not hasattr(signal, "SIGKILL") or sys.platform == "win32", reason="kills with SIGKILL")
def test_a_killed_conversion_s_folder_is_removed_by_the_next_run_into_that_out(tmp_path, big_src):
    """SIGKILL (the OOM killer's) left `.OUT.partial-*` with every shard written so far, which no later run removed.
    The next run into that OUT removes it, and says so; a folder whose writer is alive (its lock held) and one an
    older fp8kit left (no lock file, so its writer cannot be told) stay."""
    import fcntl
    import json

    from fp8kit.converter.output import WRITING

    out = tmp_path / "out"
    command = ["fp8-convert", str(big_src), str(out), "--scheme", "tensor", "--json"]
    proc = subprocess.Popen(command, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and not any(
            f.suffix == ".safetensors" for p in tmp_path.glob(".out.partial-*") for f in p.iterdir()):
        time.sleep(0.002)
    proc.kill()
    proc.communicate(timeout=60)
    (killed,) = tmp_path.glob(".out.partial-*")
    assert proc.returncode == -signal.SIGKILL and not out.exists(), proc.returncode
    assert (killed / WRITING).exists() and any(f.suffix == ".safetensors" for f in killed.iterdir())

    live = tmp_path / ".out.partial-live"  # another run's, writing now: this process holds its lock
    live.mkdir()
    held = os.open(live / WRITING, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    older = tmp_path / ".out.partial-0123abcd"
    older.mkdir()
    try:
        done = subprocess.run(command, env=env_for(tmp_path), capture_output=True, text=True, timeout=300)
    finally:
        os.close(held)
    assert done.returncode == 0, done.stderr
    warnings = json.loads(done.stdout)["warnings"]
    assert any(w.startswith(f"removed {killed.name} (") and "by a conversion that was killed" in w
               for w in warnings), warnings
    assert not killed.exists() and live.exists() and older.exists()
    assert WRITING not in {f.name for f in out.iterdir()} and (out / "config.json").exists()


def test_where_no_lock_can_be_had_a_partial_folder_is_never_taken_for_abandoned(tmp_path, monkeypatch):
    """A filesystem without locks (or a platform without fcntl): the writer cannot hold one, so it leaves no lock file,
    and another run cannot remove its folder while it writes."""
    from fp8kit.converter import output

    out = tmp_path / "out"
    with output.atomic_directory(out, overwrite=False) as partial:  # with locks: a live writer's folder stays
        assert [f.name for f in partial.iterdir()] == [output.WRITING]  # locked before it had this name
        assert output.remove_abandoned(out) == [] and partial.exists()
    assert [f.name for f in out.iterdir()] == []
    monkeypatch.setattr(output, "_try_lock", lambda fd: False)
    out = tmp_path / "out2"
    with output.atomic_directory(out, overwrite=False) as partial:
        assert [f.name for f in partial.iterdir()] == [output.NO_LOCK]  # not WRITING: no lock on it
        assert output.remove_abandoned(out) == [] and partial.exists()
        os.utime(partial, (time.time() - 3600,) * 2)  # an hour old
        assert output.writer_alive(partial)  # nor by the registry cache (it took it for dead and deleted it)
        (partial / "a.txt").write_text("a")
    assert [f.name for f in out.iterdir()] == ["a.txt"]


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_the_writer_s_lock_holds_until_its_folder_is_out(tmp_path, monkeypatch):
    """The lock file was deleted before the files' modes were set and the folder renamed: in that window the cache
    took a live conversion's folder for abandoned and deleted it (the conversion then failed, or an rmtree running
    through the rename emptied OUT). It is held until the folder is OUT now, and OUT keeps none. A folder an
    overwrite moved the old OUT aside to holds none and is the cache's to remove; a partial one without one (made
    this instant, or where no lock can be had) is not."""
    from fp8kit.converter import output
    from fp8kit.registry.cache import _unfinished_of

    out = tmp_path / "out"
    seen = []
    set_modes = output._modes_from_umask

    def look_then_set_modes(folder):
        seen.append((output.writer_alive(folder), _unfinished_of(out), output.remove_abandoned(out)))
        return set_modes(folder)

    monkeypatch.setattr(output, "_modes_from_umask", look_then_set_modes)
    for overwrite in (False, True):
        with output.atomic_directory(out, overwrite=overwrite) as partial:
            (partial / "a.txt").write_text("a")
        assert [f.name for f in out.iterdir()] == ["a.txt"] and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert seen == [(True, [], [])] * 2
    aside, making = tmp_path / ".out.old-0123abcd", tmp_path / ".out.partial-0123abcd"
    aside.mkdir()
    making.mkdir()
    assert not output.writer_alive(aside) and output.writer_alive(making) and _unfinished_of(out) == [aside]
    # one gone between the listing and the look: renamed to OUT by its writer, which may still be finishing
    assert output.writer_alive(tmp_path / ".out.partial-gone")
    # a partial folder with no lock file that has not changed for a while: what a removal or a run cut short between
    # the folder's mkdir and its lock file, or between the lock file's removal and the rmdir, leaves
    (making / "model.safetensors").write_bytes(b"half")
    os.utime(making, (time.time() - output.MAKING_S - 1,) * 2)
    assert not output.writer_alive(making) and _unfinished_of(out) == [aside, making]


def test_an_out_made_by_another_run_meanwhile_is_never_replaced(tmp_path):
    """Two runs into one new OUT: the second to finish said `cannot write (Directory not empty); free disk space`, and
    an empty OUT made meanwhile was replaced without --overwrite (rename() replaces an empty folder)."""
    from fp8kit.converter import output
    from fp8kit.errors import Fp8kitError

    out = tmp_path / "out"
    for theirs in ([], ["theirs.txt"]):
        with pytest.raises(Fp8kitError, match=r"out: made by another process while this one converted; pass "
                                              r"--overwrite to replace it, or choose another OUT$"):
            with output.atomic_directory(out, overwrite=False) as partial:
                (partial / "ours.txt").write_text("ours")
                out.mkdir()
                for name in theirs:
                    (out / name).write_text("theirs")
        assert sorted(f.name for f in out.iterdir()) == theirs
        assert sorted(f.name for f in tmp_path.iterdir()) == ["out"]  # no partial folder left
        out.rmdir() if not theirs else None


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_a_failed_run_removes_its_lock_file_last(tmp_path, monkeypatch):
    """rmtree removed a failed run's folder in directory order: a second Ctrl-C during it could leave the folder
    without its lock file, which no later run takes for abandoned. The lock file goes last, so a removal cut short
    at any point leaves a folder the next run removes."""
    from fp8kit.converter import output

    out = tmp_path / "out"
    removed = []
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        removed.append(Path(path).name)
        return real_unlink(path, *args, **kwargs)

    with pytest.raises(RuntimeError, match="conversion failed"):
        with output.atomic_directory(out, overwrite=False) as partial:
            for i in range(6):
                (partial / f"model-{i}.safetensors").write_bytes(b"x")
            (partial / "chat_templates").mkdir()
            (partial / "chat_templates" / "a.jinja").write_text("a")
            monkeypatch.setattr(os, "unlink", unlink)
            raise RuntimeError("conversion failed")
    monkeypatch.undo()
    assert removed[-1] == output.WRITING and len(removed) == 8, removed
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_interrupt_while_the_replaced_out_is_removed_waits_for_it_and_says_out_is_whole(tmp_path, monkeypatch):
    """With --overwrite, a Ctrl-C or SIGTERM while the replaced OUT was being deleted (the new one already in place)
    left `.OUT.old-*` for good, and fp8-convert reported that nothing was written. The deletion finishes first, and
    the interrupt says OUT is whole."""
    from fp8kit.converter import output

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real_rmtree = output.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if ".old-" in Path(path).name:
            os.kill(os.getpid(), signal.SIGTERM)  # raised as KeyboardInterrupt inside atomic_directory, if not held
            time.sleep(0.1)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(output.shutil, "rmtree", rmtree)
    with pytest.raises(output.InterruptedAfterWriting):
        with output.atomic_directory(out, overwrite=True) as partial:
            (partial / "new.txt").write_text("new")
    assert [f.name for f in tmp_path.iterdir()] == ["out"] and [f.name for f in out.iterdir()] == ["new.txt"]


def test_fp8_convert_interrupted_once_out_is_replaced_says_out_is_whole(tmp_path, monkeypatch, llama_dir):
    """The command line's line for that interrupt: exit 130, and not "nothing was written" about a complete OUT."""
    from click.testing import CliRunner

    from fp8kit.cli import fp8_convert
    from fp8kit.converter import output

    out = tmp_path / "out"
    out.mkdir()
    real_rmtree = output.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if ".old-" in Path(path).name:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(output.shutil, "rmtree", rmtree)
    result = CliRunner().invoke(fp8_convert, [str(llama_dir), str(out), "--scheme", "dynamic", "--overwrite"])
    assert result.exit_code == 130, result.output
    assert result.stderr == f"error: interrupted once {out} was written completely; it holds the whole conversion\n"
    assert (out / "config.json").exists() and [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("how", ["ensure", "fp8-convert", "ensure, measuring", "fp8-convert, measuring",
                                 "fp8-convert, while recording"])
def test_an_entry_written_whole_before_an_interrupt_is_recorded_or_said_whole(tmp_path, monkeypatch, llama_dir, how):
    """An interrupt held through the final rename (InterruptedAfterWriting) left a whole cache entry without its
    marker: the next ensure() converted it again, and fp8-convert said it "holds the whole conversion" of an entry the
    cache ignored. One while the converter measured the written files for its report, or while fp8-convert recorded
    the entry, said "nothing was written" of a whole one (and left it unrecorded)."""
    import shlex
    import shutil

    from click.testing import CliRunner

    from fp8kit.cli import fp8_convert
    from fp8kit.converter import source
    from fp8kit.converter.output import InterruptedAfterWriting, sigterm_as_interrupt
    from fp8kit.registry import cache, resolve

    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))
    src = tmp_path / "tiny"
    shutil.copytree(llama_dir, src)
    answer = resolve(str(src), "dynamic")
    entry = Path(answer.cache_dir)
    rename, folder_files, signalled = Path.rename, source.folder_files, []

    def rename_then_signal(self, target):
        moved = rename(self, target)
        if Path(target) == entry:
            signal.raise_signal(signal.SIGTERM)
        return moved

    def signal_then_list(folder):  # the converter's report lists OUT's files first, the marker after it
        if not signalled:  # Ctrl-C: a library caller's SIGTERM is turned into an interrupt only while it writes
            signalled.append(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        return folder_files(folder)

    with monkeypatch.context() as patch:
        if how.endswith("recording"):
            patch.setattr(cache, "_write_marker", lambda *a: signal.raise_signal(signal.SIGTERM))
        elif how.endswith("measuring"):
            patch.setattr(source, "folder_files", signal_then_list)
        else:
            patch.setattr(Path, "rename", rename_then_signal)
        if how.startswith("ensure"):
            with pytest.raises(InterruptedAfterWriting):
                cache.ensure(str(src), "dynamic")
        else:
            with sigterm_as_interrupt():  # as the console script runs it: a SIGTERM after the conversion is one too
                result = CliRunner().invoke(fp8_convert, shlex.split(answer.convert_command)[1:])
            assert result.exit_code == 130, result.output
            assert result.stderr == (f"error: interrupted once {entry} was written completely; it holds the whole "
                                     f"conversion\n")
    assert (entry / "config.json").exists() and not list(entry.parent.glob(".*"))
    assert resolve(str(src), "dynamic").cached is (not how.endswith("recording"))


def test_a_failed_final_rename_puts_the_replaced_out_back(tmp_path, monkeypatch):
    """--overwrite moves OUT aside before the new folder takes its place: where that second rename failed, both
    folders were deleted, the user's old OUT with them."""
    from fp8kit.converter import output
    from fp8kit.errors import Fp8kitError

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    rename = Path.rename

    def failing_rename(self, target):
        if ".partial-" in self.name:
            raise OSError(5, "Input/output error")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(Fp8kitError, match=r"out: cannot write \(Input/output error\)"):
        with output.atomic_directory(out, overwrite=True) as partial:
            (partial / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "old.txt").read_text() == "old"


def test_a_replaced_out_that_cannot_be_put_back_is_named(tmp_path, monkeypatch):
    """Where putting the old OUT back failed too, it stayed as .out.old-*, which the next run into OUT removes as a
    killed run's leftover: the error names it, to be renamed back by hand."""
    from fp8kit.converter import output
    from fp8kit.errors import Fp8kitError

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    rename = Path.rename

    def failing_rename(self, target):
        if ".partial-" in self.name or ".old-" in self.name:
            raise OSError(5, "Input/output error")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(Fp8kitError) as caught:
        with output.atomic_directory(out, overwrite=True) as partial:
            (partial / "new.txt").write_text("new")
    (old,) = [p for p in tmp_path.iterdir()]
    assert old.name.startswith(".out.old-") and (old / "old.txt").read_text() == "old"
    assert str(caught.value) == (f"{out}: cannot write (Input/output error), and the replaced {out.name} could not "
                                 f"be put back (Input/output error): it is {old}; rename it to {out}")


def caught_signals(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    raise AssertionError("no SigCgt line")


def torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("script,args,message", [
    ("fp8-convert", ["{src}", "{out}", "--scheme", "dynamic"], "error: interrupted; nothing was written to {out}"),
    ("fp8kit", ["resolve", "Qwen/Qwen3-8B-Base"], "error: interrupted; nothing was changed"),
])
def test_ctrl_c_while_the_console_script_imports_torch_is_one_line(tmp_path, llama_dir, script, args, message):
    """The console script sets up its interrupt handling before torch and transformers are imported, so a
    Ctrl-C in the first second is one line and exit 130, not a KeyboardInterrupt traceback and -2."""
    exe = Path(sys.executable).parent / script
    if not exe.exists():
        pytest.skip(f"{script} is not installed beside {sys.executable}")
    out = tmp_path / "out"
    args = [a.format(src=llama_dir, out=out) for a in args]
    proc = subprocess.Popen([str(exe), *args], env=env_for(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    start = time.time()
    # Wait until the process handles SIGTERM (the sign that its interrupt handling is set up), then interrupt it at
    # once, inside the ~1 s torch takes to import. Torch seen loaded at one reading and the handler still missing at
    # the next, later one, means torch came first; checked after the handler was seen, as before, a busy machine
    # could load torch in between and fail a correct script.
    handled = False
    while proc.poll() is None and time.time() - start < 10:
        loaded = torch_loaded(proc.pid)
        if caught_signals(proc.pid) & (1 << (signal.SIGTERM - 1)):
            handled = True
            break
        assert not loaded, f"{script} imported torch before it set up its interrupt handling"
        time.sleep(0.001)
    waited = time.time() - start
    assert proc.poll() is None, f"{script} finished (exit {proc.returncode}) before it could be interrupted"
    assert handled, f"{script} set up no interrupt handling in {waited:.1f} s"
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, f"SIGINT after {waited:.3f} s", err)
    # before the command line is parsed (a busy machine), the generic line: as true, and as short
    assert err.strip().splitlines() in ([message.format(out=out)], ["error: interrupted; nothing was changed"]), err
    assert not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_failure_after_a_swallowed_interrupt_is_the_interrupt(capsys, sig):
    """An interrupt cleared inside torch's import left numpy half-loaded: a later import failed with a traceback
    (ImportError, exit 1). Any failure after an interrupt is reported as the interrupt: one line, exit 130."""
    import click

    from fp8kit.cli import _Command

    @click.command(cls=_Command)
    def work():
        try:
            signal.raise_signal(sig)
            time.sleep(1)
        except KeyboardInterrupt:
            pass  # as torch's C extension clears it
        raise ImportError("cannot load module more than once per process")

    with pytest.raises(SystemExit) as e:
        work.main([], standalone_mode=True)
    assert e.value.code == 130
    assert capsys.readouterr().err == "error: interrupted; nothing was changed\n"


def _prompting_command():
    import click

    from fp8kit.cli import _Command

    @click.command(cls=_Command)
    @click.option("--how", type=click.Choice(["prompt", "input", "abort"]))
    def ask(how):
        if how == "prompt":
            click.prompt("name")
        elif how == "input":
            input()
        else:
            raise click.Abort()

    return ask


@pytest.mark.parametrize("how", ["prompt", "input", "abort"])
def test_end_of_input_is_aborted_exit_1_not_an_interrupt(how):
    """click makes an Abort of an EOFError too (a prompt at the end of its input): that is one line and exit 1, as
    click's `Aborted!` was, never the interrupt line and 130, and no blank line."""
    from click.testing import CliRunner

    result = CliRunner().invoke(_prompting_command(), ["--how", how], input="")
    assert result.exit_code == 1, result.output
    assert result.stderr == "error: aborted\n", repr(result.stderr)


def test_ctrl_c_at_a_prompt_is_still_the_interrupt_line():
    from unittest import mock

    from click.testing import CliRunner

    with mock.patch("click.termui._readline_prompt", side_effect=KeyboardInterrupt):
        result = CliRunner().invoke(_prompting_command(), ["--how", "prompt"])
    assert result.exit_code == 130 and "error: interrupted; nothing was changed" in result.stderr, result.output


def test_lazy_names_are_listed_and_the_converter_subpackage_is_an_attribute():
    """`convert` and `ConvertReport` are in dir() and inspect.getmembers() though imported on first use, and
    `fp8kit.converter` after `import fp8kit` resolves (it did before they were lazy) without importing torch."""
    code = """
import inspect, sys
import fp8kit
assert {"convert", "ConvertReport", "converter"} <= set(dir(fp8kit)), dir(fp8kit)
converter = fp8kit.converter
assert "torch" not in sys.modules
assert {"convert", "ConvertReport", "SCHEMES"} <= set(dir(converter)), dir(converter)
names = dict(inspect.getmembers(fp8kit))
assert names["convert"] is converter.convert and names["ConvertReport"] is converter.ConvertReport
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_signal_after_the_work_is_done_does_not_change_the_exit(tmp_path):
    """A SIGTERM or Ctrl-C in the interpreter's shutdown, after the report was printed, ended the process by that
    signal (status -15 or -2, no line): the console script now ignores them once its command has returned, while
    a CliRunner caller in the same process keeps its own handlers."""
    from click.testing import CliRunner

    from fp8kit.cli import main

    code = ("import atexit, signal, sys; from fp8kit.cli import main; "
            "atexit.register(lambda: print('ignored' if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and "
            "signal.getsignal(signal.SIGINT) == signal.SIG_IGN else 'default', file=sys.stderr)); "
            "sys.argv = ['fp8kit', 'registry', 'list', '--json']; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "FP8KIT_REGISTRY": str(tmp_path / "none.toml")})
    assert proc.returncode == 0 and proc.stderr.strip().splitlines()[-1] == "ignored", proc.stderr
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert CliRunner().invoke(main, ["registry", "list"]).exit_code == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
