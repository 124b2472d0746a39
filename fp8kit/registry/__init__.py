"""Base model names to pre-quantized FP8 uploads, or a conversion made once and cached."""

from fp8kit.registry.cache import ensure, ensure_resolved
from fp8kit.registry.catalog import Variant, load
from fp8kit.registry.resolution import Resolution, resolve

__all__ = ["resolve", "ensure", "ensure_resolved", "load", "Resolution", "Variant"]
