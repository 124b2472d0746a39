"""torch.compile of the trainer's decoder layers (regional compilation), on only while the trainer computes.

At GRPO's micro-batches (8 sequences of 384 tokens) the eager FP8 LoRA step is bound by the host: on an H100, 32
Qwen3-8B-shaped layers took 290.6-343.7 ms against BF16's 251.0 ms, with less GPU time than BF16 (222.8 against
239.8 ms, evals/results/fp8_lora_h100_32layers_microbatch_profile.json). In an 8B GRPO run on an H100 compiling cut
the FP8 training phase from 8.94 to 5.65 s a step, BF16's from 6.34 to 5.30 s
(evals/results/grpo_gpu_h100_8b_compile.json). The layers are transformers'
GradientCheckpointingLayer modules, called through nn.Module's compiled-call slot as nn.Module.compile does, so
gradient checkpointing recomputes the compiled layer (the trainer checkpoints compiled layers reentrant: see
grpo._set_gradient_checkpointing). Rollouts stay eager: vLLM compiles its own model, and
transformers' generate would recompile for each decode length.

The sequence length is dynamic from the first compile: GRPO's batches change width from step to step, and dynamo
would otherwise compile a static graph first and compile again, with a dynamic length, at the first change. Compiling
the layers' graphs took 18.6-23.8 s of a step's training phase in an 8B run on an H100
(grpo_gpu_h100_8b_compile_traced_quant.json). Batches with and without padding compile a graph each: transformers
gives the layers an attention mask only where there is padding. With a mask, Inductor's CUDA attention also guards on
the length being a multiple of 8. So the trainer rounds its widths up to one and pads a batch that has no padding
(grpo._batch): a toy run on an H100 then compiled in its first step only, against steps 1, 3 and 4 unrounded
(grpo_toy_h100_compile_dynamic_length.json).

Inductor keeps the roundings to the model dtype between the ops it fuses (emulate_precision_casts), as the runtime's
vLLM engine does for FP8 checkpoints (vllm_engine.KEEP_PRECISION_CASTS): the activations the trainer quantizes are
then the eager trainer's. Not every result is bit-equal to eager (the LoRA product and its scaling round separately
where eager's addmm rounds once)."""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.utils._pytree as pytree
from torch import nn

from fp8kit.errors import Fp8kitError

COMPILE_OPTIONS = {"emulate_precision_casts": True}
# graphs a layer may need: grad and no-grad passes, adapters on and off (beta's reference), a static then a dynamic
# length where the length is not dynamic from the start; layers alike share theirs, and the limit allows that many for
# each layer, for models whose layers differ in what their forward reads (Gemma 3's sliding and global attention)
GRAPHS_PER_LAYER = 8


def _call_layer(layer: nn.Module, *args, **kwargs):
    return layer._call_impl(*args, **kwargs)


@functools.cache
def _compiled_call():
    """One compiled function for every layer: the layer is its argument (parameters become graph inputs), so layers
    alike share a graph (checked by counting graphs: test_compiled_layers_share_one_graph_whatever_the_depth)."""
    return torch.compile(_call_layer, options=COMPILE_OPTIONS)


def _call_with_dynamic_length(layer: nn.Module, *args, **kwargs):
    """The compiled call, each input dimension of the hidden states' length marked dynamic first: the attention mask,
    position ids and rotary tables carry it too, and one left static would make dynamo specialize the length again.
    maybe_mark_dynamic, because a dimension only equal to the length by chance (a head dim of 128 at length 128) is
    then specialized without an error. Marked at every call: reentrant checkpointing recomputes on detached copies."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] > 1:
        length = hidden.shape[1]
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                for dim, size in enumerate(t.shape):
                    if size == length:
                        torch._dynamo.maybe_mark_dynamic(t, dim)
    return _compiled_call()(layer, *args, **kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def check_torch_compile(model: nn.Module) -> None:
    """What compiled_decoder_layers needs, checked before a run's first rollout: torch 2.7 or later (dynamo's
    recompile_limit, Inductor's emulate_precision_casts) and transformers decoder layers in the model."""
    import torch._inductor.config as inductor_config

    if not hasattr(torch._dynamo.config, "recompile_limit") or not hasattr(inductor_config, "emulate_precision_casts"):
        raise Fp8kitError(f"torch_compile=True needs torch 2.7 or later (this is {torch.__version__}); upgrade torch "
                          f"or pass torch_compile=False")
    if not decoder_layers(model):
        raise Fp8kitError(f"torch_compile=True: {type(model).__name__} has no transformers decoder layers "
                          f"(GradientCheckpointingLayer) to compile; pass torch_compile=False")


def _fused_forwards(layers: list[nn.Module]) -> dict[nn.Module, object]:
    """fp8_mlp's fused MLP forwards, set on each MLP instance: dynamo guards on such an object's identity, so each
    layer would compile a graph of its own. Compiled, the fused MLP runs transformers' forward anyway
    (fp8_mlp.fused_gated_mlp_forward), so they are set aside while the layers run compiled. Other instance forwards
    (accelerate's hooks) stay."""
    from fp8kit.rl.fp8_mlp import _FusedForward

    return {m: m.__dict__["forward"] for layer in layers for m in layer.modules()
            if isinstance(m.__dict__.get("forward"), _FusedForward)}


@contextmanager
def compiled_decoder_layers(model: nn.Module, enabled: bool = True, dynamic_length: bool = True):
    """Within the block each decoder layer of `model` runs compiled (compiling at its first call); after it, each
    runs as before (eager, or a compiled call the caller had set). dynamic_length=False compiles a static graph
    first, as dynamo does by default (evals/bench_fp8_lora.py times layers at one length so)."""
    layers = decoder_layers(model) if enabled else []
    if not layers:
        yield
        return
    before = [m._compiled_call_impl for m in layers]  # nn.Module.compile's slot; None: eager
    forwards = _fused_forwards(layers)
    for m in forwards:
        del m.forward
    for m in layers:
        m._compiled_call_impl = functools.partial(_call_with_dynamic_length if dynamic_length else _compiled_call(), m)
    limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_LAYER * len(layers))
    try:
        with torch._dynamo.config.patch(recompile_limit=limit,
                                        accumulated_recompile_limit=max(
                                            torch._dynamo.config.accumulated_recompile_limit, limit)):
            yield
    finally:
        for m, impl in zip(layers, before):
            m._compiled_call_impl = impl
        for m, forward in forwards.items():
            m.forward = forward
