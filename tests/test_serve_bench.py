"""serve_bench's variant names are checked before an 8B model is built on the GPU."""

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
