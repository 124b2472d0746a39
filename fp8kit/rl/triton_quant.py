"""Fused Triton kernels around the FP8 GEMMs: activation quantization (amax, scale and cast in one pass), the
gated MLP's SiLU and multiply with the down projection's quantization (and their backward), the transposed
FP8 weight copy that the FP8 input-gradient GEMM reads, and the dequantized weight that the exact one multiplies.

Quantizing with eager torch ops before torch._scaled_mm takes an H100 from 1350 to 471-807 TFLOP/s
(../shared/gpu/README.md); one kernel reads the activation once and writes FP8 and scales. The arithmetic
is that of fp8_linear.quantize_activation: IEEE division (div_rn) and round-to-nearest-even casts, so
both produce the same bytes. With a column scale (the weight's per-channel scale, for the input gradient),
the product x * col is rounded to float32 first, as fp8_linear.quantize_grad does.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp8kit.rl.fp8_linear import FP8_MAX, GROUP, MIN_SCALE


@triton.jit
def _quantize_rows(x_ptr, c_ptr, q_ptr, s_ptr, stride_x, K, BLOCK: tl.constexpr, HAS_COL: tl.constexpr,
                   FMAX: tl.constexpr, SMIN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * K passes 2**31 (240k tokens of an 8960-wide MLP): out of bounds
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_COL:
        x = x * tl.load(c_ptr + cols, mask=mask, other=0.0)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FMAX, SMIN)
    q = tl.clamp(tl.math.div_rn(x, scale), -FMAX, FMAX)
    tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _quantize_row_groups(x_ptr, q_ptr, s_ptr, stride_x, K, n_groups, GROUP_SIZE: tl.constexpr,
                         GROUPS: tl.constexpr, FMAX: tl.constexpr, SMIN: tl.constexpr):
    """GROUPS consecutive 1xGROUP_SIZE groups of one row per program: one program per group launched M * K/128
    tiny programs (11.6 ms of an 83 ms FP8 LoRA step on an H100, evals/results/fp8_lora_h100_probe1.json)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = (g[:, None] < n_groups) & (cols < K)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FMAX, SMIN)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FMAX, FMAX)
    tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * n_groups + g, scale, mask=g < n_groups)


def quantize_activation_triton(x: torch.Tensor, scheme: str, col_scale: torch.Tensor | None = None,
                               min_scale: float = MIN_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token ("dynamic") or per 1x128 group ("block") for a 2-D CUDA tensor; per token optionally of
    x * col_scale (float32 [K]), for the input gradient of a per-channel weight. min_scale: the scales' floor
    (fp8_linear.GRAD_MIN_SCALE for output gradients)."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if scheme == "block":
        if col_scale is not None:
            raise ValueError("col_scale applies to per-token quantization only")
        n_groups, groups = K // GROUP, 8
        s = torch.empty((M, n_groups), dtype=torch.float32, device=x.device)
        _quantize_row_groups[(M, triton.cdiv(n_groups, groups))](x, q, s, x.stride(0), K, n_groups, GROUP_SIZE=GROUP,
                                                                 GROUPS=groups, FMAX=FP8_MAX, SMIN=min_scale)
        return q, s
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(K)
    # a whole row per program (up to 16384 values): more warps for wider rows
    _quantize_rows[(M,)](x, s if col_scale is None else col_scale, q, s, x.stride(0), K, BLOCK=block,
                         HAS_COL=col_scale is not None, FMAX=FP8_MAX, SMIN=min_scale,
                         num_warps=min(16, max(4, block // 1024)))
    return q, s


@triton.jit
def _silu(g, dtype: tl.constexpr):
    """torch's SiLU of a 16-bit tensor: g / (1 + exp(-g)) in float32 (IEEE division, libdevice's expf, as ATen's
    CUDA kernel computes it), rounded to the tensor's dtype, and the sigmoid its backward uses."""
    denominator = 1.0 + libdevice.exp(-g)
    return tl.math.div_rn(g, denominator).to(dtype).to(tl.float32), tl.math.div_rn(1.0, denominator)


@triton.jit
def _silu_mul_quant_rows(g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, N, BLOCK: tl.constexpr, FMAX: tl.constexpr,
                         SMIN: tl.constexpr):
    """One row: h = silu(g) * u, rounded as torch rounds each op (silu's output, then the product), written; its
    per-row FP8 quantization from a second pass over h (this program's own writes, still in L2)."""
    row = tl.program_id(0).to(tl.int64)
    dtype = h_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(g_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        s, _ = _silu(g, dtype)
        h = (s * u).to(dtype)
        tl.store(h_ptr + row * N + cols, h, mask=mask)
        amax = tl.maximum(amax, tl.abs(h.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / FMAX, SMIN)
    tl.debug_barrier()  # every thread's h stores before any thread reads them back
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        h = tl.load(h_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(h, scale), -FMAX, FMAX)
        tl.store(q_ptr + row * N + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _silu_mul_quant_groups(g_ptr, u_ptr, h_ptr, q_ptr, s_ptr, N, n_groups, GROUP_SIZE: tl.constexpr,
                           GROUPS: tl.constexpr, FMAX: tl.constexpr, SMIN: tl.constexpr):
    """GROUPS consecutive 1xGROUP_SIZE groups of one row: h as in _silu_mul_quant_rows, quantized per group in the
    same pass."""
    row = tl.program_id(0).to(tl.int64)
    dtype = h_ptr.dtype.element_ty
    grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = grp[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = (grp[:, None] < n_groups) & (cols < N)
    g = tl.load(g_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    s, _ = _silu(g, dtype)
    h = (s * u).to(dtype)
    tl.store(h_ptr + row * N + cols, h, mask=mask)
    hf = h.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(hf), axis=1) / FMAX, SMIN)
    q = tl.clamp(tl.math.div_rn(hf, scale[:, None]), -FMAX, FMAX)
    tl.store(q_ptr + row * N + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * n_groups + grp, scale, mask=grp < n_groups)


@triton.jit
def _silu_mul_backward(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    """The gradients of h = silu(g) * u as torch's autograd computes them: du = dh * silu(g) and d(silu) = dh * u,
    each rounded, then silu's backward dg = d(silu) * sig * (1 + g * (1 - sig)) (ATen's silu_backward)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = dg_ptr.dtype.element_ty
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s, sig = _silu(g, dtype)
    tl.store(du_ptr + offs, (dh * s).to(dtype), mask=mask)
    ds = (dh * u).to(dtype).to(tl.float32)
    tl.store(dg_ptr + offs, (ds * sig * (1.0 + g * (1.0 - sig))).to(dtype), mask=mask)


@torch.library.custom_op("fp8kit::silu_mul_quant", mutates_args=())
def silu_mul_quant_op(g: torch.Tensor, u: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, q, s) for 2-D g and u: h = silu(g) * u in their dtype, and h quantized as quantize_activation quantizes
    it for `scheme` (per row, or per 1x128 group for "block"). One opaque operator under torch.compile."""
    g, u = g.contiguous(), u.contiguous()
    M, N = g.shape
    h = torch.empty_like(g)
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=g.device)
    if scheme == "block":
        n_groups, groups = N // GROUP, 8
        s = torch.empty((M, n_groups), dtype=torch.float32, device=g.device)
        _silu_mul_quant_groups[(M, triton.cdiv(n_groups, groups))](g, u, h, q, s, N, n_groups, GROUP_SIZE=GROUP,
                                                                   GROUPS=groups, FMAX=FP8_MAX, SMIN=MIN_SCALE)
    else:
        s = torch.empty((M, 1), dtype=torch.float32, device=g.device)
        block = min(4096, triton.next_power_of_2(N))
        _silu_mul_quant_rows[(M,)](g, u, h, q, s, N, BLOCK=block, FMAX=FP8_MAX, SMIN=MIN_SCALE,
                                   num_warps=max(4, block // 512))
    return h, q, s


@silu_mul_quant_op.register_fake
def _(g, u, scheme):
    M, N = g.shape
    return (g.new_empty((M, N)), g.new_empty((M, N), dtype=torch.float8_e4m3fn),
            g.new_empty((M, N // GROUP if scheme == "block" else 1), dtype=torch.float32))


@torch.library.custom_op("fp8kit::silu_mul_backward", mutates_args=())
def silu_mul_backward_op(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of h = silu(g) * u, one elementwise pass."""
    dh, g, u = dh.contiguous(), g.contiguous(), u.contiguous()
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n, block = g.numel(), 4096
    _silu_mul_backward[(triton.cdiv(n, block),)](dh, g, u, dg, du, n, BLOCK=block, num_warps=8)
    return dg, du


@silu_mul_backward_op.register_fake
def _(dh, g, u):
    return g.new_empty(g.shape), u.new_empty(u.shape)  # contiguous, as the op's


@triton.jit
def _transpose_bytes(x_ptr, y_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # 64-bit offsets: a weight may pass 2**31 bytes
    c = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    mask = (r[:, None] < R) & (c[None, :] < C)
    tile = tl.load(x_ptr + r[:, None] * C + c[None, :], mask=mask)
    tl.store(y_ptr + c[:, None] * R + r[None, :], tl.trans(tile), mask=tl.trans(mask))


def transpose_fp8(w: torch.Tensor) -> torch.Tensor:
    """w.t().contiguous() for a contiguous 2-D float8 tensor, as one tiled 64x64 copy (0.42 ms for the 25 weights of
    the LoRA bench's step on an H200; torch's strided copy was not compared)."""
    R, C = w.shape
    out = torch.empty((C, R), dtype=w.dtype, device=w.device)
    _transpose_bytes[(triton.cdiv(R, 64), triton.cdiv(C, 64))](w.view(torch.uint8), out.view(torch.uint8), R, C,
                                                               BR=64, BC=64)
    return out


@triton.jit
def _dequantize_tiles(w_ptr, s_ptr, out_ptr, R, C, stride_w, s_cols, SCALES: tl.constexpr, BR: tl.constexpr,
                      BC: tl.constexpr, SCALE_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)  # 64-bit offsets: a weight may pass 2**31 bytes
    c = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    mask = (r[:, None] < R) & (c[None, :] < C)
    w = tl.load(w_ptr + r[:, None] * stride_w + c[None, :], mask=mask).to(tl.float32)
    if SCALES == 0:  # one per tensor
        s = tl.load(s_ptr)
    elif SCALES == 1:  # one per row
        s = tl.load(s_ptr + r, mask=r < R)[:, None]
    else:  # 128x128 blocks
        s = tl.load(s_ptr + (r[:, None] // 128) * s_cols + c[None, :] // 128, mask=mask)
    s = s.to(SCALE_DTYPE).to(tl.float32)
    tl.store(out_ptr + r[:, None] * C + c[None, :], (w * s).to(OUT_DTYPE), mask=mask)


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def dequantize_weight_triton(weight: torch.Tensor, scale: torch.Tensor, scheme: str,
                             dtype: torch.dtype) -> torch.Tensor:
    """fp8_linear.dequantize_weight in one pass (read the FP8 bytes, write `dtype`): torch's takes three (the cast, then
    the product read and written again), which at GRPO's micro-batches (3,072 tokens) cost the exact input gradient
    more than the FP8 forward saves. The same bytes: the FP8 value and the scale rounded to `dtype` (both exact in
    float32), their float32 product rounded to `dtype` once, as torch's `dtype` multiply does. Rows may be strided
    (a vLLM weight padded for its kernel)."""
    R, C = weight.shape
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    scale = scale.float().contiguous()
    scales = 2 if scheme == "block" else (1 if scale.numel() > 1 else 0)  # blocks, rows, one per tensor
    out = torch.empty((R, C), dtype=dtype, device=weight.device)
    _dequantize_tiles[(triton.cdiv(R, 32), triton.cdiv(C, 256))](
        weight, scale, out, R, C, weight.stride(0), scale.shape[-1] if scales == 2 else 1, SCALES=scales,
        BR=32, BC=256, SCALE_DTYPE=_TL_DTYPES[dtype], OUT_DTYPE=_TL_DTYPES[dtype])
    return out
