"""Registry overlay writes that fail leave the file whole; `fp8kit cache rm` with a cache path that is a file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fp8kit.cli import main
from fp8kit.registry import load
from leftovers import killed_partial

APPEND = """
import resource, sys
from fp8kit.errors import Fp8kitError
from fp8kit.registry.catalog import Variant, append_to_overlay
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    append_to_overlay(Variant("me/gemma-3-4b-it-FP8-Block", "gemma-3", "block", "compressed-tensors", ("block",),
                              ("google/gemma-3-4b-it",), "overlay"))
except Fp8kitError as e:
    print(e)
    sys.exit(3)
"""


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8KIT_REGISTRY", str(tmp_path / "overlay.toml"))
    monkeypatch.setenv("FP8KIT_CACHE", str(tmp_path / "fp8cache"))


def test_overlay_write_that_runs_out_of_space_leaves_the_file_whole(tmp_path, overlay_text):
    overlay = tmp_path / "overlay.toml"
    overlay.write_text(overlay_text)
    # Files may grow to 20 bytes past the overlay's size: the new entry does not fit (a disk filling up).
    proc = subprocess.run([sys.executable, "-c", APPEND, str(len(overlay_text) + 20)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith(f"{overlay}: cannot write") and len(proc.stdout.strip().splitlines()) == 1
    assert overlay.read_text() == overlay_text
    assert [v.repo_id for v in load() if v.source == "overlay"] == ["me/Qwen3-8B-FP8-Dynamic"]
    assert not list(tmp_path.glob(".overlay.toml.*.tmp"))

    proc = subprocess.run([sys.executable, "-c", APPEND, str(1 << 20)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert overlay.read_text().startswith(overlay_text)
    assert [v.repo_id for v in load() if v.source == "overlay"] == ["me/Qwen3-8B-FP8-Dynamic",
                                                                    "me/gemma-3-4b-it-FP8-Block"]


@pytest.mark.parametrize("args", [["cache", "rm", "--all"], ["cache", "rm", "org/model"], ["cache", "list"],
                                  ["resolve", "org/model"]])
def test_cache_commands_when_the_cache_path_is_a_file_are_one_line(tmp_path, monkeypatch, args):
    """rm refused it; list showed an empty cache, and resolve printed an fp8-convert command into the file's
    subfolder, which then failed."""
    not_a_folder = tmp_path / "fp8cache"
    not_a_folder.write_text("something else\n")
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(not_a_folder) in lines[0] and "FP8KIT_CACHE" in lines[0], result.stderr
    assert not_a_folder.read_text() == "something else\n"


def test_overlay_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "overlay.toml").write_bytes(b"# caf\xe9\n")
    result = CliRunner().invoke(main, ["resolve", "Qwen/Qwen3-8B"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert str(tmp_path / "overlay.toml") in result.stderr and "UTF-8" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cache_list_shows_a_damaged_marker_as_broken(tmp_path):
    entry = tmp_path / "fp8cache" / "org--m" / "abc" / "dynamic-compressed-tensors-fp8kit0.1.0"
    entry.mkdir(parents=True)
    (entry / "fp8kit-entry.json").write_text("[1, 2]")  # JSON, but not the marker's object
    result = CliRunner().invoke(main, ["cache", "list"])
    assert result.exit_code == 0, result.output
    assert "BROKEN" in result.stdout and str(entry) in result.stdout
    listing = CliRunner().invoke(main, ["cache", "list", "--json"])
    assert listing.exit_code == 0 and json.loads(listing.stdout)[0]["ok"] is False


def test_cache_rm_by_the_listed_name_after_the_checkpoint_is_gone(tmp_path, llama_dir):
    import shutil

    from fp8kit.registry import ensure

    ckpt = tmp_path / "ckpt"
    shutil.copytree(llama_dir, ckpt)
    entry = ensure(str(ckpt), "dynamic")
    assert (tmp_path / "fp8cache" / "conversions.log").exists()
    shutil.rmtree(ckpt)
    result = CliRunner().invoke(main, ["cache", "rm", "conversions.log"])  # a file of the cache, not an entry
    assert result.exit_code == 1 and "nothing cached for 'conversions.log'" in result.stderr
    assert (tmp_path / "fp8cache" / "conversions.log").exists()
    result = CliRunner().invoke(main, ["cache", "rm", str(ckpt)])
    assert result.exit_code == 0, result.output
    assert not entry.exists() and str(entry.parent.parent) in result.stdout


def test_ensure_with_a_cache_path_that_is_a_file_is_one_line(tmp_path, llama_dir):
    from fp8kit.errors import Fp8kitError
    from fp8kit.registry import ensure

    (tmp_path / "fp8cache").write_text("not a folder\n")
    with pytest.raises(Fp8kitError) as e:
        ensure(str(llama_dir), "dynamic")
    assert str(tmp_path / "fp8cache") in str(e.value) and "nothing was converted" in str(e.value)


APPEND_MANY = """
import sys
from fp8kit.registry.catalog import Variant, append_to_overlay
for i in range(15):
    append_to_overlay(Variant(f"me/m{sys.argv[1]}-{i}-FP8-Dynamic", "qwen3", "dynamic", "compressed-tensors",
                              ("dynamic",), ("Qwen/Qwen3-8B",), "overlay"))
"""


def test_concurrent_overlay_writers_keep_every_entry(tmp_path, overlay_text):
    """Publishing jobs in parallel each append their uploads: the lock beside the file serializes the
    read-append-replace, so no writer's entries are lost to another's replace."""
    (tmp_path / "overlay.toml").write_text(overlay_text)
    procs = [subprocess.Popen([sys.executable, "-c", APPEND_MANY, str(w)], stderr=subprocess.PIPE, text=True)
             for w in range(4)]
    errors = [p.communicate(timeout=180)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    names = sorted(v.repo_id for v in load() if v.source == "overlay")
    assert names == sorted(["me/Qwen3-8B-FP8-Dynamic"] + [f"me/m{w}-{i}-FP8-Dynamic" for w in range(4) for i in range(15)])


def test_registry_list_of_an_unknown_family_is_one_line_naming_the_known_ones():
    result = CliRunner().invoke(main, ["registry", "list", "--family", "nope"])
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --family 'nope'"), result.stderr
    assert "gemma-3" in lines[0] and "qwen3" in lines[0] and "llama-3.1" in lines[0]


def test_registry_list_knows_the_overlay_s_families(tmp_path, overlay_text):
    (tmp_path / "overlay.toml").write_text(overlay_text.replace('family = "qwen3"', 'family = "mine"'))
    result = CliRunner().invoke(main, ["registry", "list", "--family", "mine"])
    assert result.exit_code == 0 and "me/Qwen3-8B-FP8-Dynamic" in result.stdout


@pytest.mark.parametrize("revision,commit", [
    ("abc123", None),
    ("0123456789abcdef0123456789abcdef01234567", "0123456789abcdef0123456789abcdef01234567"),
])
def test_resolve_of_a_pinned_revision_shows_the_cache_layout(tmp_path, monkeypatch, revision, commit):
    """`{org}--{name}/{source commit}/...`: the folder is the repo's, never `name@revision`, and the commit is
    the pinned one, never main's. A folder named by a commit not known yet is no OUT for fp8-convert: no cache_dir
    is given then (it gave a placeholder path), and the command printed is ensure()'s, which fetches it first."""
    from fp8kit.registry import resolve

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    answer = resolve(f"Qwen/Qwen3-8B@{revision}", "dynamic")
    assert answer.model_dir == str(tmp_path / "fp8cache" / "Qwen--Qwen3-8B")
    assert answer.cache_dir == (commit and str(tmp_path / "fp8cache" / "Qwen--Qwen3-8B" / commit
                                               / "dynamic-compressed-tensors-fp8kit0.1.0"))
    result = CliRunner().invoke(main, ["resolve", f"Qwen/Qwen3-8B@{revision}", "--scheme", "dynamic"])
    assert result.exit_code == 0 and (answer.cache_dir or f"{answer.model_dir}, in the folder of {revision}'s commit") \
        in result.stdout, result.stdout
    command = result.stdout.strip().splitlines()[-1]
    assert command.strip() == answer.convert_command and "<" not in command
    assert command.strip().startswith("fp8-convert " if commit == revision else "python -c ")


def test_pinned_revision_is_converted_where_resolve_says(tmp_path, llama_dir, monkeypatch):
    """The real conversion path of a pinned name: `{org}--{name}/{commit}`, as resolve shows it."""
    import shutil

    from fp8kit.registry import resolve
    from fp8kit.registry.cache import cached_conversion

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--me--tiny"
    shutil.copytree(llama_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    for name in (f"me/tiny@{commit}", "me/tiny@main"):
        entry = cached_conversion(name, "dynamic")
        assert str(entry) == resolve(name, "dynamic").cache_dir
        assert entry.parent.parent == tmp_path / "fp8cache" / "me--tiny"
    result = CliRunner().invoke(main, ["cache", "rm", f"me/tiny@{commit}"])
    assert result.exit_code == 0, result.stderr


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def pinned_hub(tmp_path, llama_dir, monkeypatch):
    """`me/tiny` in a fake HF cache, main at COMMIT, offline."""
    import shutil

    repo = tmp_path / "hub" / "models--me--tiny"
    shutil.copytree(llama_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return tmp_path / "fp8cache"


def _no_conversion(*args, **kwargs):
    raise AssertionError("converted again")


@pytest.mark.parametrize("revision", ["main", COMMIT])
def test_an_entry_of_the_old_pinned_layout_is_moved_not_converted_again(pinned_hub, monkeypatch, revision):
    """Before pinned names moved into the repo's folder, `me/tiny@rev` was cached under `me--tiny@rev/<commit>/`:
    such an entry is moved into `me--tiny/<commit>/` and used, and `cache list` shows it once."""
    from fp8kit.registry import ensure
    from fp8kit.registry.cache import cached_conversion

    name = f"me/tiny@{revision}"
    entry = cached_conversion(name, "dynamic")
    legacy = pinned_hub / f"me--tiny@{revision}" / COMMIT / entry.name
    legacy.parent.mkdir(parents=True)
    entry.rename(legacy)
    (entry.parent / (entry.name + ".lock")).unlink()
    entry.parent.rmdir()
    entry.parent.parent.rmdir()
    (legacy.parent / (legacy.name + ".lock")).write_text("")

    monkeypatch.setattr("fp8kit.converter.convert", _no_conversion)
    assert ensure(name, "dynamic") == entry
    assert not (pinned_hub / f"me--tiny@{revision}").exists()
    listing = CliRunner().invoke(main, ["cache", "list", "--json"])
    rows = json.loads(listing.stdout)
    assert [(r["name"], r["path"], r["ok"]) for r in rows] == [(name, str(entry), True)]
    assert cached_conversion(name, "dynamic") == entry


def test_a_short_commit_hash_offline_is_the_cached_snapshot_and_its_conversion(pinned_hub, tmp_path):
    """Offline, `resolve me/tiny@<short hash>` said the conversion was cached, but ensure() and fp8-convert failed
    ("not in the local HF cache"): huggingface_hub looks a short hash up among branch names only."""
    from fp8kit.cli import fp8_convert
    from fp8kit.registry import ensure, resolve

    entry = ensure(f"me/tiny@{COMMIT}", "dynamic")
    short = f"me/tiny@{COMMIT[:7]}"
    assert resolve(short, "dynamic").cached and ensure(short, "dynamic") == entry
    result = CliRunner().invoke(fp8_convert, [short, str(tmp_path / "out"), "--scheme", "block"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "config.json").is_file()


def test_cache_rm_of_a_pinned_name_removes_its_unfinished_conversion(pinned_hub):
    """A pinned conversion killed outright leaves a partial folder and a lock: `cache list` names the model (as
    `cache rm` takes it, also in --json) and `cache rm org/name@rev` removes it; a held lock (a conversion in
    progress) keeps its folder."""
    from filelock import FileLock

    from fp8kit.registry.resolution import entry_name

    commit_dir = pinned_hub / "me--tiny" / COMMIT
    commit_dir.mkdir(parents=True)
    stale = killed_partial(commit_dir / f".{entry_name('dynamic')}.partial-abcd1234")
    (stale / "model.safetensors").write_bytes(b"\0" * 1000)
    (commit_dir / f"{entry_name('dynamic')}.lock").write_text("")

    listing = CliRunner().invoke(main, ["cache", "list"])
    assert listing.exit_code == 0
    [row] = [line for line in listing.stdout.splitlines() if "UNFINISHED" in line]
    assert row.startswith(f"me/tiny@{COMMIT} ") and str(stale) in row
    rows = json.loads(CliRunner().invoke(main, ["cache", "list", "--json"]).stdout)
    assert [(r["name"], r["status"], r["path"], r["scheme"]) for r in rows] == [
        (f"me/tiny@{COMMIT}", "unfinished", str(stale), "dynamic")]

    held = FileLock(commit_dir / f"{entry_name('dynamic')}.lock")
    with held:  # a conversion in progress: its folder stays
        result = CliRunner().invoke(main, ["cache", "rm", "me/tiny@main"])
    assert stale.exists()
    for name in ("me/tiny@main",):
        result = CliRunner().invoke(main, ["cache", "rm", name])
        assert result.exit_code == 0, result.stderr
        assert str(stale) in result.stdout
    assert not stale.exists() and not (pinned_hub / "me--tiny").exists()


def test_cache_list_json_keeps_the_keys_of_finished_entries(pinned_hub):
    from fp8kit.registry.cache import cached_conversion

    entry = cached_conversion("me/tiny@main", "dynamic")
    rows = json.loads(CliRunner().invoke(main, ["cache", "list", "--json"]).stdout)
    assert rows == [{"name": "me/tiny@main", "scheme": "dynamic", "format": "compressed-tensors", "commit": COMMIT,
                     "path": str(entry), "bytes": rows[0]["bytes"], "ok": True}]


def test_cache_list_while_a_conversion_renames_its_folders(tmp_path, llama_dir, monkeypatch):
    """A running conversion renames and removes its partial and old folders: a file or folder that vanishes between
    listing and stat is left out, never a FileNotFoundError."""
    import shutil
    from pathlib import Path

    from fp8kit.converter import source
    from fp8kit.registry.cache import cached_conversion

    src = tmp_path / "tiny"
    shutil.copytree(llama_dir, src)
    entry = cached_conversion(str(src), "dynamic")
    partial = entry.parent / f".{entry.name}.partial-abcd1234"
    shutil.copytree(entry, partial)

    is_file = Path.is_file

    def vanishing(self):  # the converter renames the partial folder right after this check
        found = is_file(self)
        if found and partial in self.parents and partial.exists():
            partial.rename(entry.parent / "renamed-away")
        return found

    monkeypatch.setattr(Path, "is_file", vanishing)
    folder_files = source.folder_files

    def replaced(folder):  # an --overwrite conversion replaces the entry right after it is listed
        names = folder_files(folder)
        if folder == entry:
            shutil.rmtree(entry)
        return names

    monkeypatch.setattr(source, "folder_files", replaced)
    result = CliRunner().invoke(main, ["cache", "list"])
    assert result.exit_code == 0, result.output
    assert result.exception is None
    assert str(entry) not in result.stdout


def test_fp8_convert_into_the_cache_takes_the_entry_lock_and_is_used_by_ensure(tmp_path, llama_dir, monkeypatch):
    """The command `fp8kit resolve` prints converts under the entry's lock (a concurrent ensure() waits rather than
    removing its partial folder as stale) and writes the completion marker, so ensure() uses that conversion."""
    import shlex
    import shutil

    from filelock import FileLock, Timeout

    from fp8kit.cli import fp8_convert
    from fp8kit.registry import ensure, resolve

    src = tmp_path / "tiny"
    shutil.copytree(llama_dir, src)
    answer = resolve(str(src), "dynamic")
    argv = shlex.split(answer.convert_command)
    assert argv[0] == "fp8-convert"

    from fp8kit.converter import convert

    def locked_convert(*args, **kwargs):
        with pytest.raises(Timeout):
            FileLock(answer.cache_dir + ".lock").acquire(timeout=0)
        return convert(*args, **kwargs)

    monkeypatch.setattr("fp8kit.converter.convert", locked_convert)
    result = CliRunner().invoke(fp8_convert, argv[1:])
    assert result.exit_code == 0, result.output
    monkeypatch.setattr("fp8kit.converter.convert", _no_conversion)
    assert str(ensure(str(src), "dynamic")) == answer.cache_dir


@pytest.mark.parametrize("linked", ["model", "commit"])
def test_pinned_cache_rm_never_deletes_behind_a_link(tmp_path, pinned_hub, linked):
    """Like an unpinned `cache rm`, which removes a linked model folder's link and not its target, a pinned one
    leaves what a linked model or commit folder points to."""
    import shutil

    from fp8kit.registry.cache import cached_conversion

    entry = cached_conversion("me/tiny@main", "dynamic")
    folder = entry.parent.parent if linked == "model" else entry.parent
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(folder), str(elsewhere))
    folder.symlink_to(elsewhere, target_is_directory=True)
    assert entry.is_dir()
    CliRunner().invoke(main, ["cache", "rm", "me/tiny@main"])
    kept = elsewhere / entry.name if linked == "commit" else elsewhere / COMMIT / entry.name
    assert (kept / "fp8kit-entry.json").exists()


def test_pinned_cache_rm_leaves_an_entry_a_conversion_holds(pinned_hub):
    """The pinned form deleted a finished entry without its lock, under a conversion rebuilding it; like the
    unpinned form it now leaves it and says so in one line."""
    from filelock import FileLock

    from fp8kit.registry.cache import cached_conversion

    entry = cached_conversion("me/tiny@main", "dynamic")
    with FileLock(entry.parent / (entry.name + ".lock")):
        result = CliRunner().invoke(main, ["cache", "rm", "me/tiny@main"])
        assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert f"{entry}: a conversion is running there" in result.stderr and entry.is_dir()
    result = CliRunner().invoke(main, ["cache", "rm", "me/tiny@main"])
    assert result.exit_code == 0 and not entry.exists(), result.output


def test_the_command_resolve_prints_for_a_commit_not_known_yet_converts_into_the_cache(tmp_path, llama_dir,
                                                                                          monkeypatch):
    """It printed `fp8-convert NAME '.../<commit of main, fetched at conversion>/...'`: that converted into a folder of
    that name, never recorded (ensure() converted again). The command printed now converts where ensure() looks."""
    import os
    import shlex
    import shutil

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    result = CliRunner().invoke(main, ["resolve", "me/tiny", "--scheme", "dynamic"])
    assert result.exit_code == 0, result.output
    argv = shlex.split(result.stdout.strip().splitlines()[-1])
    assert argv[:2] == ["python", "-c"]
    # what the download in that command does (the test is offline): me/tiny's main lands in the HF cache
    repo = tmp_path / "hub" / "models--me--tiny"
    shutil.copytree(llama_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    entry = tmp_path / "fp8cache" / "me--tiny" / COMMIT / "dynamic-compressed-tensors-fp8kit0.1.0"
    assert proc.stdout.strip() == str(entry)
    assert sorted(p.name for p in (tmp_path / "fp8cache" / "me--tiny").iterdir()) == [COMMIT]
    listing = json.loads(CliRunner().invoke(main, ["cache", "list", "--json"]).stdout)
    assert [(r["name"], r["path"], r["ok"]) for r in listing] == [("me/tiny", str(entry), True)]
    result = CliRunner().invoke(main, ["resolve", "me/tiny", "--scheme", "dynamic"])
    assert result.exit_code == 0 and str(entry) in result.stdout and "cached" in result.stdout, result.output


def test_fp8_convert_into_the_cache_leaves_nothing_there_when_it_cannot_convert(tmp_path, llama_dir, monkeypatch):
    """The old placeholder command, run for a model that cannot be had, made the placeholder folder and left a lock
    file in it; a local checkpoint converted into another commit's folder was never used by ensure()."""
    from fp8kit.cli import fp8_convert
    from fp8kit.registry.cache import model_dir
    from fp8kit.registry.resolution import entry_name

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    cache = tmp_path / "fp8cache"
    placeholder = cache / "me--absent" / "<commit of main, fetched at conversion>" / entry_name("dynamic")
    result = CliRunner().invoke(fp8_convert, ["me/absent", str(placeholder), "--scheme", "dynamic"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "me/absent" in result.stderr and not cache.exists()

    wrong = model_dir(str(llama_dir)) / "local-0000000000000000" / entry_name("dynamic")
    result = CliRunner().invoke(fp8_convert, [str(llama_dir), str(wrong), "--scheme", "dynamic"])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "inside the fp8kit cache" in result.stderr and "nothing was converted" in result.stderr
    assert not cache.exists()


def test_pinned_cache_rm_removes_the_entry_the_unpinned_name_made_of_that_commit(pinned_hub):
    """`cache rm me/tiny@<commit>` said "nothing cached" for `ensure("me/tiny")`'s entry in that commit's folder."""
    from fp8kit.registry.cache import cached_conversion

    for pinned in (f"me/tiny@{COMMIT}", "me/tiny@main"):
        entry = cached_conversion("me/tiny", "dynamic")
        result = CliRunner().invoke(main, ["cache", "rm", pinned])
        assert result.exit_code == 0 and str(entry) in result.stdout, result.output
        assert not entry.exists() and not (pinned_hub / "me--tiny").exists()
    result = CliRunner().invoke(main, ["cache", "rm", "me/tiny@1111111111111111111111111111111111111111"])
    assert result.exit_code == 1 and "nothing cached" in result.stderr  # another commit's: nothing of it


def test_overlay_nested_too_deeply_is_one_line(tmp_path):
    """tomllib recurses once per nesting level: a RecursionError traceback."""
    overlay = tmp_path / "overlay.toml"
    overlay.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    result = CliRunner().invoke(main, ["registry", "list"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(overlay) in lines[0] and "nested too deeply" in lines[0], result.stderr


@pytest.mark.parametrize("name", ["org/na--me", "org/na..me", "org/name.git"])
def test_resolve_refuses_a_name_the_hub_refuses(name):
    """It printed a conversion plan (exit 0) for names huggingface_hub refuses; only ensure() failed, later."""
    result = CliRunner().invoke(main, ["resolve", name, "--scheme", "dynamic"])
    assert result.exit_code == 1 and "not a valid Hub repo id" in result.stderr, result.output


@pytest.mark.parametrize("name", ["me/tiny", "me/tiny@main"])
def test_the_printed_fp8_convert_command_is_pinned_to_the_commit_naming_its_folder(pinned_hub, monkeypatch, name):
    """It named the branch: online, with main moved on since the HF cache recorded it, fp8-convert fetched the new
    commit and refused to convert it into the old commit's folder. Pinned, it converts what resolve promised, and
    ensure() uses that conversion (here, offline, main is still that commit)."""
    import shlex

    from fp8kit.cli import fp8_convert
    from fp8kit.registry import ensure, resolve

    answer = resolve(name, "dynamic")
    argv = shlex.split(answer.convert_command)
    assert argv[:2] == ["fp8-convert", f"me/tiny@{COMMIT}"] and argv[2] == answer.cache_dir, argv
    result = CliRunner().invoke(fp8_convert, argv[1:])
    assert result.exit_code == 0, result.output
    monkeypatch.setattr("fp8kit.converter.convert", _no_conversion)
    assert str(ensure(name, "dynamic")) == answer.cache_dir and resolve(name, "dynamic").cached


@pytest.mark.parametrize("args", [["resolve", ""], ["resolve", "   "], ["convert", ""]])
def test_an_empty_name_is_refused_not_taken_for_the_current_folder(tmp_path, llama_dir, monkeypatch, args):
    """Path("") is the current folder: `resolve "$MODEL"` with MODEL unset, run inside a checkpoint, planned (and
    ensure() made) a conversion of that folder."""
    from fp8kit.cli import fp8_convert
    from fp8kit.registry import ensure

    monkeypatch.chdir(llama_dir)
    if args[0] == "convert":
        result = CliRunner().invoke(fp8_convert, ["", str(tmp_path / "out"), "--scheme", "dynamic"])
        needle = "an empty SRC"
    else:
        result = CliRunner().invoke(main, args)
        needle = "an empty model name"
        with pytest.raises(Exception, match=needle):
            ensure(args[1], "dynamic")
    assert result.exit_code == 1 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "fp8cache").exists() and not (tmp_path / "out").exists()


def test_a_tilde_path_of_an_unknown_user_is_one_line(tmp_path):
    import pwd

    user = "fp8kit-no-such-user"
    with pytest.raises(KeyError):
        pwd.getpwnam(user)
    for args in (["resolve", f"~{user}/model"], ["cache", "rm", f"~{user}/model"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
        assert result.stderr.startswith("error: a path starting with '~' cannot be expanded"), result.stderr


def test_registering_a_listed_repo_again_keeps_the_overlay_readable(tmp_path):
    """Two publish runs of one repo each found it unlisted before uploading; the second append listed it twice, and
    every registry command then refused the overlay."""
    from fp8kit.errors import Fp8kitError
    from fp8kit.registry.catalog import Variant, append_to_overlay

    variant = Variant("me/tiny-FP8-Dynamic", "tiny", "dynamic", "compressed-tensors", ("dynamic",), ("org/tiny",),
                      "overlay")
    append_to_overlay(variant)
    text = (tmp_path / "overlay.toml").read_text()
    # the same repo spelled in other case, as publish's own check (outside the lock) compares it
    append_to_overlay(Variant("ME/tiny-FP8-Dynamic", *[getattr(variant, f) for f in ("family", "scheme", "format",
                                                                                     "serves", "base", "source")]))
    append_to_overlay(variant)  # the same entry: nothing to add
    assert (tmp_path / "overlay.toml").read_text() == text
    assert [v.repo_id for v in load() if v.source == "overlay"] == ["me/tiny-FP8-Dynamic"]
    other = Variant("me/tiny-FP8-Dynamic", "tiny", "block", "compressed-tensors", ("block",), ("org/tiny",), "overlay")
    with pytest.raises(Fp8kitError, match="lists me/tiny-FP8-Dynamic already, as dynamic"):
        append_to_overlay(other)
    assert [v.scheme for v in load() if v.source == "overlay"] == ["dynamic"]


def test_a_killed_fp8_convert_into_the_cache_is_named_and_cleaned_up(tmp_path, llama_dir, monkeypatch):
    """The command resolve prints, killed outright: its partial folder was listed without a NAME for `cache rm`, and
    once a later run finished the entry, nothing ever removed the partial folder (ensure() returned early)."""
    import shlex
    import shutil

    from fp8kit.cli import fp8_convert
    from fp8kit.registry import ensure, resolve
    from fp8kit.registry.cache import entry_lock

    src = tmp_path / "tiny"
    shutil.copytree(llama_dir, src)
    answer = resolve(str(src), "dynamic")
    argv = shlex.split(answer.convert_command)
    entry = Path(answer.cache_dir)
    entry_lock(answer.cache_dir, str(src))  # what fp8-convert does first, then killed while converting
    stale = killed_partial(entry.parent / f".{entry.name}.partial-killed")
    (stale / "model.safetensors").write_bytes(b"half")
    [row] = json.loads(CliRunner().invoke(main, ["cache", "list", "--json"]).stdout)
    assert (row["name"], row["status"]) == (str(src.resolve()), "unfinished")

    result = CliRunner().invoke(fp8_convert, argv[1:])  # run again: removes what the killed run left
    assert result.exit_code == 0, result.output
    assert not stale.exists() and ensure(str(src), "dynamic") == entry

    killed_partial(stale)  # killed again beside the finished entry: ensure() tidies it up
    assert ensure(str(src), "dynamic") == entry and not stale.exists()


@pytest.mark.parametrize("linked", ["model folder", "entry", "beside the entry"])
def test_fp8_convert_into_an_entry_linked_elsewhere_is_recorded(tmp_path, llama_dir, linked):
    """A model folder of the cache linked to another disk: resolving OUT put the entry outside the cache, so the
    command `fp8kit resolve` prints took no entry lock and recorded nothing, and resolve planned it again. The entry
    folder itself linked there (not yet made): its resolved parent was compared with the commit folder, and the
    command was refused as converting "inside the cache" into another folder."""
    import shlex
    import shutil

    from fp8kit.cli import fp8_convert
    from fp8kit.registry import resolve
    from fp8kit.registry.cache import entry_lock

    src = tmp_path / "tiny"
    shutil.copytree(llama_dir, src)
    answer = resolve(str(src), "dynamic")
    entry = Path(answer.cache_dir)
    (tmp_path / "disk2").mkdir()
    if linked == "model folder":
        entry.parent.parent.parent.mkdir(parents=True)
        entry.parent.parent.symlink_to(tmp_path / "disk2")
        written = tmp_path / "disk2" / entry.parent.name / entry.name
    elif linked == "entry":
        entry.parent.mkdir(parents=True)
        written = tmp_path / "disk2" / "dynamic"
        entry.symlink_to(written)
    else:  # another name in the commit folder for the entry: its lock is the entry's, not one of that name
        entry.parent.mkdir(parents=True)
        written = entry
        (entry.parent / "mine").symlink_to(entry.name)
        lock = entry_lock(entry.parent / "mine", str(src))
        assert lock is not None and Path(lock.lock_file).name == entry.name + ".lock"
        # a folder of its own name there (no entry ensure() uses, but the commit's folder): its own lock
        assert Path(entry_lock(entry.parent / "custom", str(src)).lock_file).name == "custom.lock"
    lock = entry_lock(entry, str(src))
    assert lock is not None and Path(lock.lock_file).name == entry.name + ".lock"
    result = CliRunner().invoke(fp8_convert, shlex.split(answer.convert_command)[1:])
    assert result.exit_code == 0, result.output
    assert resolve(str(src), "dynamic").cached and (written / "fp8kit-entry.json").is_file()


@pytest.mark.skipif(sys.platform == "win32", reason="flock")
def test_the_cache_never_removes_a_live_conversion_s_folder(tmp_path, llama_dir):
    """An fp8-convert into the cache entry spelled through a symlink took no entry lock, and ensure() (or `cache rm`)
    deleted its live partial folder: it failed with "cannot write ... free disk space". The symlinked spelling takes
    the entry's lock now, and a folder whose writer holds its lock is never removed, whatever lock the entry has."""
    import fcntl
    import shutil

    from fp8kit.converter.output import WRITING
    from fp8kit.registry import ensure, resolve
    from fp8kit.registry.cache import entry_lock, remove_unfinished

    src = tmp_path / "tiny"
    shutil.copytree(llama_dir, src)
    entry = Path(resolve(str(src), "dynamic").cache_dir)
    entry.parent.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(entry.parent)
    assert entry_lock(link / entry.name, str(src)) is not None  # it was None: not seen as inside the cache
    live, dead = (entry.parent / f".{entry.name}.partial-{n}" for n in ("live", "dead"))
    for folder in (live, dead):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
        (folder / WRITING).touch()
    held = os.open(live / WRITING, os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        remove_unfinished(entry)
        assert live.exists() and not dead.exists()
        assert ensure(str(src), "dynamic") == entry and live.exists()  # its tidying leaves it too
        result = CliRunner().invoke(main, ["cache", "rm", str(src)])
        assert result.exit_code == 1 and live.exists(), result.output
        assert "a conversion is running there" in result.stderr, result.stderr
    finally:
        os.close(held)
    remove_unfinished(entry)  # its writer gone
    assert not live.exists()


def test_cache_rm_of_a_killed_local_conversion_after_its_checkpoint_is_gone(tmp_path, llama_dir):
    import shutil

    from fp8kit.registry.cache import cached_conversion, entry_name, model_dir

    local = tmp_path / "mine"
    shutil.copytree(llama_dir, local)
    entry = Path(cached_conversion(str(local), "dynamic"))
    shutil.rmtree(entry)
    killed_partial(entry.parent / f".{entry_name('dynamic')}.partial-killed")
    folder = model_dir(str(local))
    shutil.rmtree(local)
    [row] = json.loads(CliRunner().invoke(main, ["cache", "list", "--json"]).stdout)
    result = CliRunner().invoke(main, ["cache", "rm", row["name"]])
    assert result.exit_code == 0, result.output
    assert not folder.exists()


@pytest.mark.parametrize("revision", ["main", COMMIT])
def test_resolve_reports_an_entry_of_the_old_pinned_layout_as_cached(pinned_hub, monkeypatch, revision):
    from fp8kit.registry import ensure, resolve
    from fp8kit.registry.cache import cached_conversion

    name = f"me/tiny@{revision}"
    entry = cached_conversion(name, "dynamic")
    legacy = pinned_hub / f"me--tiny@{revision}" / COMMIT / entry.name
    legacy.parent.mkdir(parents=True)
    entry.rename(legacy)
    answer = resolve(name, "dynamic")
    assert answer.cached and answer.convert_command is None and answer.cache_dir == str(legacy)
    monkeypatch.setattr("fp8kit.converter.convert", _no_conversion)
    assert ensure(name, "dynamic") == entry  # moved into the current layout, not converted again


def test_cache_rm_of_a_folder_another_cache_rm_removed_meanwhile(tmp_path, monkeypatch):
    """Two `cache rm --all` at once: one failed with "cannot delete (No such file or directory)"."""
    import shutil

    from fp8kit.registry import cache

    folder = tmp_path / "fp8cache" / "org--m"
    (folder / "c" / "e").mkdir(parents=True)
    real = shutil.rmtree
    calls = []

    def racing(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 1:  # the other process deletes it first
            real(path)
            raise FileNotFoundError(2, "No such file or directory", str(Path(path) / "c"))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", racing)
    cache._delete(folder)
    assert not folder.exists()


def test_an_overlay_is_read_as_utf8_whatever_the_locale(tmp_path):
    """read_text() decoded with the locale's encoding: under LC_ALL=C without UTF-8 mode a valid UTF-8 overlay was
    refused as "not UTF-8"."""
    overlay = tmp_path / "overlay.toml"
    overlay.write_text('# uploads of the Zürich team\n[[variant]]\nrepo_id = "me/tiny-FP8-Dynamic"\nfamily = "tiny"\n'
                       'scheme = "dynamic"\nformat = "compressed-tensors"\nserves = ["dynamic"]\nbase = ["org/tiny"]\n',
                       encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0",
           "FP8KIT_REGISTRY": str(overlay)}
    code = ("import locale; from fp8kit.registry import load; "
            "print(locale.getpreferredencoding(False), [v.repo_id for v in load() if v.source == 'overlay'])")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert proc.stdout.split()[0] != "UTF-8" and "me/tiny-FP8-Dynamic" in proc.stdout, proc.stdout


def test_cache_rm_strips_a_pasted_name(tmp_path):
    from fp8kit.registry.cache import model_dir

    name = "me/tiny"
    (model_dir(name) / "c0ffee" / "e").mkdir(parents=True)
    (model_dir(name) / "c0ffee" / "dynamic-compressed-tensors-fp8kit0.lock").write_text("")
    result = CliRunner().invoke(main, ["cache", "rm", f"  {name} "])
    assert result.exit_code == 0 and not model_dir(name).exists(), result.output


def test_resolve_refuses_a_local_folder_fp8_convert_would_refuse(tmp_path, llama_dir):
    """An FP8 checkpoint or a folder of pickle weights was answered with an fp8-convert command (exit 0) that then
    refused it: resolve says fp8-convert's reason itself."""
    import shutil

    from fp8kit import convert

    fp8 = tmp_path / "fp8"
    convert(llama_dir, fp8, scheme="dynamic")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(llama_dir / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    for folder, reason in ((fp8, "checkpoint is already quantized"), (pickled, "only pickle weights")):
        result = CliRunner().invoke(main, ["resolve", str(folder)])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(folder) in lines[0] and reason in lines[0], result.stderr
    result = CliRunner().invoke(main, ["resolve", str(llama_dir)])
    assert result.exit_code == 0 and "will convert and cache" in result.stdout, result.output
