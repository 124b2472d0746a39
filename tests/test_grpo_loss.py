"""GRPO-family losses against values worked out by hand (ratios 1.5, 0.5, 2, advantages +-1, epsilon 0.2)."""

import math

import pytest
import torch

from fp8kit.rl.grpo_loss import (
    LOSS_TYPES,
    group_advantages,
    reward_stds,
    mismatch_kl,
    policy_loss,
    token_kl,
    truncated_importance_weights,
)

L15, L05 = math.log(1.5), math.log(0.5)
LN2 = math.log(2.0)


def close(actual, expected, tol=1e-6):
    return torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                                      torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=0)


def batch(**over):
    """Two sequences with 2 and 3 completion tokens (T = 3); old_logp = 0, so logp is the log ratio.

    seq 0, A = +1, ratios 1.5, 0.5:  1.5 clipped high to 1.2 -> -1.2;  0.5 unclipped (A > 0) -> -0.5
    seq 1, A = -1, ratios 0.5, 1.5, 1:  0.5 clipped low to 0.8 -> +0.8;  1.5 unclipped (A < 0) -> +1.5;  1 -> +1
    masked sum = -1.7 + 3.3 = 1.6 over 5 tokens; 2 of them clipped; mean ratio (1.5+0.5+0.5+1.5+1)/5 = 1.
    Padding (seq 0, t = 2) holds nan and -inf: it must reach neither loss nor gradient.
    """
    kw = dict(
        logp=torch.tensor([[L15, L05, float("nan")], [L05, L15, 0.0]], requires_grad=True),
        old_logp=torch.tensor([[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]),
        advantages=torch.tensor([1.0, -1.0]),
        mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
    )
    kw.update(over)
    return kw


# ---- advantages -------------------------------------------------------------------------------------

REWARDS = torch.tensor([0.0, 1.0, 2.0, 5.0, 5.0, 5.0, 0.0, 2.0, 4.0])  # three groups of G = 3


def test_advantages_scaled_by_unbiased_group_std():
    # group [0,1,2]: mean 1, unbiased std 1 (the biased one would be sqrt(2/3)); [0,2,4]: std 2
    adv = group_advantages(REWARDS, num_generations=3)
    close(adv, [-1 / 1.0001, 0, 1 / 1.0001, 0, 0, 0, -2 / 2.0001, 0, 2 / 2.0001])


def test_advantages_unscaled_for_dr_grpo():
    close(group_advantages(REWARDS, 3, scale_rewards=False), [-1, 0, 1, 0, 0, 0, -2, 0, 2])


def test_advantages_scaled_by_the_batch_std_keep_the_group_mean():
    """TRL's scale_rewards="batch": (r - group mean) / (std of all B*G rewards + 1e-4), std Bessel-corrected.
    The nine rewards sum to 24 (mean 8/3) and their squares to 100: sum of squared deviations 100 - 9 * (8/3)^2 =
    36, std sqrt(36 / 8) = sqrt(4.5); the group-centred rewards are [-1, 0, 1], [0, 0, 0], [-2, 0, 2]."""
    std = math.sqrt(4.5)
    close(group_advantages(REWARDS, 3, scale_rewards="batch"),
          [-1 / (std + 1e-4), 0, 1 / (std + 1e-4), 0, 0, 0, -2 / (std + 1e-4), 0, 2 / (std + 1e-4)])
    # a batch of equal rewards: std 0, advantages 0; one completion per group: 0 as well
    assert group_advantages(torch.full((4,), 7.0), 2, scale_rewards="batch").eq(0).all()
    assert group_advantages(torch.tensor([1.0, 3.0]), 1, scale_rewards="batch").eq(0).all()


def test_an_unscored_completion_is_left_out_of_its_group_and_gets_advantage_0():
    """TRL (f2cd577, unscorable_mask): a completion every reward function returned None for is NaN, out of the
    group's mean and std. Group [1, 0, 1, -]: mean 2/3, std of [1, 0, 1] sqrt(1/3) (Bessel); counted as 0 it got
    advantage -0.866 and its group [0.866, -0.866, 0.866]. A group of no scored completion is all 0; in "batch" mode
    the NaN is out of the batch's std too."""
    nan = float("nan")
    std = math.sqrt(1 / 3)
    rewards = torch.tensor([1.0, 0.0, 1.0, nan, nan, nan, nan, nan])
    close(group_advantages(rewards, 4), [1 / 3 / (std + 1e-4), -2 / 3 / (std + 1e-4), 1 / 3 / (std + 1e-4), 0, 0, 0, 0, 0])
    close(group_advantages(rewards, 4, scale_rewards="none"), [1 / 3, -2 / 3, 1 / 3, 0, 0, 0, 0, 0])
    close(group_advantages(rewards, 4, scale_rewards="batch"), [1 / 3 / (std + 1e-4), -2 / 3 / (std + 1e-4),
                                                                1 / 3 / (std + 1e-4), 0, 0, 0, 0, 0])
    stds = reward_stds(rewards, 4)
    assert stds[:4].tolist() == pytest.approx([std] * 4) and stds[4:].isnan().all()
    close(reward_stds(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2, "batch"), [math.sqrt(1 / 3)] * 4)
    close(reward_stds(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2, "none"), [0.0] * 4)


def test_advantage_scaling_names_are_trls():
    torch.testing.assert_close(group_advantages(REWARDS, 3, scale_rewards="group"), group_advantages(REWARDS, 3))
    torch.testing.assert_close(group_advantages(REWARDS, 3, scale_rewards="none"),
                               group_advantages(REWARDS, 3, scale_rewards=False))
    for bad in ("std", "True", None, 1):
        with pytest.raises(ValueError, match="scale_rewards"):
            group_advantages(REWARDS, 3, scale_rewards=bad)


def test_identical_rewards_and_single_generation_give_zero_advantage():
    assert group_advantages(torch.full((4,), 7.0), 4).eq(0).all()
    assert group_advantages(torch.tensor([1.0, 3.0]), 1).eq(0).all()


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.7, 10.1, 1000.7, 12345.678, 1e6 + 0.1])
def test_a_group_of_equal_rewards_gets_exactly_zero(mode, value):
    """Rewards of any scale (lengths, scores): in float32 the rounded mean of eight 1000.7s left advantages of
    +-1.2 over the std's 0 + eps, pushing the policy where the group carries no signal."""
    for g in (2, 3, 6, 7, 8, 16, 64):
        rewards = torch.cat([torch.full((g,), value), torch.arange(g, dtype=torch.float32)])
        advantages = group_advantages(rewards, g, scale_rewards=mode)
        assert advantages.dtype == torch.float32 and torch.equal(advantages[:g], torch.zeros(g)), (g, advantages[:g])
        assert advantages[g:].abs().min() > 0 or g % 2  # the other group keeps its signal (odd g: a middle 0)


def test_advantages_length_must_divide():
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 2)


# ---- KL and importance weights ----------------------------------------------------------------------

def test_token_kl_k3_values():
    # exp(ref - logp) - (ref - logp) - 1
    kl = token_kl(torch.tensor([0.0, LN2, 0.3]), torch.tensor([LN2, 0.0, 0.3]))
    close(kl, [1 - LN2, LN2 - 0.5, 0.0])


def test_truncated_importance_weights_cap_and_detach():
    trainer = torch.tensor([L15, math.log(3.0), L05], requires_grad=True)
    w = truncated_importance_weights(trainer, torch.zeros(3), cap=2.0)
    close(w, [1.5, 2.0, 0.5])
    assert not w.requires_grad


def test_mismatch_kl_is_kl_rollout_to_trainer_over_mask():
    # exp(trainer - rollout) - (trainer - rollout) - 1: 1 - ln2 and 0; the padding 99 is ignored.
    # The other direction would give (ln2 - 0.5) / 2.
    kl = mismatch_kl(torch.tensor([[LN2, 0.0, 99.0]]), torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    close(kl, (1 - LN2) / 2)
    close(mismatch_kl(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1, 2)), 0.0)


# ---- the four loss types ----------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type, kwargs, expected", [
    ("grpo", {}, (-1.7 / 2 + 3.3 / 3) / 2),  # per-sequence means -0.85 and 1.1
    ("dapo", {}, 1.6 / 5),
    ("dr_grpo", {"max_completion_length": 4}, 1.6 / (2 * 4)),
    ("dr_grpo", {}, 1.6 / (2 * 3)),  # max_completion_length defaults to T
    ("dapo", {"epsilon_high": 0.28}, (1.6 + 1.2 - 1.28) / 5),  # 1.5 now clipped to 1.28
])
def test_token_level_losses(loss_type, kwargs, expected):
    out = policy_loss(**batch(), loss_type=loss_type, **kwargs)
    close(out.loss, expected)
    assert out.clip_ratio == pytest.approx(2 / 5)
    assert out.ratio_mean == pytest.approx(1.0)
    assert out.kl == 0.0


def test_gspo_uses_sequence_mean_of_log_ratio():
    # seq 0 token log ratios log 4, 0 -> sequence ratio exp(log 2) = 2 (token ratios 4 and 1);
    # seq 1: one token, ratio 0.5; seq 2: no tokens at all. epsilon 10: no clipping.
    kw = dict(logp=torch.tensor([[math.log(4.0), 0.0], [L05, 5.0], [3.0, 3.0]], requires_grad=True),
              old_logp=torch.zeros(3, 2), advantages=torch.tensor([1.0, -1.0, 1.0]),
              mask=torch.tensor([[True, True], [True, False], [False, False]]))
    out = policy_loss(**kw, loss_type="gspo", epsilon=10.0)
    close(out.loss, (-2.0 + 0.5 + 0.0) / 3)
    assert out.ratio_mean == pytest.approx((2.0 + 0.5) / 2)  # over the sequences with tokens
    assert out.clip_ratio == 0.0
    out.loss.backward()
    # d/dlogp of -A exp(s) / B with s the mean over n tokens: -A exp(s) / (n B), equal for all tokens
    close(kw["logp"].grad, [[-2 / 6, -2 / 6], [0.5 / 3, 0.0], [0.0, 0.0]])
    # token-level GRPO on the same batch sees ratios 4 and 1: (-(4 + 1) / 2 + 0.5 + 0) / 3
    close(policy_loss(**kw, epsilon=10.0).loss, (-2.5 + 0.5) / 3)
    # epsilon 0.2: 2 clipped to 1.2 (A > 0), 0.5 to 0.8 (A < 0)
    clipped = policy_loss(**kw, loss_type="gspo")
    close(clipped.loss, (-1.2 + 0.8) / 3)
    assert clipped.clip_ratio == 1.0


def test_beta_adds_kl_to_reference():
    # ref = logp - ln2 wherever counted: k3 = exp(-ln2) + ln2 - 1 = ln2 - 0.5 per token
    b = batch()
    ref = b["logp"].detach() - LN2
    out = policy_loss(**b, beta=0.1, ref_logp=ref)
    close(out.loss, 0.125 + 0.1 * (LN2 - 0.5))
    assert out.kl == pytest.approx(LN2 - 0.5)
    assert policy_loss(**batch(), ref_logp=ref).kl == 0.0  # beta 0: no KL term, none reported


def test_is_weights_scale_per_token_loss():
    w = torch.tensor([[2.0, 1.0, 5.0], [1.0, 1.0, 0.5]])
    # seq 0: (-1.2*2 - 0.5) / 2 = -1.45; seq 1: (0.8 + 1.5 + 0.5) / 3 = 2.8 / 3
    close(policy_loss(**batch(), is_weights=w).loss, (-1.45 + 2.8 / 3) / 2)
    close(policy_loss(**batch(), is_weights=torch.full((2, 3), 2.0), loss_type="dapo").loss, 2 * 1.6 / 5)


# ---- gradients --------------------------------------------------------------------------------------

def test_grpo_gradient_on_policy():
    # ratio 1 everywhere: d loss / d logp = -A / (n_tokens * B)
    logp = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-0.5, -0.5, -0.5, -0.5]], requires_grad=True)
    out = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]),
                      torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    out.loss.backward()
    close(logp.grad, [[-1 / 4, -1 / 4, 0, 0], [1 / 8, 1 / 8, 1 / 8, 1 / 8]])


def test_grpo_gradient_zero_on_clipped_tokens_and_padding():
    b = batch()
    policy_loss(**b).loss.backward()
    # unclipped tokens: -A * r / (n * B); clipped (0, 0) and (1, 0) and padding (0, 2): 0
    close(b["logp"].grad, [[0.0, -0.5 / 4, 0.0], [0.0, 1.5 / 6, 1.0 / 6]])


def test_low_precision_inputs_computed_in_float32():
    b = batch(logp=batch()["logp"].detach().bfloat16().requires_grad_())
    out = policy_loss(**b)
    assert out.loss.dtype == torch.float32
    close(out.loss, 0.125, tol=2e-2)  # bf16 rounds log 1.5 and log 0.5
    out.loss.backward()
    assert b["logp"].grad.dtype == torch.bfloat16 and torch.isfinite(b["logp"].grad).all()


# ---- errors -----------------------------------------------------------------------------------------

def test_errors():
    with pytest.raises(ValueError, match="dr_grpo"):  # the message lists LOSS_TYPES
        policy_loss(**batch(), loss_type="ppo")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(**batch(), beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(**batch(advantages=torch.ones(3)))
    with pytest.raises(ValueError, match="mask"):
        policy_loss(**batch(mask=torch.ones(2, 4)))
    assert set(LOSS_TYPES) == {"grpo", "dr_grpo", "dapo", "gspo"}
