"""bench_fp8_lora reads its variant names before building anything: a typo becomes a row with the reason."""

import pytest

from evals.bench_fp8_lora import fp8_variant, unsupported

BACKENDS = {"triton": {"schemes": ["dynamic", "block", "tensor"], "unsupported": {}},
            "fbgemm": {"schemes": [], "unsupported": {"dynamic": "needs the fbgemm-gpu-genai package"}}}


def test_variant_names_are_read_with_their_options():
    assert fp8_variant("dynamic/triton/fp8bwd/f32acc+compile") == ("dynamic", "triton", {"fp8bwd", "f32acc"})
    assert fp8_variant("block/triton/fp8bwd/tritongemm+compile") == ("block", "triton", {"fp8bwd", "tritongemm"})
    assert fp8_variant("block/torch") == ("block", "torch", set())
    with pytest.raises(ValueError, match=r"unknown option \['fp8bwdd'\]"):
        fp8_variant("tensor/triton/fp8bwdd")


def test_unreadable_or_unrunnable_variants_get_the_reason():
    assert unsupported("tensor/triton/f32acc+compile", BACKENDS) is None
    assert unsupported("bf16-peft+compile", BACKENDS) is None
    assert "unknown option ['fastacc']" in unsupported("dynamic/triton/fastacc", BACKENDS)
    assert unsupported("dynamic/cutlass", BACKENDS) == "unknown backend 'cutlass'"
    assert unsupported("dynamic/fbgemm", BACKENDS) == "needs the fbgemm-gpu-genai package"
