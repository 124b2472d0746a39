"""Fused FP8 activation quantization in one Triton kernel: amax, scale and cast in a single pass.

Quantizing with eager torch ops before torch._scaled_mm takes an H100 from 1350 to 471-807 TFLOP/s
(../shared/gpu/README.md); one kernel reads the activation once and writes FP8 and scales. The arithmetic
is that of fp8_linear.quantize_activation: IEEE division (div_rn) and round-to-nearest-even casts, so
both produce the same bytes.
"""

import torch
import triton
import triton.language as tl

from fp8kit.rl.fp8_linear import FP8_MAX, GROUP, MIN_SCALE


@triton.jit
def _quantize_groups(x_ptr, q_ptr, s_ptr, stride_x, K, n_groups, GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                     FMAX: tl.constexpr, SMIN: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP_SIZE + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP_SIZE) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, SMIN)
    q = tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX)
    tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * n_groups + group, scale)


def quantize_activation_triton(x: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ("dynamic") or per 1x128 group ("block") for a 2-D CUDA tensor."""
    M, K = x.shape
    group = K if scheme == "dynamic" else GROUP
    n_groups = K // group
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, n_groups), dtype=torch.float32, device=x.device)
    _quantize_groups[(M, n_groups)](x, q, s, x.stride(0), K, n_groups, GROUP_SIZE=group,
                                    BLOCK=triton.next_power_of_2(group), FMAX=FP8_MAX, SMIN=MIN_SCALE)
    return q, s
