"""FP8 GEMMs from fbgemm-gpu-genai and torchao for FP8LoRALinear, and what this machine can run.

These backends take the activation already quantized by fp8_linear.quantize_activation (or its byte-equal
Triton twin) and the stored weight, [out, in] float8_e4m3fn with its float32 scale, exactly as the torch
backend does; only the GEMM kernel differs. Supported (backend, scheme) pairs:

fbgemm (fbgemm-gpu-genai 1.6, CUTLASS; writes bfloat16 only, so the layer dtype must be bfloat16):
  dynamic  torch.ops.fbgemm.f8f8bf16_rowwise(xq, W, xs [M], ws [N], use_fast_accum)           SM90, SM100
  tensor   the same rowwise kernel: per-token activations, the weight's one scale broadcast to [N]
           (acc * ws * xs, float32 epilogue), so no approximation                             SM90, SM100
  block    torch.ops.fbgemm.f8f8bf16_groupwise: 1x128 activation groups x 128x128 weight blocks, scales
           MN-major (xs.T [K/128, M], ws.T [K/128, N/128], as its own quantize_fp8_group(k_major=False)
           and quantize_fp8_block(k_major=False) lay them out)                                 SM90 only
           fbgemm's f8f8bf16_blockwise is not used: it wants 128x128 activation blocks, a different
           activation quantization from vLLM's 1x128 groups.
torchao (0.18):
  block    torchao.kernel.blockwise_quantization.blockwise_fp8_gemm, torchao's Triton 1x128 x 128x128
           kernel (the one its Float8Tensor uses for PerBlock([1,128]) x PerBlock([128,128])); writes
           bfloat16 only; autotunes 48 configs per (N, K) on first use                        SM89+
  dynamic, tensor  torchao.float8.inference.addmm_float8_unwrapped_inference, torchao's row-wise and
           tensor-wise FP8 inference GEMM. It calls torch._scaled_mm, i.e. the same cuBLAS kernel as the
           torch and triton backends (torchao 0.18 has no row-wise FP8 GEMM of its own; its other choice,
           mslk, is a separate package). Any output dtype.                                    SM89+
The row-wise GEMMs take the layer's fast_accum (fp8_linear.fp8_matmul); the block kernels promote per 128-K.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

import torch

LIBRARY_BACKENDS = ("fbgemm", "torchao")
SCHEMES = ("dynamic", "block", "tensor")
# backend -> (pip package, module whose import makes the kernels available)
PACKAGES = {"fbgemm": ("fbgemm-gpu-genai", "fbgemm_gpu.experimental.gen_ai"),
            "torchao": ("torchao", "torchao.kernel.blockwise_quantization")}
# (backend, scheme) -> (compute capabilities it runs on, output dtypes it writes or None for any)
_SUPPORT = {
    ("fbgemm", "dynamic"): ({9, 10}, (torch.bfloat16,)),
    ("fbgemm", "tensor"): ({9, 10}, (torch.bfloat16,)),
    ("fbgemm", "block"): ({9}, (torch.bfloat16,)),
    ("torchao", "dynamic"): (None, None),
    ("torchao", "tensor"): (None, None),
    ("torchao", "block"): (None, (torch.bfloat16,)),
}
_CAPABILITY_TEXT = {("fbgemm", "block"): "SM90 (its groupwise kernels are built for sm_90a)",
                    ("fbgemm", "dynamic"): "SM90 or SM100", ("fbgemm", "tensor"): "SM90 or SM100"}
_loaded: set[str] = set()
_probed: dict[tuple, str | None] = {}


def _error(message: str):
    from fp8kit.errors import Fp8kitError

    return Fp8kitError(message)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def version(backend: str) -> str | None:
    """The installed version of the backend's package, or None (read from metadata: nothing is imported)."""
    try:
        return importlib.metadata.version(PACKAGES[backend][0])
    except importlib.metadata.PackageNotFoundError:
        return None


def require(backend: str) -> None:
    """Import the backend's package, or raise Fp8kitError naming the package to install."""
    if backend in _loaded and sys.modules.get(PACKAGES[backend][1]) is not None:
        return
    package, module = PACKAGES[backend]
    try:
        importlib.import_module(module)
        if backend == "torchao":
            importlib.import_module("torchao.float8.inference")
        else:
            for op in ("f8f8bf16_rowwise", "f8f8bf16_groupwise"):
                getattr(torch.ops.fbgemm, op)
    except Exception as e:  # noqa: BLE001 - ImportError, or a library that imports but cannot load its ops
        raise _error(f"backend {backend!r} needs the {package} package, which does not import here "
                     f"({_first_line(e)}); "
                     f"pip install {package}, or pick another backend") from None
    _loaded.add(backend)


def unsupported(backend: str, scheme: str, device: torch.device, out_dtype: torch.dtype | None = None) -> str | None:
    """Why this backend cannot run this scheme here (device, compute capability, output dtype), or None."""
    if (backend, scheme) not in _SUPPORT:
        return f"backend {backend!r} has no {scheme!r} GEMM"
    if device.type != "cuda":
        return f"backend {backend!r} runs on CUDA GPUs only, not {device.type}"
    majors, dtypes = _SUPPORT[backend, scheme]
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"backend {backend!r} needs an FP8 GPU (SM89+), this one is SM{capability[0]}{capability[1]}"
    if majors is not None and capability[0] not in majors:
        return (f"backend {backend!r} runs {scheme!r} on {_CAPABILITY_TEXT[backend, scheme]} only, "
                f"this GPU is SM{capability[0]}{capability[1]}")
    if dtypes is not None and out_dtype is not None and out_dtype not in dtypes:
        return (f"backend {backend!r} writes bfloat16 only for {scheme!r}, the layer computes in {out_dtype}: "
                f"use dtype=torch.bfloat16, or backend 'triton'")
    return None


def check(backend: str, scheme: str, device: torch.device, out_dtype: torch.dtype) -> None:
    """Raise Fp8kitError unless the backend is installed and runs this scheme on this device and dtype."""
    require(backend)
    why = unsupported(backend, scheme, device, out_dtype)
    if why:
        raise _error(why)


def matmul(backend: str, xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, scheme: str,
           out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(xq * xs) @ (weight * ws).T with the backend's kernel; shapes and fast_accum as fp8_linear.fp8_matmul."""
    M, N = xq.shape[0], weight.shape[0]
    weight = weight.contiguous()
    if backend == "fbgemm":
        if scheme == "block":  # MN-major scales: [K/128, M] and [K/128, ceil(N/128)]
            y = torch.ops.fbgemm.f8f8bf16_groupwise(xq.contiguous(), weight, xs.t().contiguous(),
                                                    ws.t().contiguous())
        else:  # per token x per channel (fp8_matmul hands per-tensor weights over with the scale broadcast)
            x_scale = xs.reshape(-1).expand(M).contiguous()
            w_scale = ws.float().reshape(-1).expand(N).contiguous()
            y = torch.ops.fbgemm.f8f8bf16_rowwise(xq.contiguous(), weight, x_scale, w_scale, use_fast_accum=fast_accum)
    elif backend == "torchao":
        if scheme == "block":
            from torchao.kernel.blockwise_quantization import blockwise_fp8_gemm

            y = blockwise_fp8_gemm(xq.contiguous(), xs.contiguous(), weight, ws.contiguous(), block_size=128)
        else:
            from torchao.float8.inference import addmm_float8_unwrapped_inference

            return addmm_float8_unwrapped_inference(xq, xs, weight.t(), ws.reshape(1, -1), output_dtype=out_dtype,
                                                    use_fast_accum=fast_accum)
    else:
        raise ValueError(backend)
    return y if y.dtype == out_dtype else y.to(out_dtype)


def probe(backend: str, scheme: str, device: torch.device) -> str | None:
    """Run one small GEMM and compare it with the reference backend: None when it works, else why not.

    Only for fbgemm (precompiled kernels, a few milliseconds): torchao's Triton block kernel would autotune
    48 configurations for the probe's shape, so torchao is reported from its import and the GPU alone."""
    key = (backend, scheme, str(device))
    if key in _probed:
        return _probed[key]
    from fp8kit.rl.fp8_linear import fp8_matmul, quantize_activation

    why = None
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(64, 512, device=device, generator=g, dtype=torch.bfloat16)
        w = torch.randn(256, 512, device=device, generator=g) * 0.02
        from fp8kit.converter.schemes import SCHEMES as WEIGHT_SCHEMES, quantize_weight

        wq, wsc = quantize_weight(w, WEIGHT_SCHEMES[scheme], torch.float32)
        xq, xsc = quantize_activation(x, scheme)
        got = matmul(backend, xq, xsc, wq, wsc.float(), scheme, torch.bfloat16).float()
        ref = fp8_matmul(xq, xsc, wq, wsc.float(), scheme, torch.float32, "reference")
        err = float((got - ref).norm() / ref.norm())
        if not err < 1e-2:
            why = f"{backend} {scheme} GEMM differs from the reference by {err:.3g} (relative) on this GPU"
    except Exception as e:  # noqa: BLE001 - a kernel that fails here is reported, not raised
        why = f"{backend} {scheme} GEMM failed on this GPU: {_first_line(e)}"
    _probed[key] = why
    return why


def report(backend: str, device: torch.device) -> dict:
    """{"package", "version", "schemes": [runnable here], "unsupported": {scheme: why}} for one backend."""
    out = {"package": PACKAGES[backend][0], "version": version(backend), "schemes": [], "unsupported": {}}
    try:
        require(backend)
    except Exception as e:  # noqa: BLE001
        out["unsupported"] = {s: str(e) for s in SCHEMES}
        return out
    for scheme in SCHEMES:
        why = unsupported(backend, scheme, device)
        if why is None and backend == "fbgemm":
            why = probe(backend, scheme, device)
        if why is None:
            out["schemes"].append(scheme)
        else:
            out["unsupported"][scheme] = why
    return out


def available_backends(device: torch.device | str | None = None) -> dict[str, dict]:
    """What each backend runs on `device` (default: the current CUDA GPU if any, else the CPU):
    {backend: {"schemes": [schemes it runs here], "unsupported": {scheme: why}}, with "package" and
    "version" for fbgemm and torchao}. fbgemm's kernels are tried once each on a small GEMM."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    try:
        import triton  # noqa: F401

        no_triton = None
    except ImportError:
        no_triton = "triton is not installed"
    out = {"reference": {"schemes": list(SCHEMES), "unsupported": {}}}
    for name in ("torch", "triton"):
        entry = {"schemes": [], "unsupported": {}}
        for scheme in SCHEMES:
            if capability is None:
                why = f"backend {name!r} runs on CUDA GPUs only"
            elif capability < (8, 9):
                why = f"FP8 GEMMs need SM89+, this GPU is SM{capability[0]}{capability[1]}"
            elif scheme == "block" and capability[0] != 9 and no_triton:
                # cuBLAS scales blocks on SM90 only; elsewhere the block GEMM is fp8kit's Triton kernel
                why = (f"block GEMMs on SM{capability[0]}{capability[1]} need Triton (cuBLAS scales 128x128 blocks "
                       f"on SM90 only): install triton")
            else:
                why = no_triton if name == "triton" else None
            if why:
                entry["unsupported"][scheme] = why
            else:
                entry["schemes"].append(scheme)
        out[name] = entry
    for name in LIBRARY_BACKENDS:
        out[name] = report(name, device)
    return out
