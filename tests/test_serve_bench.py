"""serve_bench: variant names are checked before an 8B model is built on the GPU; every timed pass gets new prompts."""

import json

import pytest

from evals.serve_bench import engine_log_facts, parse_variant


def test_variant_names():
    assert parse_variant("tensor") == ("tensor", False, "auto", False)
    assert parse_variant("tensor+lm-head+kv-fp8") == ("tensor", True, "fp8", False)
    assert parse_variant("bf16+kv-fp8") == ("bf16", False, "fp8", False)
    assert parse_variant("dynamic+kv-scales") == ("dynamic", False, "auto", True)
    with pytest.raises(SystemExit, match="the suffixes are"):
        parse_variant("tensor+kv8")
    with pytest.raises(SystemExit, match=r"\+lm-head applies to fp8-convert schemes only"):
        parse_variant("vllm-online-fp8+lm-head")
    with pytest.raises(SystemExit, match=r"\+kv-scales applies to fp8-convert schemes only"):
        parse_variant("bf16+kv-scales")


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


def test_summaries_prefer_the_bf16_engine_of_the_same_call():
    """Runs accumulated over several calls: each variant against its own call's BF16 engine, else "bf16"."""
    from evals.serve_bench import NEW_PROMPTS as new
    from evals.serve_bench import workload_summaries

    results = {
        "qwen3-8b/short/bf16": {"tok_s": 16000.0, "prompts": new, "call": 0},
        "qwen3-8b/short/dynamic": {"tok_s": 20000.0, "prompts": new, "call": 0},
        "qwen3-8b/short/tensor+custom_ops=+quant_fp8": {"tok_s": 21000.0, "prompts": new, "call": 1},
        "qwen3-8b/short/bf16+custom_ops=+quant_fp8": {"tok_s": 15000.0, "prompts": new, "call": 1},
        "qwen3-8b/short/bf16+kv-fp8": {"tok_s": 15500.0, "prompts": new, "call": 1},  # not a BF16 reference
        "qwen3-8b/short/block+deepgemm": {"tok_s": 19200.0, "prompts": new, "call": 2},  # no BF16 in its call
        "qwen3-8b/short/dynamic+kv-fp8": {"tok_s": 20400.0, "prompts": new, "call": 3},
        "qwen3-8b/short/bf16@call3": {"tok_s": 17000.0, "prompts": new, "call": 3},  # a repeat in a later call
    }
    short = workload_summaries(results, "qwen3-8b")["qwen3-8b/short"]
    assert short["dynamic"]["vs_bf16"] == pytest.approx(1.25) and short["dynamic"]["vs_bf16_of"] == "bf16"
    assert short["tensor+custom_ops=+quant_fp8"]["vs_bf16"] == pytest.approx(1.4)
    assert short["tensor+custom_ops=+quant_fp8"]["vs_bf16_of"] == "bf16+custom_ops=+quant_fp8"
    assert short["bf16+kv-fp8"]["vs_bf16"] == pytest.approx(15500 / 15000)
    assert short["block+deepgemm"]["vs_bf16"] == pytest.approx(1.2) and short["block+deepgemm"]["vs_bf16_of"] == "bf16"
    assert short["dynamic+kv-fp8"]["vs_bf16"] == pytest.approx(1.2) and short["dynamic+kv-fp8"]["vs_bf16_of"] == "bf16@call3"
    assert short["bf16@call3"]["vs_bf16"] == 1.0


def test_a_repeat_in_a_later_call_keeps_the_earlier_run():
    from evals.serve_bench import run_key

    results = {"qwen3-8b/short/bf16": {"tok_s": 16000.0, "call": 1}, "qwen3-8b/short/old": {"tok_s": 1.0}}
    assert run_key(results, "qwen3-8b/short/bf16", 4) == "qwen3-8b/short/bf16@call4"
    assert run_key(results, "qwen3-8b/short/bf16", 1) == "qwen3-8b/short/bf16"
    assert run_key(results, "qwen3-8b/short/old", 4) == "qwen3-8b/short/old@call4"  # stored before calls were recorded
    assert run_key(results, "qwen3-8b/short/tensor", 4) == "qwen3-8b/short/tensor"
    failed = {"qwen3-8b/short/dynamic": {"error": "engine did not finish within 560 s", "call": 1}}
    assert run_key(failed, "qwen3-8b/short/dynamic", 4) == "qwen3-8b/short/dynamic"  # its retry replaces it


def test_engine_log_facts():
    """Lines as vLLM 0.25 writes them (two engines' worth: the last figures count)."""
    log = "\n".join([
        "INFO 11-23 17:41:02 [gpu_model_runner.py:4120] Model loading took 9.1 GiB memory and 3.2 seconds",
        "INFO 11-23 17:41:02 [gpu_model_runner.py:4120] Model loading took 8.8 GiB memory and 3.1 seconds",
        "INFO 11-23 17:41:01 [compressed_tensors_w8a8_fp8.py:77] Selected CutlassFP8ScaledMMLinearKernel for "
        "CompressedTensorsW8A8Fp8",
        "INFO 11-23 17:41:01 [compressed_tensors_w8a8_fp8.py:77] Selected CutlassFP8ScaledMMLinearKernel for "
        "CompressedTensorsW8A8Fp8",
        "INFO 11-23 17:43:34 [kv_cache_utils.py:2146] GPU KV cache size: 825,887 tokens",
        "WARNING 11-23 17:43:30 [kv_cache.py:151] Using KV cache scaling factor 1.0 for fp8_e4m3. If this is "
        "unintended, verify that k/v_scale scaling factors are properly set in the checkpoint.",
    ])
    facts = engine_log_facts(log)
    assert facts["weight_gib"] == 8.8 and facts["kv_cache_tokens"] == 825887
    assert facts["kernels"] == [("CutlassFP8ScaledMMLinearKernel", "CompressedTensorsW8A8Fp8")]
    assert facts["kv_scale_log"] == ["Using KV cache scaling factor 1.0 for fp8_e4m3. If this is unintended, verify "
                                     "that k/v_scale scaling factors are properly set in the checkpoint."]
    assert engine_log_facts("") == {"weight_gib": None, "kernels": [], "kv_cache_tokens": None, "kv_scale_log": []}


def test_results_have_one_row_per_scheme_naming_the_run_and_the_best_of_ours(tmp_path):
    """`results` is read by scheme (bf16, dynamic, block, tensor): the scheme with vLLM's defaults where measured,
    else its fastest run with options, named by `variant`; `best` is our fastest checkpoint, vLLM's own FP8 aside.
    --summarize rewrites them from a file's runs without a GPU."""
    import subprocess
    import sys

    from evals.serve_bench import NEW_PROMPTS as new
    from evals.serve_bench import ROOT

    runs = {
        "qwen3-8b/short/bf16": {"tok_s": 16000.0, "prompts": new, "call": 0},
        "qwen3-8b/short/dynamic": {"tok_s": 19000.0, "prompts": new, "call": 0},
        "qwen3-8b/short/dynamic+kv-fp8": {"tok_s": 20000.0, "prompts": new, "call": 0},
        "qwen3-8b/short/block+deepgemm": {"tok_s": 18000.0, "prompts": new, "call": 0},
        "qwen3-8b/short/block": {"error": "engine did not finish within 560 s", "call": 0},
        "qwen3-8b/short/tensor+lm-head": {"tok_s": 19200.0, "prompts": new, "call": 0},
        "qwen3-8b/short/tensor+custom_ops=+quant_fp8": {"tok_s": 18400.0, "prompts": new, "call": 0},
        "qwen3-8b/short/tensor-static": {"tok_s": 18800.0, "prompts": new, "call": 0},
        "qwen3-8b/short/vllm-online-fp8": {"tok_s": 21000.0, "prompts": new, "call": 0},
        "qwen3-8b/short/dynamic@call1": {"tok_s": 25000.0, "prompts": new, "call": 1},
    }
    out = tmp_path / "serve.json"
    out.write_text(json.dumps({"model": {"name": "qwen3-8b"}, "models": {"qwen3-8b": {}}, "runs": runs,
                               "results": {"stale": {"tok_s": 1.0}}}))
    proc = subprocess.run([sys.executable, str(ROOT / "evals" / "serve_bench.py"), "--summarize", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    assert {k: v["variant"] for k, v in results.items()} == {
        "bf16": "bf16", "dynamic": "dynamic", "block": "block+deepgemm", "tensor": "tensor+lm-head"}
    assert results["dynamic"]["vs_bf16"] == pytest.approx(19000 / 16000)
    assert report["best"] == {"variant": "dynamic+kv-fp8", "tok_s": 20000.0, "vs_bf16": pytest.approx(1.25)}
    assert report["runs"] == runs and "qwen3-8b/short" in report["results_by_workload"]


def test_the_bf16_row_is_never_an_fp8_kv_cache_run():
    from evals.serve_bench import NEW_PROMPTS as new
    from evals.serve_bench import scheme_rows, workload_summaries

    runs = {"qwen3-8b/short/bf16+custom_ops=+quant_fp8": {"tok_s": 16000.0, "prompts": new, "call": 0},
            "qwen3-8b/short/bf16+kv-fp8": {"tok_s": 17000.0, "prompts": new, "call": 0}}
    rows = scheme_rows(workload_summaries(runs, "qwen3-8b")["qwen3-8b/short"])
    assert rows["bf16"]["variant"] == "bf16+custom_ops=+quant_fp8"


def test_summarize_of_a_file_without_runs_says_so(tmp_path):
    import subprocess
    import sys

    from evals.serve_bench import ROOT

    out = tmp_path / "serve.json"
    out.write_text(json.dumps({"results": {"bf16": {"tok_s": 1.0}}}))
    proc = subprocess.run([sys.executable, str(ROOT / "evals" / "serve_bench.py"), "--summarize", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == f"{out}: no runs to summarize (results of serve_bench.py " \
        "hold them under 'runs')"
    assert json.loads(out.read_text()) == {"results": {"bf16": {"tok_s": 1.0}}}
