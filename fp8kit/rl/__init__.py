"""FP8 reinforcement learning: frozen FP8 base weights with LoRA, loaded straight from FP8 checkpoints."""

from fp8kit.rl.fp8_linear import FP8LoRALinear, pick_backend, quantize_activation
from fp8kit.rl.grpo import GRPOConfig, train
from fp8kit.rl.loader import load_adapter, load_fp8_model, load_lora_model, save_adapter
from fp8kit.rl.model import load_model, unload_model

__all__ = ["FP8LoRALinear", "load_fp8_model", "load_lora_model", "load_model", "unload_model", "GRPOConfig", "train",
           "save_adapter", "load_adapter", "pick_backend", "quantize_activation"]
