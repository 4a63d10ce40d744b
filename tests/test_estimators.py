"""The critic-free advantage estimators of `rlhf_cli.ppo.core` (GRPO with and without the std, RLOO,
REINFORCE++), the zero-spread group count, loss aggregation, and the config checks that go with them, on numbers
worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_cli.config import compose
from rlhf_cli.errors import RlhfError
from rlhf_cli.ppo import core
from rlhf_cli.ppo.config import PPOConfig

torch.set_num_threads(1)

# two prompts, three responses each (consecutive rows); response lengths 3, 2, 1, 3, 3, 2
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0],
                     [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
SCORES = torch.tensor([1.0, 2.0, 6.0, 5.0, 5.0, 5.0])  # group 0 spread out, group 1 all equal


def per_token(values: list[float]) -> torch.Tensor:
    """The expected (B, T) layout: each row's value on its valid tokens, 0 on padding."""
    return torch.tensor(values).unsqueeze(-1) * MASK


# ------------------------------------------------------------------------------------------------- GRPO
def test_grpo_with_std_hand_values():
    # group 0: mean 3, deviations −2, −1, 3; unbiased var (4 + 1 + 9)/2 = 7, std √7 = 2.6458
    # group 1: all 5 -> deviations 0, std 0 -> 0 / (0 + eps) = 0
    s7 = math.sqrt(7.0) + 1e-6
    expected = per_token([-2 / s7, -1 / s7, 3 / s7, 0.0, 0.0, 0.0])
    out = core.grpo_advantages(SCORES, MASK, group_size=3, scale_by_std=True)
    torch.testing.assert_close(out, expected)
    assert out[0, 0].item() == pytest.approx(-0.75593, abs=1e-5)
    assert out[2, 0].item() == pytest.approx(1.13389, abs=1e-5)


def test_grpo_without_std_is_dr_grpo_centred_rewards():
    out = core.grpo_advantages(SCORES, MASK, group_size=3, scale_by_std=False)
    torch.testing.assert_close(out, per_token([-2.0, -1.0, 3.0, 0.0, 0.0, 0.0]))


def test_grpo_two_responses_are_plus_minus_one_over_root_two():
    # n = 2: deviations ±d/2, unbiased std |d|/√2 -> ±1/√2 whatever d is
    out = core.grpo_advantages(torch.tensor([0.0, 10.0]), torch.ones(2, 1), group_size=2)
    torch.testing.assert_close(out[:, 0], torch.tensor([-1.0, 1.0]) / math.sqrt(2.0), atol=1e-6, rtol=0)


def test_grpo_ignores_padding_and_scales_nothing_by_length():
    out = core.grpo_advantages(SCORES, MASK, group_size=3)
    assert (out[MASK == 0] == 0).all()
    # every valid token of a response carries the same advantage, however long the response
    for row, m in zip(out, MASK):
        vals = row[m.bool()]
        assert torch.equal(vals, vals[:1].expand_as(vals))


# ------------------------------------------------------------------------------------------------- RLOO
def test_rloo_hand_values():
    # group 0 (1, 2, 6), sum 9: baselines (9−1)/2 = 4, (9−2)/2 = 3.5, (9−6)/2 = 1.5 -> −3, −1.5, 4.5
    # (= n/(n−1)·(r − mean) = 1.5 · (−2, −1, 3)); group 1 all equal -> 0
    out = core.rloo_advantages(SCORES, MASK, group_size=3)
    torch.testing.assert_close(out, per_token([-3.0, -1.5, 4.5, 0.0, 0.0, 0.0]))


def test_rloo_with_the_kl_in_the_sequence_reward():
    # the trainer passes r_i = score_i − β·Σ_t KL_i,t; with β = 0.5 and ΣKL = (2, 0): r = (−1, 1) -> ±2
    rewards = torch.tensor([0.0, 1.0]) - 0.5 * torch.tensor([2.0, 0.0])
    out = core.rloo_advantages(rewards, torch.ones(2, 2), group_size=2)
    torch.testing.assert_close(out, torch.tensor([[-2.0, -2.0], [2.0, 2.0]]))


# ------------------------------------------------------------------------------------------- REINFORCE++
def test_reinforce_pp_hand_values():
    # per-token rewards (−β·KL on each token, the score on the last), γ = 1:
    # row 0: (−0.1, −0.1, 1.0) -> reward-to-go (0.8, 0.9, 1.0); row 1: (−0.2, 0.5, pad) -> (0.3, 0.5)
    # over the 5 valid tokens: mean 0.7, deviations (0.1, 0.2, 0.3, −0.4, −0.2), Σd² = 0.34, unbiased var 0.085
    rewards = torch.tensor([[-0.1, -0.1, 1.0], [-0.2, 0.5, 7.0]])  # 7.0 sits on padding: ignored
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    std = math.sqrt(0.085 + 1e-8)
    expected = torch.tensor([[0.1, 0.2, 0.3], [-0.4, -0.2, 0.0]]) / std
    torch.testing.assert_close(core.reinforce_pp_advantages(rewards, mask), expected, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_discounted_return_before_whitening():
    # γ = 0.5, one row (−0.1, −0.1, 1.0): G = (−0.1 + 0.5·0.4, −0.1 + 0.5·1.0, 1.0) = (0.1, 0.4, 1.0)
    # mean 0.5, deviations (−0.4, −0.1, 0.5), unbiased var (0.16 + 0.01 + 0.25)/2 = 0.21
    out = core.reinforce_pp_advantages(torch.tensor([[-0.1, -0.1, 1.0]]), torch.ones(1, 3), gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[-0.4, -0.1, 0.5]]) / math.sqrt(0.21 + 1e-8), atol=1e-5, rtol=0)


def test_reinforce_pp_global_whitening_over_processes_uses_the_sum():
    # a fake 2-process all-reduce that adds the other half's moments: the result equals whitening the whole batch
    rewards = torch.tensor([[-0.1, -0.1, 1.0], [-0.2, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    whole = core.reinforce_pp_advantages(rewards, mask)
    other = torch.stack([core.masked_sum(x, mask[1:]) for x in (torch.tensor([[0.3, 0.5, 0.0]]),
                                                                torch.tensor([[0.09, 0.25, 0.0]]))]
                        + [mask[1:].sum()])
    half = core.reinforce_pp_advantages(rewards[:1], mask[:1], allreduce_sum=lambda t: t + other)
    torch.testing.assert_close(half, whole[:1], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- groups, losses
def test_equal_rewards_give_zero_advantage_and_are_counted():
    assert core.group_zero_spread(SCORES, 3).tolist() == [False, True]
    assert core.group_zero_spread(torch.tensor([0.0, 1.0, 1.0, 1.0]), 2).tolist() == [False, True]
    for out in (core.grpo_advantages(SCORES, MASK, 3), core.grpo_advantages(SCORES, MASK, 3, scale_by_std=False),
                core.rloo_advantages(SCORES, MASK, 3)):
        assert (out[3:] == 0).all()


def test_group_estimators_refuse_groups_of_one_and_ragged_batches():
    with pytest.raises(ValueError, match="group_size must be ≥ 2"):
        core.grpo_advantages(SCORES, MASK, group_size=1)
    with pytest.raises(ValueError, match="group_size must be ≥ 2"):
        core.rloo_advantages(SCORES, MASK, group_size=1)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        core.grpo_advantages(SCORES, MASK, group_size=4)


def test_loss_aggregation_token_and_sequence_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert core.aggregate_loss(x, mask, "token_mean").item() == pytest.approx(15 / 5)       # (1+2+3+4+5)/5
    assert core.aggregate_loss(x, mask, "sequence_mean").item() == pytest.approx((2 + 4.5) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        core.aggregate_loss(x, mask, "sum")


def test_policy_loss_sequence_mean_on_policy_is_minus_mean_of_row_means():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, _ = core.policy_loss(lp, lp, adv, mask, 0.2, aggregation="sequence_mean")
    assert loss.item() == pytest.approx(-(1.0 + 3.0) / 2)
    loss, _ = core.policy_loss(lp, lp, adv, mask, 0.2)
    assert loss.item() == pytest.approx(-(3.0 + 6.0) / 5)


# ------------------------------------------------------------------------------------------------ config
def ppo_config(*overrides: str) -> PPOConfig:
    return PPOConfig.from_cfg(compose("ppo", ["recipe=tiny", *overrides]).ppo)


def test_default_is_ppo_gae_with_a_critic_and_the_reward_model():
    c = ppo_config()
    assert (c.advantage, c.samples_per_prompt, c.reward, c.weights()) == ("gae", 1, ("model",), (1.0,))
    assert c.critic and c.uses_reward_model
    c.check(64)


@pytest.mark.parametrize("overrides, needle", [
    (["ppo.advantage=grpo"], "ppo.advantage=grpo compares the responses to one prompt, but ppo.samples_per_prompt=1"),
    (["ppo.advantage=rloo", "ppo.samples_per_prompt=1"], "set ppo.samples_per_prompt=4"),
    (["ppo.advantage=grpo", "ppo.samples_per_prompt=3"], "samples_per_prompt=3 does not divide the per-process batch"),
    (["ppo.reward=[model,rlhf_cli.demo:polite_reward]", "ppo.reward_weights=[1.0]"],
     "ppo.reward_weights has 1 value(s) for 2 reward source(s)"),
    (["ppo.reward=[model,model]"], "ppo.reward lists a source twice"),
])
def test_config_combinations_that_cannot_run(overrides, needle):
    with pytest.raises(RlhfError) as e:
        ppo_config(*overrides).check(64)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_critic_free_estimators_and_function_rewards():
    c = ppo_config("ppo.advantage=reinforce_pp", "ppo.reward=[rlhf_cli.demo:polite_reward]")
    assert not c.critic and not c.uses_reward_model
    c.check(64)  # reinforce_pp is not a group estimator: one response per prompt is fine
    c = ppo_config("ppo.advantage=grpo", "ppo.samples_per_prompt=4", "ppo.reward=[model,rlhf_cli.demo:polite_reward]",
                   "ppo.reward_weights=[1,0.5]")
    assert c.weights() == (1.0, 0.5) and c.uses_reward_model
    c.check(64)


@pytest.mark.parametrize("override, needle", [
    ("ppo.advantage=ppo", "ppo.advantage=ppo is unknown; use one of gae, grpo, rloo, reinforce_pp"),
    ("ppo.samples_per_prompt=0", "ppo.samples_per_prompt=0 is out of range"),
    ("ppo.loss_aggregation=sum", "ppo.loss_aggregation=sum is unknown; use token_mean or sequence_mean"),
    ("ppo.reward=[rewardmodel]", "ppo.reward: rewardmodel is not a reward source"),
    ("ppo.reward_weights=[a]", "ppo.reward_weights=[a] is not a list of numbers"),
    ("data.ground_truth=polite", "data.ground_truth=polite is unknown; use demo_polite or null, or a function"),
])
def test_new_keys_are_validated(override, needle):
    with pytest.raises(RlhfError) as e:
        compose("ppo", [override])
    assert str(e.value).startswith(needle), str(e.value)
