"""SRC as a Hub repo id, served from a locally built HF cache with HF_HUB_OFFLINE=1."""

import os
import shutil
import subprocess
import sys

import pytest

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
    assert not out.exists()
