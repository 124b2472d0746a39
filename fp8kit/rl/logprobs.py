"""Completion-token log-probabilities without the [rows, tokens, vocabulary] logits tensor.

GRPO needs one log-probability per completion token, yet the model's own forward computes logits for every
position and vocabulary entry at once, and the log-softmax's backward keeps float32 copies of them: with
Qwen3's 151,936-entry vocabulary that is gigabytes per micro-batch, more than everything else the LoRA
training of a small model needs (evals/results/logprob_memory.json). Here the decoder runs once and the
output head over chunks of positions, so at most one chunk of logits exists at a time. For the usual frozen
nn.Linear head the gradient with respect to the hidden states is formed chunk by chunk in the forward, as
Liger-Kernel's fused linear cross-entropy does (d logp / d logits = onehot - softmax, times one GEMM with the
head weight), so nothing is recomputed; any other head (an FP8 one) is checkpointed per chunk and recomputed
in backward. The log-probabilities are the same operations split along positions (bitwise equal to the full
forward in float32 on the CPU); in bf16 the hidden-state gradient rounds at a different point than autograd's.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


# logits per chunk: 2**24 float32 values are 64 MiB (110 positions of Qwen3's vocabulary, 524 of Llama 2's)
CHUNK_LOGITS = 1 << 24
# model types whose ForCausalLM forward is lm_head(decoder(...).last_hidden_state), Gemma's optional final
# softcapping aside (transformers 5.17 modeling_*.py); each is checked against the full forward in
# tests/test_logprobs.py. Others run the model's own forward.
HEAD_ON_HIDDEN = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}
FP16_HEADROOM = 2.0 ** 15  # float16's largest finite value is 65504


def _fp16_gradient_scale(weight: torch.Tensor, temperature: float) -> float:
    """A power of two for d logp / d logits (onehot - softmax, |.| <= 1/T) before its float16 GEMM with the head
    weight: unscaled, probabilities under 6e-5 (float16's smallest normal) lose bits in the cast and those under
    3e-8 flush to zero (5% median error for confident tokens of a 152k vocabulary). The GEMM's result and every
    partial sum stay under sum |coef| * max|W| <= 2 max|W| / T, which the scale keeps within float16."""
    bound = max(2.0 * float(weight.abs().amax()), 1.0) / temperature
    return 2.0 ** max(0, min(24, math.floor(math.log2(FP16_HEADROOM / bound))))


def outside_nucleus(z: torch.Tensor, top_p: float, tokens: torch.Tensor) -> torch.Tensor:
    """True where top-p sampling drops a token of z [N, V] (logits / T): the smallest probabilities whose sum
    stays within 1 - top_p, the largest always kept, as vLLM's apply_top_k_top_p and transformers'
    TopPLogitsWarper both rule; the sampled `tokens` [N] are kept whatever the rule says, so an engine whose
    boundary token fell the other way by a rounding still scores a finite log-probability.

    With top_p < 1 the rollout engines report log-probabilities renormalized over this nucleus (vLLM's
    processed_logprobs; HFRollout the same), and the trainer scores the same renormalized distribution, with the
    nucleus taken from its own logits: over the full vocabulary every importance weight would carry the nucleus
    mass (0.9 at top_p 0.9, 0.5 at 0.5) instead of the engines' mismatch (trl#6789; verl and NeMo RL renormalize
    the trainer's side likewise). Ties exactly at the threshold are broken by the sort, as in the engines, so
    there the two sides may keep different twins."""
    sorted_z, order = torch.sort(z, dim=-1)
    drop = sorted_z.softmax(dim=-1).cumsum_(dim=-1) <= 1 - top_p
    drop[..., -1] = False
    del sorted_z
    return drop.scatter(-1, order, drop).scatter_(-1, tokens.unsqueeze(-1), False)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                     top_p: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[token] in float32 (over the top-p nucleus when top_p < 1), without materializing
    the full log-softmax twice."""
    logits = logits.float() / temperature
    if top_p < 1:
        shape = logits.shape
        flat, flat_tokens = logits.reshape(-1, shape[-1]), tokens.reshape(-1)
        step = max(1, CHUNK_LOGITS // shape[-1])  # the sort's values and int64 indices, a chunk of rows at a time
        drop = torch.cat([outside_nucleus(flat[i: i + step].detach(), top_p, flat_tokens[i: i + step])
                          for i in range(0, flat.shape[0], step)]) if flat.shape[0] else flat.bool()
        logits = flat.masked_fill(drop, float("-inf")).reshape(shape)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class _FusedHeadLogprobs(torch.autograd.Function):
    """log softmax(softcap(hidden @ W.T + b) / T)[tokens] for [N, H] hidden; backward from the [N, H] gradient
    the forward stored (W frozen: no weight gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, softcap, chunk, need_grad, top_p):
        out = torch.empty(tokens.shape, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        scale = _fp16_gradient_scale(weight, temperature) if need_grad and weight.dtype == torch.float16 else 1.0
        for start in range(0, tokens.numel(), chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(hidden[rows], weight, bias)
            if softcap is not None:  # in the model's dtype, as Gemma3ForCausalLM and vLLM apply it
                t = torch.tanh(logits / softcap)
                dcap = 1 - t.float().square() if need_grad else None  # d softcap(x) / dx = 1 - tanh(x / c)^2
                logits = t * softcap
            z = logits.float().div_(temperature)  # float32 (a copy unless it is already)
            if top_p < 1:  # the renormalized nucleus (outside_nucleus); dropped tokens get probability 0
                z.masked_fill_(outside_nucleus(z, top_p, tokens[rows]), float("-inf"))
            lse = torch.logsumexp(z, dim=-1)
            token = tokens[rows].unsqueeze(-1)
            out[rows] = z.gather(-1, token).squeeze(-1) - lse
            if need_grad:  # d logp / d logits = (onehot - softmax) / T, then the softcap's derivative
                coef = z.sub_(lse.unsqueeze(-1)).exp_().neg_()
                # the token's 1 - p as the sum of the other probabilities: for a confident token 1 - exp(0) is
                # 0 in float32 where the sum keeps its 1e-6 (autograd's log_softmax loses it, too)
                rest = coef.scatter_(-1, token, 0.0).sum(-1, keepdim=True).neg_()
                coef.scatter_(-1, token, rest).div_(temperature)
                if softcap is not None:
                    coef.mul_(dcap)
                if scale != 1.0:
                    coef.mul_(scale)
                grad[rows] = coef.to(weight.dtype) @ weight
        if need_grad:
            ctx.save_for_backward(grad)
            ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors  # float16: times ctx.scale, undone in float32 here
        return ((grad.float() * (grad_out / ctx.scale).unsqueeze(-1)).to(grad.dtype),
                None, None, None, None, None, None, None, None)


def _head_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, head: nn.Module, temperature: float,
                   softcap: float | None, top_p: float) -> torch.Tensor:
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return sampled_logprobs(logits, tokens, temperature, top_p)


def head_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, head: nn.Module, temperature: float = 1.0,
                  softcap: float | None = None, chunk: int | None = None, top_p: float = 1.0) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[tokens] in float32 (over the top-p nucleus when top_p < 1):
    hidden [..., H], tokens [...] -> [...], `chunk` positions at a time (default: CHUNK_LOGITS logits)."""
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    chunk = chunk or max(1, CHUNK_LOGITS // vocab)
    if flat_tokens.numel() == 0:
        return torch.zeros(tokens.shape, dtype=torch.float32, device=hidden.device)
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    frozen = type(head) is nn.Linear and not any(p.requires_grad for p in head.parameters())
    if frozen:
        return _FusedHeadLogprobs.apply(flat_hidden, head.weight, head.bias, flat_tokens, temperature, softcap,
                                        chunk, need_grad, top_p).reshape(tokens.shape)
    pieces = []
    for start in range(0, flat_tokens.numel(), chunk):
        args = (flat_hidden[start: start + chunk], flat_tokens[start: start + chunk], head, temperature, softcap,
                top_p)
        pieces.append(checkpoint(_head_logprobs, *args, use_reentrant=False) if need_grad else _head_logprobs(*args))
    return torch.cat(pieces).reshape(tokens.shape)


def completion_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor, completion_ids: torch.Tensor, temperature: float,
                        chunk: int | None = None, top_p: float = 1.0) -> torch.Tensor:
    """The log-probabilities [rows, T] of completion_ids, the last T tokens of input_ids, under
    softmax(logits / temperature), renormalized over the top-p nucleus when top_p < 1."""
    length = completion_ids.shape[1]
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if model.config.model_type in HEAD_ON_HIDDEN:
        hidden = model.model(**inputs).last_hidden_state[:, -(length + 1): -1]
        softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        return head_logprobs(hidden, completion_ids, model.lm_head, temperature, softcap, chunk, top_p)
    logits = model(**inputs, logits_to_keep=length + 1).logits[:, :-1]
    return sampled_logprobs(logits, completion_ids, temperature, top_p)
