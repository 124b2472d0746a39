"""serve_bench: variant names are checked before an 8B model is built on the GPU; every timed pass gets new prompts."""

import pytest

from evals.serve_bench import parse_variant


def test_variant_names():
    assert parse_variant("tensor") == ("tensor", False, "auto")
    assert parse_variant("tensor+lm-head+kv-fp8") == ("tensor", True, "fp8")
    assert parse_variant("bf16+kv-fp8") == ("bf16", False, "fp8")
    with pytest.raises(SystemExit, match="the suffixes are"):
        parse_variant("tensor+kv8")
    with pytest.raises(SystemExit, match="fp8-convert schemes only"):
        parse_variant("vllm-online-fp8+lm-head")


def test_every_pass_gets_new_prompts():
    """Repeated prompts would be served from vLLM's prefix cache and time decode alone."""
    from evals.serve_bench import WORKLOADS, workload_prompts

    n, n_in, _ = WORKLOADS["short"]
    first, second = workload_prompts("short", 1), workload_prompts("short", 2)
    assert len(first) == n and all(len(p["prompt_token_ids"]) == n_in for p in first)
    assert first == workload_prompts("short", 1)  # the same prompts for every variant
    # no two prompts of the two passes share even their first 16-token block
    blocks = {tuple(p["prompt_token_ids"][:16]) for p in first}
    assert not blocks & {tuple(p["prompt_token_ids"][:16]) for p in second}


def test_pass_split():
    from evals.serve_bench import pass_split

    # 256 x 256 tokens at 16,384 tok/s: a 4.0 s pass, 0.175 s of it prefill, 255 decode steps of 15 ms
    assert pass_split("short", {"tok_s": 16384.0, "prefill_s": 0.175}) == {"prefill_s": 0.175,
                                                                         "decode_step_ms": pytest.approx(15.0)}
    assert pass_split("short", {"tok_s": 16384.0}) == {}


def test_summaries_compare_runs_measured_the_same_way():
    from evals.serve_bench import NEW_PROMPTS as new
    from evals.serve_bench import workload_summaries

    results = {
        "qwen3-8b/convert": {"tensor": {"seconds": 12.0}},
        "qwen3-8b/short/bf16": {"tok_s": 16000.0, "prefill_s": 0.8, "prompts": new},
        "qwen3-8b/short/tensor": {"tok_s": 20000.0, "prefill_s": 0.6, "prompts": new},
        "qwen3-8b/short/dynamic": {"tok_s": 22000.0},  # an older run on repeated prompts: no ratio against bf16
        "qwen3-8b/short/block": {"error": "engine did not finish within 240 s"},
        "qwen3-8b/long/dynamic": {"tok_s": 3900.0, "prompts": new},  # no long bf16 run: no long summary
        "llama-8b/short/bf16": {"tok_s": 17000.0, "prompts": new},
    }
    summaries = workload_summaries(results, "qwen3-8b")
    assert list(summaries) == ["qwen3-8b/short"]
    short = summaries["qwen3-8b/short"]
    assert set(short) == {"bf16", "tensor"}
    assert short["tensor"]["vs_bf16"] == pytest.approx(1.25)
    assert short["tensor"]["decode_step_ms"] == pytest.approx(1000 * (256 * 256 / 20000 - 0.6) / 255)
