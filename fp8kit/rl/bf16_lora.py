"""The BF16/FP16 baseline of FP8 RL: the same frozen-base + LoRA layer as FP8LoRALinear, with the base weight
kept in the compute dtype, so `load_model(load_in_fp8=False)` trains, saves adapters and shares weights with
vLLM through exactly the code paths the FP8 model uses and the comparison measures only the weights' format.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """y = x @ W.T + b + dropout(x) @ A.T @ B.T * alpha / r, with W frozen in the compute dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rank: int = 16,
                 alpha: float | None = None, dropout: float = 0.0, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = None
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.rank = rank
        self.scaling = (alpha if alpha is not None else rank) / rank if rank else 0.0
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        if rank:
            self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=dtype, device=weight.device))
            self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=dtype, device=weight.device))
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default initialisation
        else:
            self.lora_A = self.lora_B = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora_A is not None:
            x2 = self.lora_dropout(x).reshape(-1, self.in_features)
            y = torch.addmm(y.reshape(-1, self.out_features), x2 @ self.lora_A.t(), self.lora_B.t(),
                            alpha=self.scaling).reshape(y.shape)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, dtype={self.weight.dtype}, rank={self.rank}"
