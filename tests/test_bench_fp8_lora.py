"""bench_fp8_lora reads its variant names before building anything: a typo becomes a row with the reason."""

import pytest

from evals.bench_fp8_lora import fp8_variant, row_key, summarize, unsupported

BACKENDS = {"triton": {"schemes": ["dynamic", "block", "tensor"], "unsupported": {}},
            "fbgemm": {"schemes": [], "unsupported": {"dynamic": "needs the fbgemm-gpu-genai package"}}}


def test_variant_names_are_read_with_their_options():
    assert fp8_variant("dynamic/triton/fp8bwd/f32acc+compile") == ("dynamic", "triton", {"fp8bwd", "f32acc"})
    assert fp8_variant("block/triton/fp8bwd/tritongemm+compile") == ("block", "triton", {"fp8bwd", "tritongemm"})
    assert fp8_variant("block/torch") == ("block", "torch", set())
    assert fp8_variant("dynamic/triton/opaquequant+compile") == ("dynamic", "triton", {"opaquequant"})
    with pytest.raises(ValueError, match=r"unknown option \['tracedquant'\]"):  # traced is the default
        fp8_variant("dynamic/triton/tracedquant+compile")
    with pytest.raises(ValueError, match=r"unknown option \['fp8bwdd'\]"):
        fp8_variant("tensor/triton/fp8bwdd")


def test_unreadable_or_unrunnable_variants_get_the_reason():
    assert unsupported("tensor/triton/f32acc+compile", BACKENDS) is None
    assert unsupported("bf16-peft+compile", BACKENDS) is None
    assert "unknown option ['fastacc']" in unsupported("dynamic/triton/fastacc", BACKENDS)
    assert unsupported("dynamic/cutlass", BACKENDS) == "unknown backend 'cutlass'"
    assert unsupported("dynamic/fbgemm", BACKENDS) == "needs the fbgemm-gpu-genai package"


def test_a_variant_named_twice_keeps_both_rows_and_its_mode():
    """bf16 before and after the FP8 rows (the host's drift): the second replaced the first; the faster one is the
    baseline of its mode, and a repeated compiled row stays compiled."""
    rows = {}
    for variant, tok_s in [("bf16", 100.0), ("dynamic/triton", 90.0), ("bf16", 80.0), ("bf16+compile", 120.0),
                           ("dynamic/triton+compile", 150.0), ("dynamic/triton+compile", 140.0)]:
        rows[row_key(variant, rows)] = {"tokens_per_s": tok_s, "peak_memory_gb": 1.0, "weight_gb": 1.0}
    assert list(rows) == ["bf16", "dynamic/triton", "bf16 #2", "bf16+compile", "dynamic/triton+compile",
                          "dynamic/triton+compile #2"]
    report = {}
    summarize(rows, report)
    assert rows["dynamic/triton"]["speedup_vs_bf16"] == pytest.approx(0.9)
    assert rows["dynamic/triton+compile #2"]["speedup_vs_bf16"] == pytest.approx(140 / 120)
    assert report["best_backend"] == "dynamic/triton+compile" and report["speedup_vs_bf16"] == pytest.approx(1.25)


@pytest.mark.parametrize("length", ["0", "1", "-5"])
def test_a_first_seq_below_two_is_refused_before_anything_runs(length, tmp_path, capsys, monkeypatch):
    """--first-seq 0 used to be ignored and a negative one failed inside torch: one line, exit status 2, no file."""
    import sys

    from evals import bench_fp8_lora

    out = tmp_path / "fp8_lora.json"
    monkeypatch.setattr(sys, "argv", ["bench_fp8_lora.py", "--first-seq", length, "--out", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        bench_fp8_lora.main()
    assert exit_info.value.code == 2
    assert f"--first-seq {length}: give a length of 2 or more" in capsys.readouterr().err
    assert not out.exists()
