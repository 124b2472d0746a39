"""A frozen FP8 Linear with a trainable LoRA: the training half of FP8 RL.

The base weight stays float8_e4m3fn with its scale; activations are quantized the way vLLM quantizes
them for the same checkpoint (per token for per-channel and per-tensor weights, per 1x128 group for 128x128
blocks), so the trainer and the rollout engine compute the same function up to
accumulation order. Every backend, the CPU one included, quantizes activations identically; the backends
differ only in how the FP8 product is computed. Backward produces gradients for the input and the LoRA
parameters only; the base weight is dequantized (or, with fp8_backward, transposed in FP8) transiently for the
input gradient and never kept.
"""

from __future__ import annotations

import math
import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.errors import Fp8kitError
from fp8kit.rl import kernel_backends
from fp8kit.rl.kernel_backends import available_backends  # noqa: F401 - re-exported

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for dynamic activation scales (fp8_utils)
# Output gradients are far smaller than activations (a GRPO loss averages over every completion token: rows of
# 1e-6 and below are usual), so vLLM's floor would quantize them to zero or to a few subnormal codes; theirs only
# keeps the scale a normal float32. (torchao's float8 training floors amax at 1e-12, float8_utils.EPS.)
GRAD_MIN_SCALE = torch.finfo(torch.float32).tiny
# reference: dequantize and multiply (any device, the CPU path); torch: torch's scaled_mm GEMMs with the
# activation quantized by torch ops (fused by torch.compile into its neighbours); triton: the same GEMMs with
# the activation quantized by one fused Triton kernel, eager or compiled; fbgemm, torchao: those libraries' GEMMs
# (kernel_backends.py lists the pairs they support) after the same fused quantizer when Triton is there.
LIBRARY_BACKENDS = kernel_backends.LIBRARY_BACKENDS
BACKENDS = ("reference", "torch", "triton", *LIBRARY_BACKENDS)


SCHEMES = kernel_backends.SCHEMES


def scale_shape_error(out_features: int, in_features: int, scale: torch.Tensor, scheme: str) -> str | None:
    """What is wrong with `scale` as the `scheme` scale of an out x in FP8 weight, or None: one value per output
    channel (dynamic), one value (tensor), one per 128x128 block (block)."""
    blocks = (-(-out_features // GROUP), -(-in_features // GROUP))
    fits = {"dynamic": scale.numel() == out_features, "tensor": scale.numel() == 1,
            "block": tuple(scale.shape) == blocks}[scheme]
    if fits:
        return None
    want = {"dynamic": f"{out_features} values (one per output channel)", "tensor": "one value",
            "block": f"shape {list(blocks)} (one per 128x128 block)"}[scheme]
    return f"{scheme} FP8 of a {out_features}x{in_features} weight needs {want}"


def quantize_activation(x: torch.Tensor, scheme: str,
                        min_scale: float = MIN_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scale): [M, 1] per token for per-channel and per-tensor weights (as
    vLLM does for dynamic activations whatever the weight strategy), [M, K/128] per group for block weights."""
    xf = x.float()
    if scheme == "block":
        scale = xf.reshape(x.shape[0], -1, GROUP).abs().amax(dim=2) / FP8_MAX
    else:
        scale = xf.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = scale.clamp_min(min_scale)
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


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, scheme: str, dtype: torch.dtype,
                 backend: str) -> torch.Tensor:
    """dequantize_weight for the exact input gradient: on the GPU one Triton pass writing the same bytes
    (triton_quant.dequantize_weight_triton); compiled, Inductor fuses torch's ops itself."""
    if weight.is_cuda and backend != "reference" and not torch.compiler.is_compiling():
        try:
            from fp8kit.rl.triton_quant import dequantize_weight_triton
        except ImportError:
            pass
        else:
            return dequantize_weight_triton(weight, scale, scheme, dtype)
    return dequantize_weight(weight, scale, scheme, dtype)


def _dequantize_activation(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    if scheme == "block":
        return (q.float().reshape(q.shape[0], -1, GROUP) * scale[:, :, None]).reshape(q.shape)
    return q.float() * scale


BLOCK_ON_CPU = ("the 'torch' and 'triton' backends run block FP8 GEMMs on CUDA GPUs only; on the CPU leave the backend "
                "unset (FP8KIT_BACKEND too): the 'reference' backend computes the same function")


def cublas_block_scaling(device: torch.device) -> bool:
    """Whether F.scaled_mm's 1x128 x 128x128 block scaling runs on this GPU: cuBLAS has it on SM90 only
    (torch's test_matmul_cuda.py expects every other architecture to fail it). Asked on the CPU (backend 'torch'
    there): one line, not torch's "not compiled with CUDA" assertion at the first forward."""
    if device.type != "cuda":
        raise Fp8kitError(BLOCK_ON_CPU)
    return torch.cuda.get_device_capability(device)[0] == 9


@torch.library.custom_op("fp8kit::block_scaled_mm", mutates_args=())
def block_scaled_mm(xq: torch.Tensor, weight: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * xs per 1x128 group) @ (weight * ws per 128x128 block).T: xq [M, K], weight [N, K], xs [M, K/128],
    ws [N/128, K/128], all row-major. A custom op because torch.compile (torch 2.11) cannot trace
    F.scaled_mm's block-wise path; as an opaque op it stays inside one graph. cuBLAS scales blocks on SM90 only;
    other GPUs (L4, RTX 40/50, Blackwell) run the same arithmetic as a Triton kernel, as vLLM does there."""
    if not cublas_block_scaling(xq.device) or weight.shape[0] % GROUP:
        try:
            from fp8kit.rl.triton_block_gemm import block_scaled_mm_triton
        except ImportError as e:
            raise Fp8kitError(f"a block FP8 GEMM of {xq.shape[0]}x{xq.shape[1]} by {weight.shape[0]}x{weight.shape[1]} "
                              f"needs Triton on this GPU (cuBLAS scales 128x128 blocks on SM90 only, and there only "
                              f"whole row blocks): pip install triton ({e})") from None
        return block_scaled_mm_triton(xq, weight, xs, ws, out_dtype)
    # cuBLAS block scaling (torch/_meta_registrations.py, is_1x128_128x128) wants outer-dim-major scales:
    # activation scales [M, K/128] with strides exactly (1, M), and weight scales [L4, N/128] with strides (1, L4),
    # L4 = K/128 rounded up to a multiple of 4 (zero rows past K/128), i.e. ws.t() over a padded buffer; it takes
    # N // 128 weight blocks, so a partial last row block goes to the Triton kernel above. Probed on an H100 (cuBLAS
    # of torch 2.11+cu130): M not a multiple of 4 is CUBLAS_STATUS_NOT_SUPPORTED (scale columns not 16-byte
    # aligned), so M is padded with up to 3 zero rows (one token of a batch-1 decode, an odd packed length); padded
    # weight scales give the float64 product for K/128 of 2, 7, 9 and 70 (Qwen2.5-1.5B's 8960, Gemma3-1B's 1152).
    m, k_blocks = xq.shape[0], ws.shape[1]
    pad = -m % 4
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        xs = torch.cat([xs, xs.new_ones(pad, xs.shape[1])])
    xs_cm = torch.empty_strided(xs.shape, (1, xs.shape[0]), dtype=xs.dtype, device=xs.device).copy_(xs)
    ws_rows = ws.new_zeros(ws.shape[0], -(-k_blocks // 4) * 4)
    ws_rows[:, :k_blocks] = ws
    out = F.scaled_mm(xq, weight.t(), xs_cm, F.ScalingType.BlockWise1x128,
                      ws_rows.t(), F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return out[:m].clone() if pad else out  # a custom op's output must not be a view (callers add bias in place)


@block_scaled_mm.register_fake
def _(xq, weight, xs, ws, out_dtype):
    return xq.new_empty((xq.shape[0], weight.shape[0]), dtype=out_dtype)


def gemm_aligned(weight: torch.Tensor) -> bool:
    """Whether the FP8 GEMM kernels take this weight: cuBLASLt's (torch._scaled_mm) and the libraries' need both of its
    dimensions in multiples of 16. vLLM pads such a weight with zeros for its CUTLASS kernel
    (kernels/linear/scaled_mm/cutlass.py process_weights_after_loading); the trainer computes that layer from the
    dequantized operands in float32 instead (the reference's function, transient copies only): such widths are rare
    in LLMs, and a padded copy would be a second weight."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_matmul(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, scheme: str,
               out_dtype: torch.dtype, backend: str, fast_accum: bool = False) -> torch.Tensor:
    """(xq * xs) @ (weight * ws).T with FP8 operands; float32 accumulation, or with fast_accum (per-token and
    per-tensor GEMMs on the GPU) Hopper's FP8 accumulator without periodic float32 promotion, as vLLM's SM90
    CUTLASS kernels accumulate (KernelTmaWarpSpecializedPingpongFP8FastAccum in
    csrc/quantization/w8a8/cutlass/c3x/scaled_mm_sm90_fp8_dispatch.cuh). Block GEMMs promote per 128-K block."""
    if backend == "reference" or not gemm_aligned(weight):
        return (_dequantize_activation(xq, xs, scheme) @ dequantize_weight(weight, ws, scheme, torch.float32).t()
                ).to(out_dtype)
    if scheme == "tensor":  # per-token activations and one weight scale: the row-wise GEMM, scale broadcast
        ws, scheme = ws.float().reshape(1).expand(weight.shape[0]).reshape(-1, 1).contiguous(), "dynamic"
    if backend in LIBRARY_BACKENDS:
        return kernel_backends.matmul(backend, xq, xs, weight, ws, scheme, out_dtype, fast_accum)
    if scheme == "block":
        return block_scaled_mm(xq, weight, xs, ws, out_dtype)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def quantize_grad(g: torch.Tensor, weight_scale: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The output gradient g [M, N] as the FP8 operand of the input-gradient GEMM g @ W.

    Blocks: per 1x128 group along N, as activations are; the weight's 128x128 block scales stay with the
    transposed weight. Per-channel and per-tensor: the weight's scale lies along this GEMM's reduction dimension,
    where a row-wise GEMM cannot apply it, so it is multiplied into g (float32) and g * scale is quantized per row."""
    if scheme == "block":
        return quantize_activation(g, "block", GRAD_MIN_SCALE)
    return quantize_activation(g.float() * weight_scale.float().reshape(1, -1), "dynamic", GRAD_MIN_SCALE)


def fp8_input_grad(gq: torch.Tensor, gs: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, scheme: str,
                   out_dtype: torch.dtype, backend: str, fast_accum: bool = False) -> torch.Tensor:
    """The input gradient from quantize_grad's operand: (gq * gs) @ dequantized W for blocks, (gq * gs) @ W_fp8
    otherwise (the weight scale is already in gq). On the GPU the FP8 GEMM needs W K-major along N, i.e. W.T
    contiguous (cuBLASLt and Hopper's FP8 wgmma take FP8 operands in TN layout only): one transposed FP8 copy
    of this weight lives for this product."""
    if backend == "reference" or not gemm_aligned(weight):
        g = _dequantize_activation(gq, gs, "block" if scheme == "block" else "dynamic")
        w = dequantize_weight(weight, ws, scheme, torch.float32) if scheme == "block" else weight.float()
        return (g @ w).to(out_dtype)
    wt = None
    if not torch.compiler.is_compiling():
        try:
            from fp8kit.rl.triton_quant import transpose_fp8

            wt = transpose_fp8(weight.contiguous())
        except ImportError:
            pass
    if wt is None:
        wt = weight.t().contiguous()
    if scheme == "block":  # W.T's 128x128 blocks are W's, their scales transposed
        return block_scaled_mm(gq, wt, gs, ws.t().contiguous(), out_dtype)
    ones = torch.ones(1, weight.shape[1], dtype=torch.float32, device=weight.device)
    return torch._scaled_mm(gq, wt.t(), scale_a=gs, scale_b=ones, out_dtype=out_dtype, use_fast_accum=fast_accum)


def pick_backend(device: torch.device, requested: str | None = None) -> str:
    """FP8KIT_BACKEND or the argument wins; otherwise `triton` on SM89+ GPUs (`torch`, scaled_mm, without the
    triton package), the reference elsewhere.

    fbgemm and torchao are used only when asked for (argument or FP8KIT_BACKEND); asking for one whose package
    (triton included) does not import raises Fp8kitError naming the package. available_backends() says what this machine runs."""
    requested = requested or os.environ.get("FP8KIT_BACKEND")
    if requested:
        if requested not in BACKENDS:
            raise Fp8kitError(f"backend {requested!r}: expected one of {', '.join(BACKENDS)}")
        if requested in LIBRARY_BACKENDS:
            kernel_backends.require(requested)
        elif requested == "triton":
            try:
                import triton  # noqa: F401
            except ImportError as e:
                raise Fp8kitError(f"backend 'triton' needs the triton package, which does not import here ({e}); "
                                  f"pip install triton, or pick another backend") from None
        return requested
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "reference"


class _LastQuantized:
    """The last input quantized, by identity: q/k/v (and gate/up) read the same tensor, so it is quantized once.
    A tensor whose version counter moved (written in place) or that died is quantized afresh."""

    def __init__(self):
        self.key = self.value = None

    def get(self, x: torch.Tensor, granularity: str, backend: str):
        if self.key is not None and self.key[0]() is x and self.key[1:] == (x._version, granularity, backend):
            return self.value
        return None

    def put(self, x: torch.Tensor, granularity: str, backend: str, value) -> None:
        self.key, self.value = (weakref.ref(x, self._drop), x._version, granularity, backend), value

    def _drop(self, ref) -> None:
        if self.key is not None and self.key[0] is ref:  # not a newer entry
            self.key = self.value = None


_last_quantized = _LastQuantized()


def _quantize_input_once(x: torch.Tensor, x2: torch.Tensor, scheme: str,
                         backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """_quantize_input, reusing the result when the same unmodified input tensor comes again (eager only)."""
    # compiled, each projection quantizes its input (the compiler does not merge the traced Triton kernel's calls on
    # an input q/k/v share, as it did the opaque operator's: _fused_quantizer); inference tensors have no version
    # counter to key on
    if torch.compiler.is_compiling() or x.is_inference():
        return _quantize_input(x2, scheme, backend)
    granularity = "block" if scheme == "block" else "token"
    hit = _last_quantized.get(x, granularity, backend)
    if hit is None:
        hit = _quantize_input(x2, scheme, backend)
        _last_quantized.put(x, granularity, backend, hit)
    return hit


def _fused_quantizer(backend: str):
    """Our Triton quantizer for triton (required) and fbgemm/torchao (if Triton is there), else None for the torch
    ops (the torch backend). Under torch.compile dynamo traces the kernel into the graph and Inductor launches it
    (the torch backend's ops are fused by the compiler into the neighbouring kernels instead). It was an opaque
    operator there before, which the compiler calls once for the input q/k/v (and gate/up) share, but whose host
    cost per call bound GRPO's micro-batches: on one H100, 32 compiled layers at 8 x 384 tokens with reentrant
    checkpointing took 221.0 ms a step traced and 263.8 ms opaque (BF16 240.8-247.7; on another H100 237.5 against
    251.5 ms), while 4 layers at 4 x 2048 took 45.4 against 45.2 ms with fp8_backward, 50.8 against 50.6 ms without
    (evals/results/fp8_lora_h100_*traced_quant.json, ..._quantizers.json)."""
    if backend not in ("triton", *LIBRARY_BACKENDS):
        return None
    try:
        from fp8kit.rl.triton_quant import quantize_activation_triton
    except ImportError:
        if backend == "triton":
            raise
        return None
    return quantize_activation_triton


def _quantize_input(x2: torch.Tensor, scheme: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activation's bytes, with the fused Triton kernel where the backend uses it."""
    fused = _fused_quantizer(backend)
    if fused is not None:
        return fused(x2.contiguous(), "block" if scheme == "block" else "dynamic")
    return quantize_activation(x2, scheme)


def _quantize_output_grad(g2: torch.Tensor, weight_scale: torch.Tensor, scheme: str,
                          backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_grad's bytes, with the fused Triton kernel where the forward uses it."""
    fused = _fused_quantizer(backend)
    if fused is None:
        return quantize_grad(g2, weight_scale, scheme)
    if scheme == "block":
        return fused(g2.contiguous(), "block", None, GRAD_MIN_SCALE)
    return fused(g2.contiguous(), "dynamic", weight_scale.float().reshape(-1).expand(g2.shape[1]).contiguous(),
                 GRAD_MIN_SCALE)


class _FP8MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x2, weight, weight_scale, scheme, backend, fp8_backward, fast_accum, xq=None, xs=None):
        """x: the layer's input as given (its identity keys the quantization cache); x2: x as [M, in]; xq, xs: x2
        already quantized for this scheme (fp8_mlp's fused kernel), if given."""
        if backend in LIBRARY_BACKENDS:
            kernel_backends.check(backend, scheme, x2.device, x2.dtype)
        if xq is None:
            xq, xs = _quantize_input_once(x, x2, scheme, backend)
        y = fp8_matmul(xq, xs, weight, weight_scale, scheme, x2.dtype, backend, fast_accum)
        ctx.save_for_backward(weight, weight_scale)
        ctx.scheme, ctx.backend, ctx.fp8_backward, ctx.fast_accum = scheme, backend, fp8_backward, fast_accum
        return y  # 2-D and fresh, never a view: add_lora accumulates into it in place

    @staticmethod
    def backward(ctx, grad_out):
        weight, weight_scale = ctx.saved_tensors
        grad_in = None
        # a block weight with a partial last row block (fp8-format checkpoints may have one) takes the exact
        # gradient: its output gradient does not split into 1x128 groups
        fp8_backward = ctx.fp8_backward and not (ctx.scheme == "block" and weight.shape[0] % GROUP)
        if ctx.needs_input_grad[1] and fp8_backward:
            gq, gs = _quantize_output_grad(grad_out, weight_scale, ctx.scheme, ctx.backend)
            grad_in = fp8_input_grad(gq, gs, weight, weight_scale, ctx.scheme, grad_out.dtype,
                                     "reference" if ctx.backend == "reference" else "torch", ctx.fast_accum)
        elif ctx.needs_input_grad[1]:  # the dequantized weight lives only for this product
            # fp16 would flush small scaled weights to subnormals: dequantize in float32 first
            dtype = torch.float32 if grad_out.dtype == torch.float16 else grad_out.dtype
            grad_in = grad_out @ _dequantized(weight, weight_scale, ctx.scheme, dtype, ctx.backend).to(grad_out.dtype)
        return None, grad_in, None, None, None, None, None, None, None, None


def check_lora_settings(rank, alpha, dropout, prefix: str = "") -> None:
    """Rank, alpha and dropout as numbers LoRA can take, each mistake one line (a torch error, or a model without
    LoRA, otherwise); `prefix` names them as the caller's arguments (load_model's lora_rank=...)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise Fp8kitError(f"{prefix}rank={rank!r}: expected an integer >= 0 (0: no LoRA)")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                              or not 0 < alpha < math.inf):
        raise Fp8kitError(f"{prefix}alpha={alpha!r}: expected a number > 0, or None for alpha = rank")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise Fp8kitError(f"{prefix}dropout={dropout!r}: expected a probability in [0, 1)")


def init_lora(module: nn.Module, rank: int, alpha: float | None, dropout: float, dtype: torch.dtype,
              device: torch.device) -> None:
    """LoRA A and B (PEFT's initialisation: Kaiming-uniform A, zero B) on a module with in/out_features."""
    check_lora_settings(rank, alpha, dropout)
    module.rank = rank
    module.scaling = (alpha if alpha is not None else rank) / rank if rank else 0.0
    module.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
    module.lora_dropout_rate = float(dropout)  # as configured: training turns the module's p off for a while
    if rank:
        module.lora_A = nn.Parameter(torch.empty(rank, module.in_features, dtype=dtype, device=device))
        module.lora_B = nn.Parameter(torch.zeros(module.out_features, rank, dtype=dtype, device=device))
        nn.init.kaiming_uniform_(module.lora_A, a=math.sqrt(5))
    else:
        module.lora_A = module.lora_B = None


def add_lora(module: nn.Module, x2: torch.Tensor, y2: torch.Tensor) -> torch.Tensor:
    """y2 += dropout(x2) @ A.T @ B.T * scaling, in place: the B product accumulates into the base output (beta=1),
    with no extra pass over it. x2 [M, in]; y2 [M, out], a fresh tensor (never a view). Adapters scaled to zero
    (the reference policy) cost nothing."""
    if module.lora_A is None or not module.scaling:
        return y2
    # LoRA weights kept in another dtype than the activations (peft's autocast_adapter_dtype keeps float32 ones in a
    # bf16 model): the input in theirs, the product back in y2's, as peft's Linear.forward casts
    x2 = x2.to(module.lora_A.dtype)
    if torch.compiler.is_compiling():  # the compiler fuses the add into the next kernel; addmm_ would cost a copy
        return y2 + ((module.lora_dropout(x2) @ module.lora_A.t()) @ module.lora_B.t() * module.scaling).to(y2.dtype)
    if torch.is_autocast_enabled(y2.device.type) or x2.dtype != y2.dtype:  # products in another dtype than y2's
        return y2.add_(((module.lora_dropout(x2) @ module.lora_A.t()) @ module.lora_B.t()).to(y2.dtype),
                       alpha=module.scaling)
    return y2.addmm_(module.lora_dropout(x2) @ module.lora_A.t(), module.lora_B.t(), alpha=module.scaling)


def flag_from_env(name: str, default: bool, on: str, off: str) -> bool:
    """A layer option for every layer built without the argument (load_fp8_model, load_model): FP8KIT_FP8_BACKWARD
    (default off) and FP8KIT_FAST_ACCUM (default on); on and off say what 1 and 0 mean in the error."""
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in ("0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise Fp8kitError(f"{name}={value!r}: expected 1 ({on}) or 0 ({off}), or unset it")


class FP8LoRALinear(nn.Module):
    """y = fp8(x) @ fp8(W).T + b + dropout(x) @ A.T @ B.T * alpha / r, with W frozen in FP8.

    fp8_backward: the input gradient is an FP8 GEMM too (the output gradient quantized per row with the weight's
    scale folded in, or per 1x128 group for blocks; a transposed FP8 copy of W lives for that product), about
    2.4% relative error against the exact gradient, as in FP8 training recipes. Off: the exact gradient from W
    dequantized to the compute dtype.

    fast_accum (default on, FP8KIT_FAST_ACCUM=0 turns it off): the per-token and per-tensor FP8 GEMMs accumulate
    as vLLM's do on Hopper, without float32 promotion; on an H100 that makes them 1.14x faster and the bf16
    output's relative error against a float64 product of the same FP8 operands at most 3.1e-3 instead of 1.7e-3
    (evals/results/fp8_gemm_h100.json)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, scheme: str, bias: torch.Tensor | None = None,
                 rank: int = 16, alpha: float | None = None, dropout: float = 0.0, dtype: torch.dtype = torch.bfloat16,
                 backend: str | None = None, fp8_backward: bool | None = None, fast_accum: bool | None = None):
        super().__init__()
        if weight.dtype != FP8 or weight.ndim != 2:
            raise Fp8kitError(f"weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
        if scheme not in SCHEMES:
            raise Fp8kitError(f"scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
        self.out_features, self.in_features = weight.shape
        if why := scale_shape_error(self.out_features, self.in_features, weight_scale, scheme):
            raise Fp8kitError(f"weight_scale of shape {list(weight_scale.shape)}: {why}")
        if scheme == "block" and self.in_features % GROUP:  # load_fp8_model refuses such checkpoints by file name
            raise Fp8kitError(f"block FP8 of a {self.out_features}x{self.in_features} weight: in_features must be a "
                              f"multiple of {GROUP} (activations are quantized in 1x{GROUP} groups, as vLLM's); keep "
                              f"this Linear in BF16, as fp8-convert does, or use the dynamic scheme")
        self.scheme = scheme
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", None if bias is None else bias.to(dtype))
        if backend is not None or os.environ.get("FP8KIT_BACKEND"):
            pick_backend(weight.device, backend)  # an unknown name or a missing package fails here, not later
        self.backend = backend
        self.fp8_backward = (flag_from_env("FP8KIT_FP8_BACKWARD", False, "FP8 input gradient", "exact")
                             if fp8_backward is None else bool(fp8_backward))
        self.fast_accum = (flag_from_env("FP8KIT_FAST_ACCUM", True, "fast accumulation, as vLLM", "float32 promotion")
                           if fast_accum is None else bool(fast_accum))
        init_lora(self, rank, alpha, dropout, dtype, weight.device)

    def forward(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x_fp8: x already quantized as quantize_activation quantizes it for this layer's scheme (values [M, in],
        scales), by the kernel that computed x (fp8_mlp)."""
        if x.shape[-1] != self.in_features:  # reshape's error named neither the layer's width nor the input's
            raise Fp8kitError(f"input of shape {tuple(x.shape)}: this FP8 layer takes {self.in_features} features "
                              f"in the last dimension")
        backend = self.backend or pick_backend(x.device)
        x2 = x.reshape(-1, self.in_features)
        xq, xs = x_fp8 if x_fp8 is not None else (None, None)
        y = _FP8MatMul.apply(x, x2, self.weight, self.weight_scale, self.scheme, backend, self.fp8_backward,
                             self.fast_accum, xq, xs)
        if self.bias is not None:
            y = y.add_(self.bias)
        return add_lora(self, x2, y).reshape(*x.shape[:-1], self.out_features)

    def _apply(self, fn, recurse=True):
        """`.half()`, `.to(dtype)` reach the LoRA and the bias, never the frozen FP8 weight or its float32 scale
        (they became 16-bit copies: twice the memory, the scale rounded); device moves reach everything."""
        weight, scale = self.weight, self.weight_scale
        super()._apply(fn, recurse)
        if self.weight.dtype != weight.dtype:
            self.weight = weight.to(self.weight.device)
        if self.weight_scale.dtype != scale.dtype:
            self.weight_scale = scale.to(self.weight_scale.device)
        return self

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}, rank={self.rank}"
