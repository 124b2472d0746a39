"""grpo_gpu's summary: the issue's ratios and each variant's mean mismatch KL, computed on CPU from stored runs."""

import pytest

from evals import grpo_gpu
from evals.grpo_gpu import summarize


def test_summary_ratios_and_mismatch():
    runs = {
        "llama-8b/bf16": {"peak_device_memory_bytes": 200, "peak_torch_allocated_bytes": 100, "mismatch_kl": [0.1, 0.3]},
        "llama-8b/fp8": {"peak_device_memory_bytes": 150, "peak_torch_allocated_bytes": 60, "mismatch_kl": [1.0],
                         "rollout_vs_standalone_vllm": 0.99},
        "llama-8b/fp8-nocasts": {"error": "did not finish within 560 s"},
        "tinyllama-1.1b/bf16": {"peak_device_memory_bytes": 1, "mismatch_kl": [5.0]},  # another shape: ignored
    }
    summary = summarize(runs, "llama-8b")
    assert summary["peak_memory_ratio_fp8_vs_bf16"] == pytest.approx(0.75)
    assert summary["peak_torch_allocated_ratio_fp8_vs_bf16"] == pytest.approx(0.6)
    assert summary["rollout_vs_standalone_vllm"] == 0.99
    assert "peak_memory_ratio_fp8_kv8_vs_bf16" not in summary  # no fp8-kv8 run
    assert summary["mismatch_kl_mean"] == pytest.approx({"bf16": 0.2, "fp8": 1.0})
    assert summary["peak_memory_ratio_vs_bf16_same_options"] == pytest.approx({"fp8": 0.75})
    assert summarize({"llama-8b/fp8": runs["llama-8b/fp8"]}, "llama-8b") == {"rollout_vs_standalone_vllm": 0.99,
                                                                           "mismatch_kl_mean": {"fp8": 1.0}}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA to fail the build")
def test_failed_build_stops_the_run_with_one_line(tmp_path):
    """Building runs in a child; when it fails the run stops before any variant and writes no results."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "grpo.json"
    proc = subprocess.run([sys.executable, str(root / "evals/grpo_gpu.py"), "--shape", "tiny", "--variants", "bf16",
                           "--workdir", str(tmp_path / "work"), "--out", str(out), "--child-timeout", "120"],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode != 0
    assert "building the tiny checkpoints failed" in proc.stderr
    assert not out.exists()


def test_variants_with_engine_options_compare_to_bf16_with_the_same_options():
    runs = {
        "llama-8b/bf16": {"peak_device_memory_bytes": 200},
        "llama-8b/bf16+mbt2048": {"peak_device_memory_bytes": 160},
        "llama-8b/fp8+mbt2048": {"peak_device_memory_bytes": 100},
        "llama-8b/fp8-kv8+mbt2048": {"peak_device_memory_bytes": 80},
        "llama-8b/fp8-kv8+mbt4096": {"peak_device_memory_bytes": 90},  # no bf16+mbt4096: no ratio
        # under one budget both fill it: the KV tokens that fit are compared, not the peaks
        "llama-8b/bf16+gpu20": {"peak_device_memory_bytes": 210, "kv_cache_tokens": 30000},
        "llama-8b/fp8+gpu20": {"peak_device_memory_bytes": 211, "kv_cache_tokens": 75000},
        "llama-8b/fp8-kv8+gpu20": {"peak_device_memory_bytes": 209, "kv_cache_tokens": 150000},
        "llama-8b/fp8+gpu16": {"peak_device_memory_bytes": 170, "kv_cache_tokens": 9000},  # no bf16+gpu16
        "llama-8b/fp8-casts": {"peak_device_memory_bytes": 120},  # a name older results files hold: read, not refused
    }
    summary = summarize(runs, "llama-8b")
    assert summary["peak_memory_ratio_vs_bf16_same_options"] == pytest.approx({"fp8+mbt2048": 0.625,
                                                                               "fp8-kv8+mbt2048": 0.5,
                                                                               "fp8-casts": 0.6})
    assert summary["kv_cache_tokens_ratio_vs_bf16_same_budget"] == pytest.approx({"fp8+gpu20": 2.5,
                                                                                  "fp8-kv8+gpu20": 5.0})


def test_variant_names_and_options():
    from evals.grpo_gpu import engine_kwargs, memory_utilization, split_variant, variant_dtype

    assert split_variant("fp8-kv8+mbt2048") == ("fp8-kv8", {"max_num_batched_tokens": 2048})
    assert engine_kwargs("fp8-kv8+mbt2048")["max_num_batched_tokens"] == 2048
    assert engine_kwargs("fp8-kv8+mbt2048")["kv_cache_dtype"] == "fp8"
    assert "max_num_batched_tokens" not in engine_kwargs("bf16")
    # a budget lets vLLM size the KV cache: no fixed bytes, and the budget is not a vLLM argument
    assert split_variant("fp8-kv8+gpu20+mbt2048") == ("fp8-kv8", {"budget_gib": 20, "max_num_batched_tokens": 2048})
    assert engine_kwargs("fp8-kv8+gpu20") == {"kv_cache_dtype": "fp8"}
    assert engine_kwargs("bf16")["kv_cache_memory_bytes"] == 2 << 30
    assert memory_utilization("bf16+gpu20", 80 << 30) == pytest.approx(0.25)
    assert memory_utilization("bf16", 80 << 30) == 0.5
    # float16 is the model's dtype, not an engine argument
    assert split_variant("fp8+fp16") == ("fp8", {"dtype": "float16"})
    assert "dtype" not in engine_kwargs("fp8+fp16") and engine_kwargs("fp8+fp16") == engine_kwargs("fp8")
    assert str(variant_dtype("fp8+fp16")) == "torch.float16" and str(variant_dtype("bf16")) == "torch.bfloat16"
    assert split_variant("bf16+compile+mbt4096") == ("bf16", {"torch_compile": True, "max_num_batched_tokens": 4096})
    assert engine_kwargs("fp8+compile") == engine_kwargs("fp8")  # the trainer's setting, not vLLM's
    # the block checkpoint is fp8-block's alone; every other FP8 variant runs on the per-channel one
    assert [grpo_gpu.checkpoint_of(v) for v in ("bf16+fp16", "fp8-kv8+gpu20", "fp8-block+compile", "fp8")] == [
        "bf16", "fp8", "fp8-block", "fp8"]
    assert engine_kwargs("fp8-block") == engine_kwargs("fp8")
    with pytest.raises(SystemExit, match="budget of 96 GiB is not below this GPU's 80.0 GiB"):
        memory_utilization("fp8+gpu96", 80 << 30)
    for bad in ("fp8+mbt", "fp8+fast", "fp9", "fp8+gpu0", "fp8+gpu1.5", "fp8+fp32"):
        with pytest.raises(SystemExit, match="variant"):
            split_variant(bad)


def test_unknown_variant_stops_the_run_before_anything_is_built(tmp_path):
    """The variant names are checked before the build child starts: one line, no work directory, no results."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out, work = tmp_path / "grpo.json", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(root / "evals/grpo_gpu.py"), "--shape", "tiny", "--variants",
                           "bf16,fp8+mbtx", "--workdir", str(work), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == ("variant 'fp8+mbtx': unknown option 'mbtx' (known: "
                                                   f"{grpo_gpu.VARIANT_OPTIONS})")
    assert not work.exists() and not out.exists()


def test_a_run_is_not_written_into_a_pooled_headline(tmp_path):
    """evals/results/grpo_gpu.json's rollout ratio is pooled by rollout_rounds.py: a run aimed at such a file stops
    before anything is built, with one line, and leaves the file as it was; a file of runs is written into."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out, work = tmp_path / "grpo_gpu.json", tmp_path / "work"
    text = json.dumps({"rollout_vs_standalone_vllm": 1.016, "rollout_vs_standalone_vllm_from": {"rounds": 5}})
    out.write_text(text)
    proc = subprocess.run([sys.executable, str(root / "evals/grpo_gpu.py"), "--shape", "tiny", "--variants", "bf16",
                           "--workdir", str(work), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{out}: a headline pooled by evals/rollout_rounds.py") and "--headline" in line
    assert not work.exists() and out.read_text() == text
    out.write_text(json.dumps({"runs": {}}))
    grpo_gpu.refuse_pooled_headline(out)  # a file of runs: no refusal
    grpo_gpu.refuse_pooled_headline(tmp_path / "absent.json")


def test_peak_memory_keeps_each_phases_peak_and_reads_reserved_every_nth_sample(monkeypatch):
    import threading
    import time

    from evals import grpo_gpu

    reads = {"used": 0, "reserved": 0}
    used = {"generation": [5, 9, 7], "training": [3, 4, 2]}  # what the device reports in each phase, cycled
    lock = threading.Lock()
    peak = grpo_gpu.PeakMemory(interval=0.0005, reserved_every=4)

    def device_used():
        with lock:
            reads["used"] += 1
            values = used.get(peak.phase, [1])
            return values[reads["used"] % len(values)]

    def torch_reserved():
        with lock:
            reads["reserved"] += 1
        return {"generation": 6, "training": 8}.get(peak.phase, 0)

    monkeypatch.setattr(grpo_gpu, "device_used", device_used)
    monkeypatch.setattr(grpo_gpu, "torch_reserved", torch_reserved)
    with peak:
        for phase in ("generation", "training", "other"):
            peak.phase = phase
            start = reads["used"]
            while reads["used"] - start < 40:  # enough samples in this phase to see every value
                time.sleep(0.001)
    assert peak.phases["generation"]["device_used_peak"] == 9
    assert peak.phases["training"]["device_used_peak"] == 4
    assert peak.peak == 9
    assert peak.phases["training"]["torch_reserved_peak"] == 8
    assert reads["reserved"] <= reads["used"] // 4 + 1  # the costly read, one sample in four


def test_gc_pauses_time_the_collector_and_count_its_full_collections():
    import gc

    automatic = gc.isenabled()
    gc.disable()  # only the collections made here: an automatic one could land between since() and the exit
    try:
        with grpo_gpu.GCPauses() as pauses:
            mark = pauses.mark()
            gc.collect(0)
            gc.collect(2)
            gc.collect(2)
            seen = pauses.since(mark)
        gc.collect(2)  # after the block: not counted
    finally:
        if automatic:
            gc.enable()
    assert seen["gc_full_collections"] == 2 and seen["gc_s"] > 0
    assert pauses.full == 2 and pauses.seconds == seen["gc_s"]


def test_gc_heap_counts_frozen_objects_apart_from_tracked_ones():
    import gc

    held = [[i] for i in range(5000)]  # lists are tracked by the collector
    before = grpo_gpu.gc_heap()
    gc.freeze()
    try:
        after = grpo_gpu.gc_heap()
    finally:
        gc.unfreeze()
    assert after["frozen_objects"] - before["frozen_objects"] >= len(held)
    assert before["tracked_objects"] - after["tracked_objects"] >= len(held)
