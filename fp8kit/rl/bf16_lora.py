"""The BF16/FP16 baseline of FP8 RL: the same frozen-base + LoRA layer as FP8LoRALinear, with the base weight
kept in the compute dtype, so `load_model(load_in_fp8=False)` trains, saves adapters and shares weights with
vLLM through exactly the code paths the FP8 model uses and the comparison measures only the weights' format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.rl.fp8_linear import add_lora, init_lora


class LoRALinear(nn.Module):
    """y = x @ W.T + b + dropout(x) @ A.T @ B.T * alpha / r, with W frozen in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rank: int = 16,
                 alpha: float | None = None, dropout: float = 0.0, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = None
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        init_lora(self, rank, alpha, dropout, dtype, weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        return add_lora(self, x2, F.linear(x2, self.weight, self.bias)).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}, rank={self.rank}"
