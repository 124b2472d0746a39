"""GRPO-family policy losses (GRPO, Dr. GRPO, DAPO, GSPO), with truncated importance sampling for an FP8
rollout engine whose log-probs differ from the trainer's.

The semantics follow TRL's GRPOTrainer (huggingface/trl, trl/trainer/grpo_trainer.py:
`_generate_and_score_completions` for advantages and the vLLM importance ratio, `_compute_loss` for the
loss; read at commit f2cd577), so a run here can be compared with a TRL run; departures are marked.
Everything is computed in float32, whatever the input dtype, because bf16 ratios exp(logp - old_logp)
are too coarse to clip at 1 +- 0.2 reliably.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo")


def _out_dtype(*xs: Tensor) -> torch.dtype:
    """Element-wise results keep their inputs' float dtype; integer rewards come back as float32."""
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype if dtype.is_floating_point else torch.float32


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Bessel-corrected std over the values that are not NaN (TRL's nanstd; NaN where fewer than two are)."""
    count = (~x.isnan()).sum(dim=dim, keepdim=keepdim)
    squares = ((x - x.nanmean(dim=dim, keepdim=True)) ** 2).nansum(dim=dim, keepdim=keepdim)
    return (squares / (count - 1)).sqrt().where(count > 1, float("nan"))


def _scale_mode(scale_rewards: bool | str) -> str:
    mode = ("group" if scale_rewards else "none") if isinstance(scale_rewards, bool) else scale_rewards
    if mode not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be True, False, 'group', 'batch' or 'none', got {scale_rewards!r}")
    return mode


def reward_stds(rewards: Tensor, num_generations: int, scale_rewards: bool | str = True) -> Tensor:
    """Each completion's reward std as TRL's scale_rewards takes it (its std_rewards, float64): its group's for
    "group" and "none" (where it only tells the zero-std groups apart), the batch's for "batch"; NaN rewards (no
    reward function scored the completion) left out, a group of one 0."""
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be 1-D with a length divisible by num_generations={num_generations}, "
                         f"got shape {tuple(rewards.shape)}")
    mode = _scale_mode(scale_rewards)
    grouped = rewards.double().view(-1, num_generations)
    if mode == "batch":
        std = nanstd(grouped) if grouped.numel() > 1 else torch.zeros((), dtype=torch.float64)
        return std.expand(grouped.numel())
    if num_generations == 1:
        return torch.zeros(grouped.numel(), dtype=torch.float64)
    return nanstd(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1)


def group_advantages(rewards: Tensor, num_generations: int, scale_rewards: bool | str = True,
                     eps: float = 1e-4) -> Tensor:
    """Group-relative advantages: the group mean is the baseline, so no value model is needed.

    `rewards` is [B*G], G consecutive completions per prompt; advantages are reward - group mean, divided as TRL's
    scale_rewards says (GRPOTrainer._generate_and_score_completions, "sum_then_normalize"):
    - True or "group": by the group's std + eps. The std is Bessel-corrected (torch.std's default) and `eps`
      keeps a group of equal rewards at advantage 0.
    - "batch": by the std of all B*G rewards + eps (Bessel-corrected; the PPO Lite recommendation); the mean
      subtracted is still the group's.
    - False or "none": not divided (Dr. GRPO: dividing by the std weights easy and hard prompts unequally).
    A group of one gets advantage 0, as TRL's num_generations == 1 branch. A NaN reward (a completion no reward
    function scored) is left out of the means and stds and gets advantage 0, as in TRL: counted as 0 it moved its
    group's baseline and was itself pushed down.
    """
    std = reward_stds(rewards, num_generations, scale_rewards)  # checks the arguments
    # float64: the mean of equal float32 rewards is then exactly theirs (in float32 a group of eight 1000.7s got
    # advantages of +-1.2 from the rounded mean over a std of 0 + eps)
    grouped = rewards.double().view(-1, num_generations)
    advantages = (grouped - grouped.nanmean(dim=1, keepdim=True)).reshape(-1)
    if _scale_mode(scale_rewards) != "none":
        advantages = advantages / (std + eps)
    return advantages.nan_to_num(0.0).to(_out_dtype(rewards))


def token_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(p || ref) per token, for tokens sampled from p (http://joschu.net/blog/kl-approx.html).

    Same formula as TRL's per_token_kl: exp(ref - logp) - (ref - logp) - 1, which is >= 0 token by token
    and so has a lower variance than log(p/ref). expm1 keeps it accurate when the two are close.
    """
    d = ref_logp.float() - logp.float()
    return (torch.expm1(d) - d).to(_out_dtype(logp, ref_logp))


def truncated_importance_weights(trainer_logp: Tensor, rollout_logp: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated importance sampling (TIS): re-weights tokens sampled by the FP8 rollout engine towards the
    trainer's distribution; the cap bounds the variance a few badly mismatched tokens could add.

    min(exp(trainer_logp - rollout_logp), cap) per token, detached: it is a constant weight, like TRL's
    vllm_importance_sampling_correction with vllm_importance_sampling_mode="token_truncate" (which takes
    old_per_token_logps, computed under no_grad; TRL's cap, vllm_importance_sampling_clip_max, now
    defaults to 3.0, formerly vllm_importance_sampling_cap=2.0). Padding positions are not special here:
    policy_loss ignores them through its mask.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    ratio = torch.exp(trainer_logp.detach().float() - rollout_logp.detach().float())
    return ratio.clamp(max=cap).to(_out_dtype(trainer_logp, rollout_logp))


def mismatch_kl(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> Tensor:
    """How far the trainer's distribution has drifted from the rollout engine's, as a metric (detached).

    Direction: KL(rollout || trainer). The tokens were sampled by the rollout engine, and k3 is unbiased
    only for the distribution that sampled, so this is token_kl(rollout_logp, trainer_logp) =
    exp(trainer - rollout) - (trainer - rollout) - 1, averaged over the tokens where mask != 0 (a 0-dim
    float32 tensor, 0 when no token is masked in).
    """
    keep = mask != 0
    zero = torch.zeros((), device=trainer_logp.device)
    trainer = torch.where(keep, trainer_logp.detach().float(), zero)
    rollout = torch.where(keep, rollout_logp.detach().float(), zero)
    kl = token_kl(rollout, trainer)
    return (kl * keep).sum() / keep.sum().clamp(min=1)


@dataclass
class LossOutput:
    """loss: scalar to backpropagate. kl: masked mean per-token KL to the reference (0.0 without one).
    clip_ratio: fraction of tokens (gspo: of sequences with completion tokens) where the clipped term
    was selected and differs from the unclipped one. ratio_mean: mean ratio over the same units."""

    loss: Tensor
    kl: float
    clip_ratio: float
    ratio_mean: float


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,
    is_weights: Tensor | None = None,
    max_completion_length: int | None = None,
) -> LossOutput:
    """Clipped surrogate loss of the GRPO family, as TRL's GRPOTrainer._compute_loss.

    logp (with grad), old_logp, ref_logp, is_weights and mask are [B, T]; advantages are [B]. A token
    counts where mask != 0; the other positions may hold anything (even inf/nan), they are zeroed
    before use so they reach neither the loss nor the gradient. old_logp, ref_logp, advantages and
    is_weights are treated as constants (TRL computes them under no_grad).

    - ratio r = exp(logp - old_logp); gspo (TRL's loss_type="grpo" with importance_sampling_level=
      "sequence") uses one ratio per sequence, exp of the masked mean of logp - old_logp, so the
      gradient flows through that mean.
    - per-token loss -min(r*A, clip(r, 1 - epsilon, 1 + epsilon_high)*A); epsilon_high defaults to
      epsilon whatever the loss type (DAPO's 0.28 is the caller's choice, as in TRL's config).
    - is_weights (e.g. truncated_importance_weights) multiply it, then beta * token_kl(logp, ref_logp)
      is added: the same order as TRL.
    - normalisation: grpo, gspo: masked mean per sequence, then mean over sequences; dr_grpo: masked sum
      / (B * max_completion_length), T when None; dapo: masked sum / number of masked tokens (TRL's
      num_items_in_batch on one process). Empty sequences count as one token, so nothing divides by 0.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp for the KL term")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("is_weights", is_weights)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp has {tuple(logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(logp.shape[:1])}, got {tuple(advantages.shape)}")
    if max_completion_length is not None and max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")

    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    batch, length = logp.shape
    keep = mask != 0
    weight = keep.float()
    zero = torch.zeros((), device=logp.device)

    def masked(t: Tensor) -> Tensor:
        # torch.where before any arithmetic: a nan/inf in padding would otherwise poison the gradient
        return torch.where(keep, t.float(), zero)

    logp32 = masked(logp)
    log_ratio = logp32 - masked(old_logp.detach())
    tokens = weight.sum(-1)  # [B]
    adv = advantages.detach().float().unsqueeze(1)  # [B, 1]

    if loss_type == "gspo":
        # TRL, importance_sampling_level="sequence": (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_w = (log_ratio * weight).sum(-1, keepdim=True) / tokens.clamp(min=1).unsqueeze(1)  # [B, 1]
    else:
        log_w = log_ratio  # [B, T]
    ratio = torch.exp(log_w)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(ratio * adv, clipped * adv).expand(batch, length)

    if is_weights is not None:
        per_token_loss = per_token_loss * masked(is_weights.detach())
    kl_value = 0.0
    if beta > 0:
        kl = token_kl(logp32, masked(ref_logp.detach()))
        per_token_loss = per_token_loss + beta * kl
        kl_value = ((kl.detach() * weight).sum() / weight.sum().clamp(min=1)).item()
    per_token_loss = per_token_loss * weight

    if loss_type in ("grpo", "gspo"):
        loss = (per_token_loss.sum(-1) / tokens.clamp(min=1)).mean()
    elif loss_type == "dr_grpo":
        loss = per_token_loss.sum() / (batch * (max_completion_length or length))
    else:  # dapo
        loss = per_token_loss.sum() / weight.sum().clamp(min=1)

    # TRL's clip metrics: low-clipped needs A < 0, high-clipped A > 0; otherwise min() picks r*A anyway
    with torch.no_grad():
        is_clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
        # gspo counts sequences with at least one completion token (TRL divides by all B sequences)
        units = (tokens > 0).float().unsqueeze(1) if loss_type == "gspo" else weight
        n_units = units.sum().clamp(min=1)
        clip_ratio = ((is_clipped.float() * units).sum() / n_units).item()
        ratio_mean = ((ratio * units).sum() / n_units).item()
    return LossOutput(loss=loss, kl=kl_value, clip_ratio=clip_ratio, ratio_mean=ratio_mean)
