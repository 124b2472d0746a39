"""A Hub source is downloaded with only the files a conversion reads, from a local fake Hub (tests/fake_hub.py)
through the real huggingface_hub client (in a child process: huggingface_hub reads its endpoint at import)."""

import json
import os
import subprocess
import sys

from fake_hub import TOKEN, FakeHub

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
