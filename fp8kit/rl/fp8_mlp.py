"""The SiLU-gated MLP of an FP8 model with SiLU, the multiply and the down projection's activation quantization in
one kernel (and their backward in another).

transformers' MLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`) runs SiLU and the multiply as two kernels, the
down projection then reads their product again to quantize it, and autograd keeps silu(g) besides g and u for the
backward. Here one Triton kernel writes h = silu(g) * u and its FP8 form, the down projection takes that FP8 form,
and the backward recomputes silu(g) from g and u in one elementwise pass: two passes over an MLP-wide activation
fewer in each direction and one MLP-wide tensor less kept per layer. The arithmetic is torch's (each op rounded to
the compute dtype, as the transformers MLP rounds and as vLLM's SiluAndMul does with the runtime's precision casts),
so the function is the one the MLP computed before. Unsloth writes its SwiGLU kernels by hand for the same reason
(unsloth/kernels/swiglu.py).

In eager mode only, where it pays: on an H100 (evals/results/fp8_lora_h100_fused_mlp.json, the LoRA bench's
Qwen3-8B-shaped layers) an eager FP8 step took 71.8 against 73.7 ms (80.9 against 84.5 without the FP8 input
gradient; evals/results/fp8_lora_h100_fused_mlp_eager.json, a later call: 73.3 against 75.0, block 77.2 against
80.5) and peaked 1.49 GB lower. Under torch.compile the MLP keeps transformers' forward: Inductor
fuses the LoRA additions of gate and up into SiLU and the multiply, which the opaque kernel prevented (48.4
against 46.3 ms a step, evals/results/fp8_lora_h100_fused_mlp_opaque.json). Where the backend quantizes
with torch ops (`torch`) or has no Triton the MLP keeps it too; the `reference` backend runs the fused wiring with
torch ops, which is what the CPU tests check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.rl.fp8_linear import FP8LoRALinear, _fused_quantizer, pick_backend, quantize_activation


def _gated_mlp(self, x):  # transformers' LlamaMLP.forward, Qwen2MLP, Qwen3MLP, MistralMLP, ... (5.x)
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _gated_mlp_returned(self, x):  # the same, returned directly
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_GATED_MLP_CODES = [(f.__code__.co_code, f.__code__.co_names) for f in (_gated_mlp, _gated_mlp_returned)]


def _is_gated_mlp(module: nn.Module) -> bool:
    """A module whose class forward is, bytecode for bytecode, transformers' gated MLP, with SiLU as its activation
    and FP8 layers for all three projections. A forward written otherwise (an added bias, a decorator, another
    activation: Gemma's GELU) keeps its own."""
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or (code.co_code, code.co_names) not in _GATED_MLP_CODES:
        return False
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return False
    return all(isinstance(getattr(module, n, None), FP8LoRALinear) for n in ("gate_proj", "up_proj", "down_proj"))


class _FusedForward:
    """The fused forward bound to one MLP, as an object pickle can name (a bound method of a function the MLP's class
    lacks could not be unpickled: torch.save of a layer failed on load)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fused_gated_mlp_forward(self.module, x)


def fuse_gated_mlps(model: nn.Module) -> int:
    """Gives every SiLU-gated MLP of `model` whose projections are FP8 layers the fused forward; returns how many."""
    count = 0
    for module in model.modules():
        if _is_gated_mlp(module):
            module.forward = _FusedForward(module)
            count += 1
    return count


class _SiluMulQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, scheme):
        from fp8kit.rl.triton_quant import silu_mul_quant_op

        h, q, s = silu_mul_quant_op(g, u, scheme)
        ctx.save_for_backward(g, u)  # silu(g) is recomputed: one tensor of the MLP's width less per layer
        ctx.mark_non_differentiable(q, s)
        ctx.set_materialize_grads(False)  # no zero-filled MLP-wide gradients made for q and s
        return h, q, s

    @staticmethod
    def backward(ctx, dh, dq, ds):
        from fp8kit.rl.triton_quant import silu_mul_backward_op

        if dh is None:  # h reached no loss
            return None, None, None
        g, u = ctx.saved_tensors
        dg, du = silu_mul_backward_op(dh, g, u)
        return dg, du, None


def silu_mul_quant(g: torch.Tensor, u: torch.Tensor, scheme: str,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, q, s): h = silu(g) * u for 2-D g and u, differentiable, and its FP8 form for a `scheme` layer
    (quantize_activation's bytes). The reference backend computes it with torch ops, the others in Triton."""
    if backend == "reference":
        h = F.silu(g) * u
        q, s = quantize_activation(h.detach(), scheme)
        return h, q, s
    return _SiluMulQuant.apply(g.contiguous(), u.contiguous(), scheme)


def fused_gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with silu_mul_quant between them; the transformers forward under
    torch.compile and where the backend quantizes with torch ops or without Triton."""
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    backend = down.backend or pick_backend(x.device)
    g, u = gate(x), up(x)
    if torch.compiler.is_compiling() or (backend != "reference" and _fused_quantizer(backend) is None):
        return down(self.act_fn(g) * u)
    h, q, s = silu_mul_quant(g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1]), down.scheme, backend)
    return down(h.reshape(g.shape), x_fp8=(q, s))
