"""The allocation-trace replay behind grpo_gpu's per-window memory report, on a trace in torch's format."""

from evals.memory_trace import live_at_peak, site

TORCH = {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"}
OURS = {"filename": "/work/main/fp8kit/rl/fp8_linear.py", "line": 42, "name": "forward"}
VLLM = {"filename": "/opt/gpu-site/vllm/model_executor/layers/linear.py", "line": 7, "name": "apply"}
INDUCTOR = {"filename": "/tmp/torchinductor_root/ab/cabc.py", "line": 99, "name": "call"}


def event(action, addr, size, *frames):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames), "stream": 0}


def test_site_names_the_allocating_line_and_the_code_that_led_there():
    assert site([TORCH, OURS]) == "fp8kit/rl/fp8_linear.py:42 forward"
    assert site([INDUCTOR, TORCH, VLLM]) == "vllm/model_executor/layers/linear.py:7 apply <- inductor:cabc.py:99 call"
    vllm_cache = {"filename": "/root/.cache/vllm/torch_compile_cache/torch_aot_compile/7b6e/inductor_cache/ou/"
                  "coud.py", "line": 5, "name": "call"}  # where vLLM keeps its compiled graphs: generated, not vLLM's
    assert site([vllm_cache, VLLM]) == "vllm/model_executor/layers/linear.py:7 apply <- inductor:coud.py:5 call"
    assert site([vllm_cache]) == "inductor:coud.py:5 call"
    assert site([TORCH]) == "torch/nn/functional.py:10 linear"  # only torch: its own frame
    assert site([]) == "unknown (no stack recorded)"


def test_live_at_peak_finds_the_peak_moment_and_who_holds_it():
    trace = [
        event("free_completed", 1, 50),  # an allocation from before the window: the baseline drops by 50
        event("segment_alloc", 1000, 400, INDUCTOR, VLLM),
        event("alloc", 10, 100, TORCH, OURS),
        event("alloc", 11, 300, INDUCTOR, VLLM),
        event("alloc", 12, 30, TORCH, OURS),
        event("free_requested", 11, 300),  # requested only: still held until completed
        event("free_completed", 11, 300),
        event("segment_alloc", 2000, 100, TORCH, OURS),
        event("alloc", 13, 200, TORCH, OURS),  # 100 + 30 + 200 - 50 = 280 < the earlier 380
        event("segment_free", 1000, 400),
    ]
    allocated = live_at_peak(trace, "allocated")
    assert allocated["peak_bytes_above_start"] == 100 + 300 + 30 - 50
    assert allocated["events_to_peak"] == 5
    assert allocated["live_bytes_at_peak"] == 430
    assert allocated["sites"] == [
        {"site": site([INDUCTOR, VLLM]), "bytes": 300, "count": 1},
        {"site": "fp8kit/rl/fp8_linear.py:42 forward", "bytes": 130, "count": 2},
    ]
    reserved = live_at_peak(trace, "reserved")
    assert reserved["peak_bytes_above_start"] == 500
    assert [s["bytes"] for s in reserved["sites"]] == [400, 100]
    top1 = live_at_peak(trace, "allocated", top=1)
    assert len(top1["sites"]) == 1 and top1["other_sites_bytes"] == 130


def test_a_window_that_only_frees_has_no_peak():
    summary = live_at_peak([event("free_completed", 1, 50)], "allocated")
    assert summary["peak_bytes_above_start"] == 0 and summary["sites"] == []
