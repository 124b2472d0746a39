"""Fused Triton kernels around the FP8 GEMMs: activation quantization (amax, scale and cast in one pass) and
the transposed FP8 weight copy that the input-gradient GEMM reads.

Quantizing with eager torch ops before torch._scaled_mm takes an H100 from 1350 to 471-807 TFLOP/s
(../shared/gpu/README.md); one kernel reads the activation once and writes FP8 and scales. The arithmetic
is that of fp8_linear.quantize_activation: IEEE division (div_rn) and round-to-nearest-even casts, so
both produce the same bytes. With a column scale (the weight's per-channel scale, for the input gradient),
the product x * col is rounded to float32 first, as fp8_linear.quantize_grad does.
"""

import torch
import triton
import triton.language as tl

from fp8kit.rl.fp8_linear import FP8_MAX, GROUP, MIN_SCALE


@triton.jit
def _quantize_groups(x_ptr, c_ptr, q_ptr, s_ptr, stride_x, K, n_groups, GROUP_SIZE: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_COL: tl.constexpr, FMAX: tl.constexpr, SMIN: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP_SIZE + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP_SIZE) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_COL:
        x = x * tl.load(c_ptr + cols, mask=mask, other=0.0)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, SMIN)
    q = tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX)
    tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * n_groups + group, scale)


@triton.jit
def _quantize_row_groups(x_ptr, q_ptr, s_ptr, stride_x, K, n_groups, GROUP_SIZE: tl.constexpr,
                         GROUPS: tl.constexpr, FMAX: tl.constexpr, SMIN: tl.constexpr):
    """GROUPS consecutive 1xGROUP_SIZE groups of one row per program: one program per group would launch
    M * K/128 tiny programs (11.6 ms of an FP8 LoRA step's 82 on an H100, against 4 ms for per-token)."""
    row = tl.program_id(0)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = (g[:, None] < n_groups) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FMAX, SMIN)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FMAX, FMAX)
    tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * n_groups + g, scale, mask=g < n_groups)


def quantize_activation_triton(x: torch.Tensor, scheme: str,
                               col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ("dynamic") or per 1x128 group ("block") for a 2-D CUDA tensor, optionally of x * col_scale
    (float32 [K]) for the input gradient of a per-channel weight."""
    M, K = x.shape
    group = K if scheme == "dynamic" else GROUP
    n_groups = K // group
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, n_groups), dtype=torch.float32, device=x.device)
    if scheme == "block" and col_scale is None:
        groups = 8
        _quantize_row_groups[(M, triton.cdiv(n_groups, groups))](x, q, s, x.stride(0), K, n_groups, GROUP_SIZE=group,
                                                                 GROUPS=groups, FMAX=FP8_MAX, SMIN=MIN_SCALE)
        return q, s
    col = col_scale if col_scale is not None else s  # any pointer; unread without HAS_COL
    block = triton.next_power_of_2(group)
    # a whole row per program: enough warps that a 16384-wide row stays in registers (4 warps spilled:
    # 4.1 ms of quantization per FP8 LoRA step on an H100 against 2.8 ms for the same bytes in 1x128 groups)
    _quantize_groups[(M, n_groups)](x, col, q, s, x.stride(0), K, n_groups, GROUP_SIZE=group, BLOCK=block,
                                    HAS_COL=col_scale is not None, FMAX=FP8_MAX, SMIN=MIN_SCALE,
                                    num_warps=min(16, max(4, block // 1024)))
    return q, s


@triton.jit
def _transpose_bytes(x_ptr, y_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (r[:, None] < R) & (c[None, :] < C)
    tile = tl.load(x_ptr + r[:, None] * C + c[None, :], mask=mask)
    tl.store(y_ptr + c[:, None] * R + r[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_fp8(w: torch.Tensor) -> torch.Tensor:
    """w.t().contiguous() for a contiguous 2-D float8 tensor, as one tiled copy (torch's strided copy of 1-byte
    elements is several times slower)."""
    R, C = w.shape
    out = torch.empty((C, R), dtype=w.dtype, device=w.device)
    _transpose_bytes[(triton.cdiv(R, 64), triton.cdiv(C, 64))](w.view(torch.uint8), out.view(torch.uint8), R, C,
                                                               BR=64, BC=64)
    return out
