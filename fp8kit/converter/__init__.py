"""`fp8-convert`: BF16/FP16/FP32 safetensors checkpoints to FP8, streamed."""

from fp8kit.converter.streaming import ConvertReport, convert
from fp8kit.converter.schemes import SCHEMES

__all__ = ["convert", "ConvertReport", "SCHEMES"]
