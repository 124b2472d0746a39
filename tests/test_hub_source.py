"""SRC as a Hub repo id, served from a locally built HF cache with HF_HUB_OFFLINE=1, or downloaded from a local fake
Hub (tests/fake_hub.py) through the real huggingface_hub client, in a child process (it reads its endpoint at
import)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from fake_hub import TOKEN, FakeHub

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, llama_dir):
    cache = tmp_path / "hub"
    repo = cache / "models--fp8kit-test--tiny-llama"
    shutil.copytree(llama_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def cli(cache, *args):
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    code = "from fp8kit.cli import fp8_convert; fp8_convert()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True)


def test_repo_id_from_offline_cache(hf_cache, tmp_path):
    out = tmp_path / "out"
    proc = cli(hf_cache, "fp8kit-test/tiny-llama", out, "--scheme", "dynamic", "--json")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    proc = cli(hf_cache, f"fp8kit-test/tiny-llama@{COMMIT}", tmp_path / "pinned", "--scheme", "block")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() != b""


def test_repo_missing_from_offline_cache(hf_cache, tmp_path):
    out = tmp_path / "out"
    proc = cli(hf_cache, "fp8kit-test/absent-model", out, "--scheme", "dynamic")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "fp8kit-test/absent-model" in lines[0] and "HF_HUB_OFFLINE" in lines[0], proc.stderr
    assert "nor a folder" not in lines[0]
    assert not out.exists()
    # a mistyped local path reads as a repo id: where its first folder exists, the line says it is no folder either
    (tmp_path / "models").mkdir()
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", "from fp8kit.cli import fp8_convert; fp8_convert()", "models/lama",
                           str(out), "--scheme", "dynamic"], env=env, capture_output=True, text=True, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert f"(nor a folder: {tmp_path.resolve() / 'models' / 'lama'} does not exist)" in lines[0], proc.stderr


def test_sharded_repo_as_the_hf_cache_stores_it(tmp_path, llama_dir):
    """Snapshot files are symlinks into ../../blobs: the shards an index names are still the checkpoint's own."""
    import hashlib

    from fp8kit.models import build_checkpoint

    sharded = build_checkpoint(tmp_path / "sharded", "llama", seed=4, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    repo = tmp_path / "hub" / "models--fp8kit-test--sharded"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for f in sharded.iterdir():
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / blob)
        (repo / "snapshots" / COMMIT / f.name).symlink_to(f"../../blobs/{blob}")
    proc = cli(tmp_path / "hub", "fp8kit-test/sharded", tmp_path / "out", "--scheme", "dynamic")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("name", ["org/bar.git", "org/a--b", "org/" + "a" * 100])
def test_repo_ids_the_hub_refuses_are_one_line(tmp_path, name):
    proc = cli(tmp_path / "hub", name, tmp_path / "out", "--scheme", "dynamic")
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "not a valid Hub repo id" in proc.stderr and not (tmp_path / "out").exists()


def test_dropped_connection_is_one_line(tmp_path):
    """huggingface_hub 1.x raises httpx errors, which are not OSErrors."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def drop():
        while True:
            conn, _ = server.accept()
            conn.recv(65536)
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{server.getsockname()[1]}", HF_HUB_CACHE=str(tmp_path / "hub"),
               HF_HUB_ETAG_TIMEOUT="3", HF_HUB_DOWNLOAD_TIMEOUT="3")
    code = "from fp8kit.cli import fp8_convert; fp8_convert()"
    proc = subprocess.run([sys.executable, "-c", code, "someorg/somemodel", str(tmp_path / "out"), "--scheme",
                           "dynamic"], env=env, capture_output=True, text=True, timeout=120)
    server.close()
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "someorg/somemodel: download failed" in proc.stderr and not (tmp_path / "out").exists()


RESOLVE = """
import json
from fp8kit.converter import source
path = source.resolve("me/tiny")
print(json.dumps({"files": sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()),
                  "weights": [p.name for p in source.weight_files(path)]}))
"""


def test_weights_transformers_does_not_load_are_not_downloaded(tmp_path, llama_dir):
    """Mistral repos hold consolidated.safetensors (the whole model again, in Mistral's names) beside the shards;
    original/ and a LoRA adapter's weights are not the model's either: weight_files() never reads them."""
    hub = FakeHub(tmp_path / "hub-store")
    try:
        files = {p.name: p.read_bytes() for p in llama_dir.iterdir() if p.is_file()}
        weights = files["model.safetensors"]
        hub.add_repo("me/tiny", {**files, "consolidated.safetensors": weights, "original/model.safetensors": weights,
                                 "adapter_model.safetensors": weights, "chat_templates/tool.jinja": b"{{ x }}"})
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN)
        proc = subprocess.run([sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, timeout=300)
    finally:
        hub.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["files"] == sorted([*files, "chat_templates/tool.jinja"]), got
    assert got["weights"] == ["model.safetensors"]
