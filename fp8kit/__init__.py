"""fp8kit: FP8 checkpoints for large language models."""

__version__ = "0.1.0"

from fp8kit.converter import ConvertReport, convert  # noqa: E402
from fp8kit.errors import Fp8kitError  # noqa: E402

__all__ = ["convert", "ConvertReport", "Fp8kitError", "__version__"]
