"""On a CUDA machine with vLLM: GRPO with vLLM rollouts in the process, one copy of the weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fp8", "bf16"])
def test_vllm_shares_the_trainers_weights(tmp_path, variant):
    pytest.importorskip("vllm")
    out = tmp_path / "grpo.json"
    proc = subprocess.run([sys.executable, str(ROOT / "evals/grpo_gpu.py"), "--shape", "tiny", "--variants", variant,
                           "--steps", "3", "--skip-standalone", "--trace-step", "2", "--workdir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())["runs"][f"tiny/{variant}"]
    assert "error" not in run, run
    weights = run["weights"]
    assert weights["trainer_base_tensors"] > 0
    assert weights["trainer_base_tensors_not_vllm_storage"] == 0  # every base tensor is a view of vLLM's storage
    assert weights["trainer_tensors_differing_from_checkpoint"] == []  # and holds the checkpoint's values
    # building the trainer allocated the LoRA parameters, not a second copy of the weights
    assert weights["trainer_allocated_bytes"] < 2 * weights["trainer_lora_bytes"] + (8 << 20)
    assert len(run["reward_curve"]) == 3
    # the first step's wake is a no-op (the engine starts awake); every later one maps the KV cache back
    assert len(run["wake_s"]) == 3 and all(0 <= w < 5 for w in run["wake_s"]), run["wake_s"]
    # the fixed 2 GiB KV cache, read back from the engine: tiny has 2 layers x 1 KV head x 128 dims, K and V,
    # 2 bytes each (bf16), so 1 KiB a token; vLLM rounds down to whole blocks
    assert 0 <= (2 << 30) // 1024 - run["kv_cache_tokens"] < 1024, run["kv_cache_tokens"]
    assert all(0.0 <= k < 0.05 for k in run["mismatch_kl"]), run["mismatch_kl"]
    # memory is attributed to each phase of a step, and releasing the KV cache for training shows in it
    phases, snaps = run["memory_by_phase"], run["memory_snapshots"]
    assert {"generation", "training"} <= phases.keys()
    assert snaps["context_only"]["device_used"] < snaps["loaded"]["device_used"]
    assert snaps["first_sleep"]["device_used"] < phases["generation"]["device_used_peak"]
    # step 2's allocation trace says what held the memory at each phase's peak
    trace = run["memory_trace"]
    assert trace["step"] == 2 and not trace["generation"]["wrapped"]
    for phase in ("generation", "training"):
        allocated = trace[phase]["allocated"]
        assert allocated["peak_bytes_above_start"] > 0 and allocated["sites"], (phase, allocated)
        assert allocated["live_bytes_at_peak"] >= allocated["sites"][0]["bytes"]
