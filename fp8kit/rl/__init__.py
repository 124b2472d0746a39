"""FP8 reinforcement learning: frozen FP8 base weights with LoRA, loaded straight from FP8 checkpoints."""

from fp8kit.rl.fp8_linear import FP8LoRALinear, pick_backend, quantize_activation
from fp8kit.rl.loader import load_adapter, load_fp8_model, save_adapter

__all__ = ["FP8LoRALinear", "load_fp8_model", "save_adapter", "load_adapter", "pick_backend", "quantize_activation"]
