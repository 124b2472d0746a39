"""evals/vllm_load.py checks its --variants before building a model or importing vLLM (CPU)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_unknown_variant_is_refused_before_any_work(tmp_path):
    out = tmp_path / "vllm_load.json"
    proc = subprocess.run([sys.executable, str(ROOT / "evals/vllm_load.py"), "--variants", "bf16,dynamic/fp16",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "--variants: unknown ['dynamic/fp16']; known: ['bf16', 'dynamic/compressed-tensors'" in proc.stderr
    assert "vllm" not in proc.stderr.lower().replace("vllm_load", "") and not out.exists()
