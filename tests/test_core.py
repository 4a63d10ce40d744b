import math

import pytest
import torch

from rlhf_cli.ppo.core import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    gae,
    kl_penalty,
    last_token_index,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
)

torch.set_num_threads(1)

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# ----------------------------------------------------------------------------- logits


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_log_softmax(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 11, generator=g) * 3
    tokens = torch.randint(0, 11, (2, 4), generator=g)
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, tokens, temperature), expected)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_low_precision_computed_in_float32(temperature):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 3, 50, generator=g) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (2, 3), generator=g)
    out = logprobs_from_logits(logits, tokens, temperature)
    expected = torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_entropy_matches_definition(temperature):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 7, generator=g) * 2
    p = torch.softmax(logits / temperature, -1)
    expected = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits, temperature), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_with_grad_matches_entropy_from_logits(dtype):
    """logprobs_and_entropy(entropy_grad=True): the entropy loss term from the same log-softmax, with the
    values and gradients of entropy_from_logits, also where a token has probability 0."""
    from rlhf_cli.ppo.core import logprobs_and_entropy

    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, 3, 7, generator=g) * 2
    base[0, 0, 0] = -1e4  # probability 0 after the softmax
    a = base.clone().to(dtype).requires_grad_(True)
    b = base.clone().to(dtype).requires_grad_(True)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    _, ent = logprobs_and_entropy(a, tokens, 0.7, entropy_grad=True)
    want = entropy_from_logits(b, 0.7)
    torch.testing.assert_close(ent.float(), want, rtol=1e-5, atol=1e-5)
    ent.sum().backward()
    want.sum().backward()
    assert torch.isfinite(a.grad.float()).all()
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=1e-4, atol=1e-4)


def test_entropy_uniform_and_one_hot():
    uniform = torch.zeros(1, 1, 4)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.tensor([[math.log(4)]]))
    peaked = torch.tensor([[[0.0, -1e4, -1e4]]])
    assert entropy_from_logits(peaked).abs().item() < 1e-6


# ----------------------------------------------------------------------------- masked stats


def test_masked_sum_mean_var_hand_values():
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, 1e6])
    assert masked_sum(x, MASK).item() == 15.0
    torch.testing.assert_close(masked_sum(x, MASK, dim=1), torch.tensor([6.0, 9.0]))
    assert masked_mean(x, MASK).item() == pytest.approx(3.0)
    torch.testing.assert_close(masked_mean(x, MASK, dim=1), torch.tensor([2.0, 4.5]))
    # values 1..5: sum of squared deviations = 10
    assert masked_var(x, MASK).item() == pytest.approx(10 / 4)
    assert masked_var(x, MASK, unbiased=False).item() == pytest.approx(10 / 5)


def test_masked_stats_accept_bool_mask_and_ignore_nan_on_padding():
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, float("nan")])
    assert masked_mean(x, MASK.bool()).item() == pytest.approx(3.0)
    assert masked_var(x, MASK.bool()).item() == pytest.approx(2.5)


def test_masked_stats_degenerate_counts():
    x = t([7.0, 8.0])
    empty = torch.zeros(1, 2)
    single = t([1.0, 0.0])
    assert masked_mean(x, empty).item() == 0.0
    assert masked_var(x, empty).item() == 0.0
    assert masked_var(x, single).item() == 0.0
    assert torch.isfinite(masked_whiten(x, single)).all()


def test_masked_whiten_moments_and_padding():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=g) * 5 + 3
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 1:] = 0
    x[mask == 0] = 1e4  # would dominate the statistics if padding leaked in
    w = masked_whiten(x, mask)
    assert masked_mean(w, mask).item() == pytest.approx(0.0, abs=1e-5)
    assert masked_var(w, mask).item() == pytest.approx(1.0, abs=1e-4)
    assert (w[mask == 0] == 0).all()

    kept = masked_whiten(x, mask, keep_mean=True)
    assert masked_mean(kept, mask).item() == pytest.approx(masked_mean(x, mask).item(), abs=1e-4)
    assert (kept[mask == 0] == 0).all()


def test_masked_whiten_hand_values():
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, 0.0])
    w = masked_whiten(x, MASK, eps=0.0)
    std = math.sqrt(2.5)
    expected = t([-2 / std, -1 / std, 0.0], [1 / std, 2 / std, 0.0])
    torch.testing.assert_close(w, expected)


def test_global_whiten_over_two_processes_equals_whiten_of_concatenation():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5, generator=g) * 2 + 1
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1
    halves = [(x[:3], mask[:3]), (x[3:], mask[3:])]

    def local_stats(xi, mi):
        # What the other rank would contribute to the collective.
        return torch.stack([masked_sum(xi, mi), masked_sum(xi * xi, mi), mi.sum()])

    calls = []

    def fake_allreduce(other):
        def reduce(stats):
            calls.append(stats.shape)
            if stats.numel() == 3:
                return stats + local_stats(*other)
            return stats + torch.stack([masked_sum(*other), other[1].sum()])

        return reduce

    out = torch.cat(
        [
            masked_whiten(halves[0][0], halves[0][1], allreduce_sum=fake_allreduce(halves[1])),
            masked_whiten(halves[1][0], halves[1][1], allreduce_sum=fake_allreduce(halves[0])),
        ]
    )
    torch.testing.assert_close(out, masked_whiten(x, mask), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # one collective per call

    glob_mean = masked_mean(halves[0][0], halves[0][1], allreduce_sum=fake_allreduce(halves[1]))
    torch.testing.assert_close(glob_mean, masked_mean(x, mask))
    glob_var = masked_var(halves[0][0], halves[0][1], allreduce_sum=fake_allreduce(halves[1]))
    torch.testing.assert_close(glob_var, masked_var(x, mask))


# ----------------------------------------------------------------------------- last token


def test_last_token_index_with_pad_distinct_from_eos():
    pad, eos = 0, 2
    tokens = torch.tensor(
        [
            [eos, pad, pad, pad],  # length 1: only EOS
            [5, 6, 7, eos],  # full length
            [5, eos, pad, pad],  # middle
            [5, 6, 7, 8],  # truncated, no EOS, full length
        ]
    )
    mask = tokens != pad
    assert last_token_index(mask).tolist() == [0, 3, 1, 3]
    assert last_token_index(mask.float()).dtype == torch.long


def test_last_token_index_empty_row_is_zero():
    assert last_token_index(torch.zeros(2, 3)).tolist() == [0, 0]


# ----------------------------------------------------------------------------- KL and rewards


def test_kl_penalty_estimators_hand_values():
    d = math.log(2)
    lp, ref = torch.tensor([[d, 0.0]]), torch.tensor([[0.0, 0.0]])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([[d, 0.0]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([[0.5 - 1 + d, 0.0]]))
    torch.testing.assert_close(kl_penalty(ref, lp, "abs"), torch.tensor([[d, 0.0]]))
    torch.testing.assert_close(kl_penalty(ref, lp, "mse"), torch.tensor([[0.5 * d * d, 0.0]]))
    # k3 is non-negative for either sign of the log-ratio
    assert (kl_penalty(ref, lp, "k3") >= 0).all()


def test_kl_penalty_unknown_estimator():
    with pytest.raises(ValueError, match="k1.*k3.*abs.*mse"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k2")


def test_token_rewards_hand_example():
    scores = torch.tensor([2.0, -1.0, 5.0])
    lp = t([-1.0, -2.0, -0.5], [-1.0, -1.0, 9.0], [-0.3, 7.0, 7.0])
    ref = t([-1.5, -1.0, -0.5], [-2.0, -1.0, -9.0], [-0.1, 0.0, 0.0])
    mask = t([1, 1, 1], [1, 1, 0], [1, 0, 0])
    rewards, kl = token_rewards(scores, lp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, t([0.5, -1.0, 0.0], [1.0, 0.0, 0.0], [-0.2, 0.0, 0.0]))
    torch.testing.assert_close(
        rewards,
        t([-0.05, 0.1, 2.0], [-0.1, -1.0, 0.0], [0.02 + 5.0, 0.0, 0.0]),
    )


def test_token_rewards_tensor_coef_and_empty_row():
    scores = torch.tensor([3.0, 4.0])
    lp = t([0.0, 1.0], [1.0, 1.0])
    mask = t([1, 1], [0, 0])
    rewards, kl = token_rewards(scores, lp, torch.zeros(2, 2), mask, torch.tensor(0.5), estimator="abs")
    torch.testing.assert_close(rewards, t([0.0, -0.5 + 3.0], [0.0, 0.0]))
    torch.testing.assert_close(kl, t([0.0, 1.0], [0.0, 0.0]))


# ----------------------------------------------------------------------------- GAE


def reference_gae(rewards, values, gamma, lam):
    """Plain-python GAE over one unpadded row."""
    adv, running = [0.0] * len(rewards), 0.0
    for i in reversed(range(len(rewards))):
        next_v = values[i + 1] if i + 1 < len(rewards) else 0.0
        running = rewards[i] + gamma * next_v - values[i] + gamma * lam * running
        adv[i] = running
    return adv, [a + v for a, v in zip(adv, values)]


def test_gae_hand_computed():
    gamma, lam = 0.9, 0.8
    rewards = t([1.0, 0.0, 2.0], [0.5, 1.0, 0.0])
    values = t([0.5, 1.0, 1.5], [0.2, 0.4, 0.0])
    # Row 0 by hand:
    #   δ2 = 2 - 1.5 = 0.5                A2 = 0.5
    #   δ1 = 0 + 0.9*1.5 - 1 = 0.35       A1 = 0.35 + 0.72*0.5 = 0.71
    #   δ0 = 1 + 0.9*1.0 - 0.5 = 1.4      A0 = 1.4 + 0.72*0.71 = 1.9112
    # Row 1 (length 2):
    #   δ1 = 1 - 0.4 = 0.6                A1 = 0.6
    #   δ0 = 0.5 + 0.9*0.4 - 0.2 = 0.66   A0 = 0.66 + 0.72*0.6 = 1.092
    adv, ret = gae(rewards, values, MASK, gamma, lam)
    torch.testing.assert_close(adv, t([1.9112, 0.71, 0.5], [1.092, 0.6, 0.0]))
    torch.testing.assert_close(ret, t([2.4112, 1.71, 2.0], [1.292, 1.0, 0.0]))

    ref_adv, ref_ret = reference_gae([1.0, 0.0, 2.0], [0.5, 1.0, 1.5], gamma, lam)
    torch.testing.assert_close(adv[0], torch.tensor(ref_adv))
    torch.testing.assert_close(ret[0], torch.tensor(ref_ret))


def test_gae_ignores_values_and_rewards_on_padding():
    g = torch.Generator().manual_seed(5)
    rewards = torch.randn(3, 5, generator=g)
    values = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]).float()
    adv, ret = gae(rewards, values, mask, 0.95, 0.9)
    dirty_values = values.masked_fill(mask == 0, 1e6)
    dirty_rewards = rewards.masked_fill(mask == 0, -1e6)
    adv2, ret2 = gae(dirty_rewards, dirty_values, mask.bool(), 0.95, 0.9)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(ret, ret2)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    for row in range(3):
        n = int(mask[row].sum())
        ref_adv, _ = reference_gae(rewards[row, :n].tolist(), values[row, :n].tolist(), 0.95, 0.9)
        torch.testing.assert_close(adv[row, :n], torch.tensor(ref_adv))


def test_gae_undiscounted_returns_are_reward_to_go():
    rewards = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    values = t([0.3, -0.7, 2.0], [1.0, 1.0, 1.0])
    _, ret = gae(rewards, values, MASK, 1.0, 1.0)
    torch.testing.assert_close(ret, t([6.0, 5.0, 3.0], [9.0, 5.0, 0.0]))


# ----------------------------------------------------------------------------- losses


def test_policy_loss_on_policy_is_minus_mean_advantage():
    lp = t([-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0])
    adv = t([1.0, -2.0, 4.0], [0.5, 1.5, 100.0])
    loss, stats = policy_loss(lp, lp.clone(), adv, MASK, 0.2)
    assert loss.item() == pytest.approx(-(1 - 2 + 4 + 0.5 + 1.5) / 5)
    assert stats["clipfrac"].item() == 0.0
    assert stats["approxkl"].item() == 0.0
    assert stats["ratio"].item() == pytest.approx(1.0)
    for v in stats.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_policy_loss_clipped_hand_case():
    eps = 0.2
    # token 0: ρ = 1.5, A = +1 -> clipped: max(-1.5, -1.2) = -1.2, clipped term larger
    # token 1: ρ = 0.5, A = +1 -> unclipped: max(-0.5, -0.8) = -0.5
    # token 2: ρ = 0.5, A = -2 -> clipped: max(1.0, 1.6) = 1.6, clipped term larger
    old = torch.zeros(1, 3)
    lp = torch.log(t([1.5, 0.5, 0.5])).requires_grad_()
    adv = t([1.0, 1.0, -2.0])
    mask = torch.ones(1, 3)
    loss, stats = policy_loss(lp, old, adv, mask, eps)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.6) / 3)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    d = [math.log(1.5), math.log(0.5), math.log(0.5)]
    assert stats["approxkl"].item() == pytest.approx(0.5 * sum(x * x for x in d) / 3)
    assert stats["ratio"].item() == pytest.approx((1.5 + 0.5 + 0.5) / 3)

    loss.backward()
    # d/dlp of -A·ρ/3 = -A·ρ/3 on the unclipped token; nothing flows through clipped ones.
    torch.testing.assert_close(lp.grad, t([0.0, -0.5 / 3, 0.0]))


def test_policy_loss_ignores_padding():
    lp = t([0.0, 0.0, 50.0])
    loss, stats = policy_loss(lp, torch.zeros(1, 3), t([2.0, 4.0, float("nan")]), t([1, 1, 0]), 0.2)
    assert loss.item() == pytest.approx(-3.0)
    assert stats["ratio"].item() == pytest.approx(1.0)


def test_value_loss_hand_numbers():
    eps = 0.5
    values = t([1.0, 3.0, 0.0], [2.0, 0.0, 7.0])
    old = t([0.0, 2.0, 0.0], [2.0, 1.0, 0.0])
    returns = t([2.0, 2.0, 1.0], [1.0, 0.0, 0.0])
    # token (0,0): V_clip = 0.5; (V-R)² = 1, (Vc-R)² = 2.25 -> 2.25, clipped
    # token (0,1): V_clip = 2.5; 1 vs 0.25 -> 1
    # token (0,2): V_clip = 0;   1 vs 1 -> 1, not counted as clipped
    # token (1,0): V_clip = 2;   1 vs 1 -> 1
    # token (1,1): V_clip = 0.5; 0 vs 0.25 -> 0.25, clipped
    loss, stats = value_loss(values.requires_grad_(), old, returns, MASK, eps)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1 + 1 + 1 + 0.25) / 5)
    assert stats["clipfrac"].item() == pytest.approx(2 / 5)
    # R = [2, 2, 1, 1, 0] (var 0.7); R - V = [1, -1, 1, -1, 0] (var 1.0)
    assert stats["explained_var"].item() == pytest.approx(1 - 1.0 / 0.7, rel=1e-5)
    loss.backward()
    assert values.grad[1, 2] == 0 and values.grad[0, 0] == 0


def test_value_loss_explained_var_perfect_and_degenerate():
    returns = t([1.0, 2.0, 3.0], [4.0, 5.0, 0.0])
    loss, stats = value_loss(returns.clone(), returns.clone(), returns, MASK, 0.2)
    assert loss.item() == 0.0
    assert stats["explained_var"].item() == pytest.approx(1.0)

    constant = torch.full((2, 3), 2.0)
    _, stats = value_loss(torch.zeros(2, 3), torch.zeros(2, 3), constant, MASK, 0.2)
    assert stats["explained_var"].item() == 0.0


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_hand_update():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=7.5, n_steps=256)  # error = 0.25 -> clipped to 0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    ctl.update(current_kl=5.4, n_steps=100)  # error = -0.1
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000))
    ctl.update(current_kl=0.0, n_steps=1000)  # error = -1 -> clipped to -0.2
    assert ctl.value == pytest.approx(0.2 * 1.00512 * 0.999 * 0.98)


def test_fixed_kl_controller_constant():
    ctl = FixedKLController(0.05)
    for kl in (0.0, 10.0, 1e6):
        ctl.update(kl, 512)
    assert ctl.value == 0.05


def test_kl_controller_state_dict_round_trip():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    ctl.update(2.0, 10)
    restored = AdaptiveKLController(0.1, target=1.0, horizon=100)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    ctl.update(0.5, 7)
    restored.update(0.5, 7)
    assert restored.value == ctl.value

    fixed = FixedKLController(0.3)
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.3
