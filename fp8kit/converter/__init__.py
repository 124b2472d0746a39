"""`fp8-convert`: BF16/FP16/FP32 safetensors checkpoints to FP8, streamed."""

__all__ = ["convert", "ConvertReport", "SCHEMES"]


def __getattr__(name):
    """Imported on first use (they import torch), so that light modules of this package (output's interrupt
    handling) load without it."""
    if name in ("convert", "ConvertReport"):
        from fp8kit.converter import streaming

        return getattr(streaming, name)
    if name == "SCHEMES":
        from fp8kit.converter.schemes import SCHEMES

        return SCHEMES
    raise AttributeError(f"module 'fp8kit.converter' has no attribute {name!r}")


def __dir__():
    """The lazy names too, for dir(), inspect.getmembers() and completion."""
    return sorted(set(globals()) | set(__all__))
