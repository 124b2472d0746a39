"""The 128x128-block FP8 GEMM in Triton, for the GPUs where cuBLAS has no block scaling.

torch's F.scaled_mm runs 1x128 x 128x128 block scaling only on SM90 (H100/H200; torch's own tests expect it
to fail elsewhere, test_matmul_cuda.py "Only take this branch on SM90"), so on an L4, an RTX 40 or 50 or a
Blackwell GPU a block checkpoint (Qwen3-*-FP8 among them) had no FP8 GEMM to train with. vLLM serves block FP8
on those GPUs with a Triton kernel of the same arithmetic (w8a8_triton_block_scaled_mm in
model_executor/layers/quantization/utils/fp8_utils.py): one FP8 tile product per 128-wide K block, scaled by
the activation group's and the weight block's scales and added to a float32 accumulator. This is that
arithmetic, so the trainer and the rollout engine keep agreeing up to accumulation order there too. torchao's
blockwise_fp8_gemm (the torchao backend) computes the same, but writes bfloat16 only, autotunes 48 configs per
shape on first use and is an optional package; Triton comes with every CUDA build of torch.
"""

import torch
import triton
import triton.language as tl

from fp8kit.rl.fp8_linear import GROUP

_CONFIGS = [  # tiles x stages that fit the 99 KB of shared memory of SM89 (L4, RTX 40) as well as SM90's
    triton.Config({"BM": 128, "BN": 128, "GROUP_M": 8}, num_warps=8, num_stages=3),
    triton.Config({"BM": 128, "BN": 128, "GROUP_M": 8}, num_warps=8, num_stages=2),
    triton.Config({"BM": 64, "BN": 128, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BM": 128, "BN": 64, "GROUP_M": 8}, num_warps=4, num_stages=3),
    triton.Config({"BM": 32, "BN": 128, "GROUP_M": 8}, num_warps=4, num_stages=4),  # few tokens (decode-sized)
]


@triton.autotune(configs=_CONFIGS, key=["N", "K", "m_bucket"])
@triton.jit
def _block_scaled_mm(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, m_bucket, stride_am, stride_bn, stride_bk,
                     stride_cm, stride_asm, stride_bsn, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                     BK: tl.constexpr):
    """C[M, N] = sum over K blocks kb of (A[:, kb] @ B[:, kb].T) * as[:, kb] * bs[n // 128, kb].
    A [M, K] row-major; B [N, K] with any strides; as [M, K/128]; bs [ceil(N/128), K/128]."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * num_n  # GROUP_M row tiles sweep all column tiles together: B stays in L2
    first_m = (pid // width) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mask_m, mask_n = rm < M, rn < N
    # 64-bit row offsets: M * K or M * N passes 2**31 at long contexts (8 x 32k tokens x 8960)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None] * stride_bk
    as_ptrs = as_ptr + rm * stride_asm
    bs_ptrs = bs_ptr + (rn // BK) * stride_bsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, K // BK):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        sa = tl.load(as_ptrs + kb, mask=mask_m, other=0.0)
        sb = tl.load(bs_ptrs + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BK
        b_ptrs += BK * stride_bk
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def block_scaled_mm_triton(xq: torch.Tensor, weight: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * xs per 1x128 group) @ (weight * ws per 128x128 block).T, as fp8_linear.block_scaled_mm: xq [M, K],
    weight [N, K], xs [M, K/128], ws [ceil(N/128), K/128]; K a multiple of 128."""
    M, K = xq.shape
    N = weight.shape[0]
    if K % GROUP or weight.shape[1] != K or xs.shape != (M, K // GROUP) or ws.shape != (triton.cdiv(N, GROUP), K // GROUP):
        raise ValueError(f"block GEMM shapes: x {tuple(xq.shape)}, x scales {tuple(xs.shape)}, weight "
                         f"{tuple(weight.shape)}, weight scales {tuple(ws.shape)}; K must be a multiple of {GROUP}")
    xq, xs, ws = xq.contiguous(), xs.float().contiguous(), ws.float().contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    if M == 0:
        return out
    m_bucket = min(triton.next_power_of_2(M), 4096)  # one tuning per size class of the token count

    def grid(meta):
        return (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)

    _block_scaled_mm[grid](xq, weight, out, xs, ws, M, N, K, m_bucket, xq.stride(0), weight.stride(0),
                           weight.stride(1), out.stride(0), xs.stride(0), ws.stride(0), BK=GROUP)
    return out
