"""fp8kit: FP8 checkpoints for large language models."""

__version__ = "0.1.0"

from fp8kit.errors import Fp8kitError  # noqa: E402

__all__ = ["convert", "ConvertReport", "Fp8kitError", "__version__"]


def __getattr__(name):
    """`convert` and `ConvertReport` import torch on first use, not on `import fp8kit`: the console scripts set up
    their Ctrl-C and SIGTERM handling before that second of imports."""
    if name in ("convert", "ConvertReport"):
        from fp8kit import converter

        return getattr(converter, name)
    if name == "converter":  # `import fp8kit; fp8kit.converter.X`, as before it was lazy (the package is light)
        import importlib

        return importlib.import_module("fp8kit.converter")
    raise AttributeError(f"module 'fp8kit' has no attribute {name!r}")


def __dir__():
    """The lazy names too, for dir(), inspect.getmembers() and completion."""
    return sorted(set(globals()) | set(__all__) | {"converter"})
