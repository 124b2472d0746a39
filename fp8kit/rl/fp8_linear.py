"""A frozen FP8 Linear with a trainable LoRA: the training half of FP8 RL.

The base weight stays float8_e4m3fn with its scale; activations are quantized the way vLLM quantizes
them for the same checkpoint (per token for per-channel and per-tensor weights, per 1x128 group for 128x128
blocks), so the trainer and the rollout engine compute the same function up to
accumulation order. Every backend, the CPU one included, quantizes activations identically; the backends
differ only in how the FP8 product is computed. Backward produces gradients for the input and the LoRA
parameters only; the base weight is dequantized transiently for the input gradient and never kept.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.rl import kernel_backends
from fp8kit.rl.kernel_backends import available_backends  # noqa: F401 - re-exported

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for dynamic activation scales (fp8_utils)
# reference: dequantize and multiply (any device, the CPU path); torch: torch's scaled_mm GEMMs with the
# activation quantized by torch ops; triton: the same GEMMs with the activation quantized by one fused
# Triton kernel; fbgemm, torchao: those libraries' GEMMs
# (kernel_backends.py lists the pairs they support) after the same fused quantizer when Triton is there.
LIBRARY_BACKENDS = kernel_backends.LIBRARY_BACKENDS
BACKENDS = ("reference", "torch", "triton", *LIBRARY_BACKENDS)


def quantize_activation(x: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scale): [M, 1] per token for per-channel and per-tensor weights (as
    vLLM does for dynamic activations whatever the weight strategy), [M, K/128] per group for block weights."""
    xf = x.float()
    if scheme == "block":
        scale = xf.reshape(x.shape[0], -1, GROUP).abs().amax(dim=2) / FP8_MAX
    else:
        scale = xf.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = scale.clamp_min(MIN_SCALE)
    if scheme == "block":
        q = (xf.reshape(x.shape[0], -1, GROUP) / scale[:, :, None]).reshape(x.shape)
    else:
        q = xf / scale
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, scheme: str, dtype: torch.dtype) -> torch.Tensor:
    w = weight.to(dtype)
    if scheme == "block":
        s = scale.to(dtype).repeat_interleave(GROUP, 0)[: w.shape[0]].repeat_interleave(GROUP, 1)[:, : w.shape[1]]
        return w * s
    return w * scale.to(dtype).reshape(-1, 1) if scale.numel() > 1 else w * scale.to(dtype)


def _dequantize_activation(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    if scheme == "block":
        return (q.float().reshape(q.shape[0], -1, GROUP) * scale[:, :, None]).reshape(q.shape)
    return q.float() * scale


def fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, scheme: str,
               out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """(xq * xs) @ (weight * ws).T with FP8 operands; float32 accumulation in every backend."""
    if backend == "reference":
        return (_dequantize_activation(xq, xs, scheme) @ dequantize_weight(weight, ws, scheme, torch.float32).t()
                ).to(out_dtype)
    if scheme == "tensor":  # per-token activations and one weight scale: the row-wise GEMM, scale broadcast
        ws, scheme = ws.float().reshape(1).expand(weight.shape[0]).reshape(-1, 1).contiguous(), "dynamic"
    if backend in LIBRARY_BACKENDS:
        return kernel_backends.matmul(backend, xq, xs, weight, ws, scheme, out_dtype)
    if scheme == "block":
        # cuBLAS block scaling wants outer-dim-major scales: activation scales [M, K/128] with strides (1, M),
        # weight scales as [K/128, N/128] with strides (1, K/128), i.e. ws.t() (checked on an H200).
        return F.scaled_mm(xq, weight.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                           ws.t(), F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=out_dtype)


def pick_backend(device: torch.device, requested: str | None = None) -> str:
    """FP8KIT_BACKEND or the argument wins; otherwise torch's scaled_mm on SM89+ GPUs, the reference elsewhere.

    fbgemm and torchao are used only when asked for (argument or FP8KIT_BACKEND); asking for one whose package
    does not import raises Fp8kitError naming the package. available_backends() says what this machine runs."""
    requested = requested or os.environ.get("FP8KIT_BACKEND")
    if requested:
        if requested not in BACKENDS:
            from fp8kit.errors import Fp8kitError

            raise Fp8kitError(f"backend {requested!r}: expected one of {', '.join(BACKENDS)}")
        if requested in LIBRARY_BACKENDS:
            kernel_backends.require(requested)
        return requested
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "reference"


def _quantize_input(x2: torch.Tensor, scheme: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activation's bytes: the fused Triton kernel for triton (required) and fbgemm/torchao (if any)."""
    if backend in ("triton", *LIBRARY_BACKENDS):
        try:
            from fp8kit.rl.triton_quant import quantize_activation_triton
        except ImportError:
            if backend == "triton":
                raise
        else:
            return quantize_activation_triton(x2.contiguous(), "block" if scheme == "block" else "dynamic")
    return quantize_activation(x2, scheme)


class _FP8MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, weight_scale, scheme, backend):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if backend in LIBRARY_BACKENDS:
            kernel_backends.check(backend, scheme, x.device, x.dtype)
        xq, xs = _quantize_input(x2, scheme, backend)
        y = fp8_matmul(xq, xs, weight, weight_scale, scheme, x.dtype, backend)
        ctx.save_for_backward(weight, weight_scale)
        ctx.scheme = scheme
        return y.reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        weight, weight_scale = ctx.saved_tensors
        grad_in = None
        if ctx.needs_input_grad[0]:  # the dequantized weight lives only for this product
            # fp16 would flush small scaled weights to subnormals: dequantize in float32 first
            dtype = torch.float32 if grad_out.dtype == torch.float16 else grad_out.dtype
            grad_in = grad_out @ dequantize_weight(weight, weight_scale, ctx.scheme, dtype).to(grad_out.dtype)
        return grad_in, None, None, None, None


def init_lora(module: nn.Module, rank: int, alpha: float | None, dropout: float, dtype: torch.dtype,
              device: torch.device) -> None:
    """LoRA A and B (PEFT's initialisation: Kaiming-uniform A, zero B) on a module with in/out_features."""
    module.rank = rank
    module.scaling = (alpha if alpha is not None else rank) / rank if rank else 0.0
    module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    if rank:
        module.lora_A = nn.Parameter(torch.empty(rank, module.in_features, dtype=dtype, device=device))
        module.lora_B = nn.Parameter(torch.zeros(module.out_features, rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(module.lora_A, a=math.sqrt(5))
    else:
        module.lora_A = module.lora_B = None


def add_lora(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y + dropout(x) @ A.T @ B.T * scaling in one addmm: no extra pass over y."""
    if module.lora_A is None:
        return y
    x2 = module.lora_dropout(x).reshape(-1, module.in_features)
    return torch.addmm(y.reshape(-1, module.out_features), x2 @ module.lora_A.t(), module.lora_B.t(),
                       alpha=module.scaling).reshape(y.shape)


class FP8LoRALinear(nn.Module):
    """y = fp8(x) @ fp8(W).T + b + dropout(x) @ A.T @ B.T * alpha / r, with W frozen in FP8."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, scheme: str, bias: torch.Tensor | None = None,
                 rank: int = 16, alpha: float | None = None, dropout: float = 0.0, dtype: torch.dtype = torch.bfloat16,
                 backend: str | None = None):
        super().__init__()
        if weight.dtype != FP8 or weight.ndim != 2:
            raise ValueError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.scheme = scheme
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        if backend is not None:
            pick_backend(weight.device, backend)  # an unknown name or a missing package fails here, not later
        self.backend = backend
        init_lora(self, rank, alpha, dropout, dtype, weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.backend or pick_backend(x.device)
        y = _FP8MatMul.apply(x, self.weight, self.weight_scale, self.scheme, backend)
        if self.bias is not None:
            y = y + self.bias
        return add_lora(self, x, y)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}, rank={self.rank}"
