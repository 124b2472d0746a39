"""Registry overlay writes that fail leave the file whole; `fp8kit cache rm` with a cache path that is a file."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fp8kit.cli import main
from fp8kit.registry import load

OVERLAY = '''# my uploads
[[variant]]
repo_id = "me/Qwen3-8B-FP8-Dynamic"
family = "qwen3"
scheme = "dynamic"
format = "compressed-tensors"
serves = ["dynamic"]
base = ["Qwen/Qwen3-8B"]
'''

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


def test_overlay_write_that_runs_out_of_space_leaves_the_file_whole(tmp_path):
    overlay = tmp_path / "overlay.toml"
    overlay.write_text(OVERLAY)
    # Files may grow to 20 bytes past the overlay's size: the new entry does not fit (a disk filling up).
    proc = subprocess.run([sys.executable, "-c", APPEND, str(len(OVERLAY) + 20)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith(f"{overlay}: cannot write") and len(proc.stdout.strip().splitlines()) == 1
    assert overlay.read_text() == OVERLAY
    assert [v.repo_id for v in load() if v.source == "overlay"] == ["me/Qwen3-8B-FP8-Dynamic"]
    assert not list(tmp_path.glob(".overlay.toml.*.tmp"))

    proc = subprocess.run([sys.executable, "-c", APPEND, str(1 << 20)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert overlay.read_text().startswith(OVERLAY)
    assert [v.repo_id for v in load() if v.source == "overlay"] == ["me/Qwen3-8B-FP8-Dynamic",
                                                                    "me/gemma-3-4b-it-FP8-Block"]


@pytest.mark.parametrize("args", [["--all"], ["org/model"]])
def test_cache_rm_when_the_cache_path_is_a_file_is_one_line(tmp_path, monkeypatch, args):
    not_a_folder = tmp_path / "fp8cache"
    not_a_folder.write_text("something else\n")
    result = CliRunner().invoke(main, ["cache", "rm", *args])
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


def test_concurrent_overlay_writers_keep_every_entry(tmp_path):
    """Publishing jobs in parallel each append their uploads: the lock beside the file serializes the
    read-append-replace, so no writer's entries are lost to another's replace."""
    (tmp_path / "overlay.toml").write_text(OVERLAY)
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


def test_registry_list_knows_the_overlay_s_families(tmp_path):
    (tmp_path / "overlay.toml").write_text(OVERLAY.replace('family = "qwen3"', 'family = "mine"'))
    result = CliRunner().invoke(main, ["registry", "list", "--family", "mine"])
    assert result.exit_code == 0 and "me/Qwen3-8B-FP8-Dynamic" in result.stdout


@pytest.mark.parametrize("revision,commit", [
    ("abc123", "<commit of abc123, fetched at conversion>"),
    ("0123456789abcdef0123456789abcdef01234567", "0123456789abcdef0123456789abcdef01234567"),
])
def test_resolve_of_a_pinned_revision_shows_the_cache_layout(tmp_path, monkeypatch, revision, commit):
    """`{org}--{name}/{source commit}/...`: the folder is the repo's, never `name@revision`, and the commit is
    the pinned one (or says which revision it will be fetched from), never main's."""
    from fp8kit.registry import resolve

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    answer = resolve(f"Qwen/Qwen3-8B@{revision}", "dynamic")
    assert answer.cache_dir == str(tmp_path / "fp8cache" / "Qwen--Qwen3-8B" / commit
                                   / "dynamic-compressed-tensors-fp8kit0.1.0")
    result = CliRunner().invoke(main, ["resolve", f"Qwen/Qwen3-8B@{revision}", "--scheme", "dynamic"])
    assert result.exit_code == 0 and answer.cache_dir in result.stdout


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
