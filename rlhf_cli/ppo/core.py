"""Pure tensor maths for PPO on language models (RLHF).

Every function works on (B, T) tensors laid out over response tokens, plus a
``mask`` (float or bool, (B, T)) that is 1 on real response tokens (EOS
included) and 0 on right padding. "Token mean" means the masked mean over all
valid tokens of the batch. Loss functions return ``(loss, stats)`` where the
stats are detached 0-dim tensors, so that logging never forces a host sync here.

References:
    [PPO]   Schulman et al. 2017, "Proximal Policy Optimization Algorithms".
    [GAE]   Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
    [Z19]   Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences".
    [N+]    Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO".
    [KLapx] Schulman 2020, "Approximating KL Divergence" (k1/k3 estimators).
    [GRPO]  Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning" (section 4.1).
    [DrGRPO] Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (section 3.1).
    [RLOO]  Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
            Human Feedback in LLMs"; the leave-one-out baseline of Kool et al. 2019, "Buy 4 REINFORCE Samples,
            Get a Baseline for Free!".
    [R++]   Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models".

Group estimators (grpo, rloo) take the B rows as B/n groups of n consecutive rows: the n responses to one prompt.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rlhf_cli.choices import KL_ESTIMATORS as _KL_ESTIMATORS  # the config's lists, defined once
from rlhf_cli.choices import LOSS_AGGREGATIONS

AllReduceSum = Callable[[Tensor], Tensor]

__all__ = [
    "LOSS_AGGREGATIONS",
    "AdaptiveKLController",
    "AllReduceSum",
    "FixedKLController",
    "aggregate_loss",
    "entropy_from_logits",
    "gae",
    "group_zero_spread",
    "grpo_advantages",
    "kl_penalty",
    "last_token_index",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "shape_scores",
    "token_rewards",
    "value_loss",
]


# --------------------------------------------------------------------------- logits


def position_ids_from(attention_mask: Tensor) -> Tensor:
    """(B, L) positions as generation sees them: cumsum(mask) - 1, 0 on left padding."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def limit_vocab(logits: Tensor, vocab_size: int | None) -> Tensor:
    """Logits (..., V) cut to the tokenizer's `vocab_size` ids where the model has more rows (real Qwen3: 151,669
    tokens, 151,936 rows): the rows past the tokenizer are never sampled and never enter a softmax."""
    return logits if vocab_size is None or vocab_size >= logits.shape[-1] else logits[..., :vocab_size]


def _scaled_float(logits: Tensor, temperature: float) -> Tensor:
    x = logits.float()
    return x if temperature == 1.0 else x / temperature


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log π(token) = logits[token]/τ − logsumexp(logits/τ).

    Shapes: logits (B, T, V), tokens (B, T) long -> (B, T), float32 (float64 kept).
    Source: standard LM log-likelihood; temperature scaling as in [N+] (the
    sampling temperature must be applied when scoring the samples).
    """
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        lse = torch.logsumexp(logits if temperature == 1.0 else logits / temperature, dim=-1)
    else:
        # Upcasting a bf16/fp16 (B, T, V) tensor at once doubles peak memory; one row at a
        # time bounds the float32 copy to (T, V) while keeping the reduction in float32.
        lse = torch.stack([torch.logsumexp(_scaled_float(row, temperature), dim=-1) for row in logits])
    return picked.to(lse.dtype) / temperature - lse


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """H = logsumexp(z) − Σ_v softmax(z)_v · z_v, with z = logits/τ.

    Shapes: logits (B, T, V) -> (B, T), float32.
    Source: identity −Σ p log p with log p = z − logsumexp(z); avoids log(0) for p = 0.
    """
    z = _scaled_float(logits, temperature)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def logprobs_and_entropy(logits: Tensor, tokens: Tensor, temperature: float = 1.0,
                         entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """``logprobs_from_logits`` and ``entropy_from_logits`` from one log-softmax.

    Shapes: logits (B, T, V), tokens (B, T) -> (B, T), (B, T). The log-probs carry gradients as
    ``logprobs_from_logits``'s do; the entropy is a detached statistic unless ``entropy_grad`` (an entropy term
    in the loss). Same formulas as the two functions.
    """
    if logits.dtype not in (torch.float32, torch.float64):
        if entropy_grad:
            entropy = entropy_from_logits(logits, temperature)
        else:
            # one row at a time, as logprobs_from_logits does: a (T, V) float32 copy at the peak, not (B, T, V)
            with torch.no_grad():
                entropy = torch.stack([entropy_from_logits(row, temperature) for row in logits.detach()])
        return logprobs_from_logits(logits, tokens, temperature), entropy
    z = logits if temperature == 1.0 else logits / temperature
    # log_softmax(z) = z − logsumexp(z); its fused backward is cheaper than logsumexp's on a (B, T, V) tensor
    logp = torch.log_softmax(z, dim=-1)
    logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # p = softmax(z), not logp.exp(): torch's CPU exp slows down where its result is denormal (inputs below about
    # -87, as the log-probs of unlikely tokens over a large vocabulary are), by 20x on a (256, 151936) block, while
    # softmax runs at the same speed at any offset (bench/probes/exp_probe.py)
    if entropy_grad:
        # H = −Σ p·log p; log p clamped to a finite floor so a token with p = 0 adds 0 and a 0 gradient
        entropy = -(torch.softmax(z, dim=-1) * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(dim=-1)
        return logprobs, entropy
    with torch.no_grad():
        # H = −Σ p·log p; nansum drops the 0·(−inf) terms of tokens with probability 0
        entropy = -(torch.softmax(z.detach(), dim=-1) * logp.detach()).nansum(dim=-1)
    return logprobs, entropy


# --------------------------------------------------------------------------- masked statistics


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x · mask over ``dim`` (all elements if None).

    Shapes: x, mask (B, T) -> 0-dim, or x with ``dim`` removed.
    """
    # where() instead of x * mask so that inf/nan sitting on padding cannot leak in.
    kept = torch.where(mask.bool(), x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(
    x: Tensor, mask: Tensor, dim: int | None = None, *, allreduce_sum: AllReduceSum | None = None
) -> Tensor:
    """Σ x · mask / Σ mask; 0 where there is no valid element.

    Shapes: x, mask (B, T) -> 0-dim, or x with ``dim`` removed.
    ``allreduce_sum`` (only with dim=None) makes it the global token mean across processes.
    """
    total = masked_sum(x, mask, dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    count = count.to(total.dtype)
    if allreduce_sum is not None:
        if dim is not None:
            raise ValueError("allreduce_sum is only meaningful with dim=None")
        total, count = allreduce_sum(torch.stack([total, count])).unbind()
    return total / count.clamp(min=1)


def _masked_mean_var(
    x: Tensor, mask: Tensor, unbiased: bool, allreduce_sum: AllReduceSum | None
) -> tuple[Tensor, Tensor]:
    # One-pass moments so that a distributed caller pays for a single collective.
    # Accumulate in at least float32: bf16 sums of squares lose the variance entirely.
    acc = x.to(torch.promote_types(x.dtype, torch.float32))
    stats = torch.stack(
        [masked_sum(acc, mask), masked_sum(acc * acc, mask), mask.bool().sum().to(acc.dtype)]
    )
    if allreduce_sum is not None:
        stats = allreduce_sum(stats)
    total, total_sq, count = stats.unbind()
    n = count.clamp(min=1)
    mean = total / n
    var = (total_sq / n - mean * mean).clamp(min=0)
    if unbiased:
        # With count <= 1 the correction is undefined; the biased value (0) is returned.
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), var)
    return mean.to(x.dtype), var.to(x.dtype)


def masked_var(
    x: Tensor, mask: Tensor, unbiased: bool = True, *, allreduce_sum: AllReduceSum | None = None
) -> Tensor:
    """Var[x] over valid tokens = (Σ x² / n − mean²) · n/(n−1 if unbiased else n).

    Shapes: x, mask (B, T) -> 0-dim. 0 for n = 0; for n = 1 the biased value (0).
    ``allreduce_sum`` makes it the global variance across processes (one collective).
    """
    return _masked_mean_var(x, mask, unbiased, allreduce_sum)[1]


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    keep_mean: bool = False,
    *,
    allreduce_sum: AllReduceSum | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """(x − mean) / sqrt(var + eps) (+ mean if keep_mean), 0 on padding.

    Shapes: x, mask (B, T) -> (B, T). Mean and unbiased var are over valid tokens
    (global across processes when ``allreduce_sum`` is given).
    Source: advantage whitening [N+]; reward whitening keeps the mean [Z19].
    """
    mean, var = _masked_mean_var(x, mask, True, allreduce_sum)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if keep_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def last_token_index(mask: Tensor) -> Tensor:
    """max{t : mask[b, t] = 1} per row; 0 for a row with no valid token.

    Shapes: mask (B, T) -> (B,) long. This is where the sequence score is placed [N+].
    """
    positions = torch.arange(mask.shape[-1], device=mask.device)
    # Taking the max valid position (rather than length − 1) stays right even if a
    # mask ever has holes, and an empty row naturally yields 0.
    return torch.where(mask.bool(), positions, 0).amax(dim=-1)


# --------------------------------------------------------------------------- rewards and advantages



def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL(π‖π_ref) estimate from samples of π, Δ = logπ − logπ_ref.

    k1 = Δ; k3 = (e^{−Δ} − 1) + Δ; abs = |Δ|; mse = ½Δ².
    Shapes: (B, T) -> (B, T). Source: [KLapx] (k1 unbiased; k3 unbiased and ≥ 0;
    abs/mse are biased but sometimes used as penalties).
    """
    delta = logprobs - ref_logprobs
    if estimator == "k1":
        return delta
    if estimator == "k3":
        return torch.expm1(-delta) + delta  # expm1 keeps precision where Δ ≈ 0
    if estimator == "abs":
        return delta.abs()
    if estimator == "mse":
        return 0.5 * delta.square()
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(_KL_ESTIMATORS)}")


def token_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float | Tensor,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """r_t = −β · KL_t + 1[t = last valid token] · score.

    Shapes: scores (B,), logprobs/ref_logprobs/mask (B, T) -> rewards (B, T), kl (B, T);
    both exactly 0 on padding. Source: [Z19] eq. 2, per-token layout of [N+].
    """
    valid = mask.bool()
    kl = kl_penalty(logprobs, ref_logprobs, estimator)
    kl = torch.where(valid, kl, torch.zeros_like(kl))
    rewards = -kl_coef * kl
    # A row with no response token has nowhere to put its score; dropping it keeps
    # padding rewards exactly 0.
    score = torch.where(valid.any(dim=-1), scores.to(rewards.dtype), 0.0)
    rewards = rewards.scatter_add(-1, last_token_index(mask).unsqueeze(-1), score.unsqueeze(-1))
    return rewards, kl


def shape_scores(
    rm_scores: Tensor,
    has_stop: Tensor,
    empty: Tensor,
    mean: float | None = None,
    std: float | None = None,
    missing_eos_penalty: float | None = None,
    empty_score: float | None = None,
) -> Tensor:
    """score = (rm − mean)/std, − missing_eos_penalty where no stop token was generated, and exactly
    ``empty_score`` for an empty response.

    Shapes: rm_scores, has_stop (bool), empty (bool) (B,) -> (B,). Each step is skipped when its argument is None.
    Source: score normalisation and the EOS penalty of [N+]; the empty-response score keeps a policy from
    learning to say nothing when the reward model happens to like silence.
    """
    scores = rm_scores.float()
    if mean is not None and std is not None:
        scores = (scores - float(mean)) / float(std)
    if missing_eos_penalty is not None:
        scores = torch.where(has_stop, scores, scores - float(missing_eos_penalty))
    if empty_score is not None:
        scores = torch.where(empty, torch.full_like(scores, float(empty_score)), scores)
    return scores


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """A_t = δ_t + γλ·A_{t+1}, δ_t = r_t + γ·V_{t+1} − V_t (V = 0 after the last valid token).

    Shapes: rewards, values, mask (B, T) -> advantages (B, T), returns = A + V (B, T);
    both 0 on padding, advantages not whitened. Source: [GAE] eq. 16, [N+].
    """
    valid = mask.bool()
    zeros = torch.zeros_like(values)
    # Values predicted on padding are arbitrary; zeroing them makes V_{T_end+1} = 0.
    values = torch.where(valid, values, zeros)
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    next_values = torch.cat([values[:, 1:], zeros[:, :1]], dim=1)
    next_valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1).to(values.dtype)
    deltas = rewards + gamma * next_values - values

    running = zeros[:, 0]
    advantages = []
    for t in reversed(range(values.shape[1])):
        running = deltas[:, t] + gamma * lam * next_valid[:, t] * running
        advantages.append(running)
    adv = torch.where(valid, torch.stack(advantages[::-1], dim=1), zeros)
    return adv, adv + values


def _grouped(scores: Tensor, group_size: int) -> Tensor:
    """(B,) -> (B/n, n): row g holds the n responses to prompt g (consecutive rows)."""
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"{scores.shape[0]} scores do not split into groups of {group_size}")
    return scores.reshape(-1, group_size)


def _on_tokens(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """(B,) -> (B, T): the sequence's value on each of its valid tokens, 0 on padding."""
    return torch.where(mask.bool(), per_sequence.unsqueeze(-1).expand(mask.shape), 0.0).to(per_sequence.dtype)


def group_zero_spread(scores: Tensor, group_size: int, tol: float = 1e-6) -> Tensor:
    """1[max − min ≤ tol] per group: every response to the prompt got the same reward, so a group estimator gives
    all of them advantage 0 and the prompt teaches nothing.

    Shapes: scores (B,) -> (B/n,) bool. Source: the `frac_reward_zero_std` diagnostic of TRL's GRPO trainer.
    """
    g = _grouped(scores, group_size)
    return (g.amax(-1) - g.amin(-1)) <= tol


def grpo_advantages(scores: Tensor, mask: Tensor, group_size: int, scale_by_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """A_i = (r_i − mean_g r) / (std_g r + eps) on every token of response i (scale_by_std=False: r_i − mean_g r).

    Shapes: scores (B,), mask (B, T) -> (B, T), 0 on padding; the std is the unbiased one of the group's n rewards.
    The reward is the score alone: GRPO puts the KL to the reference in the loss, β·k3 per token, not in the
    reward. Source: [GRPO] eq. 3 and "outcome supervision" (section 4.1.2); scale_by_std=False is [DrGRPO]'s
    correction (dividing by the std up-weights prompts that are almost always or almost never solved).
    A group with equal rewards gets exactly 0 either way.
    """
    if group_size < 2:
        raise ValueError(f"grpo compares the responses to one prompt: group_size must be ≥ 2, got {group_size}")
    g = _grouped(scores.float(), group_size)
    centred = g - g.mean(-1, keepdim=True)
    if scale_by_std:
        centred = centred / (g.std(-1, keepdim=True) + eps)
    return _on_tokens(centred.reshape(-1), mask)


def rloo_advantages(rewards: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """A_i = r_i − 1/(n−1) · Σ_{j≠i} r_j = n/(n−1) · (r_i − mean_g r) on every token of response i.

    Shapes: rewards (B,), mask (B, T) -> (B, T), 0 on padding. `rewards` is the sequence-level reward with the KL
    penalty already in it, r_i = score_i − β·Σ_t KL_i,t: RLOO treats the whole response as one action.
    Source: [RLOO] section 3 (REINFORCE with the leave-one-out baseline, KL in the reward), not whitened.
    """
    if group_size < 2:
        raise ValueError(f"rloo needs another response to the same prompt: group_size must be ≥ 2, got {group_size}")
    g = _grouped(rewards.float(), group_size)
    baseline = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    return _on_tokens((g - baseline).reshape(-1), mask)


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0, *,
                            allreduce_sum: AllReduceSum | None = None) -> Tensor:
    """A_t = whiten(G_t), G_t = Σ_{s≥t} γ^{s−t} r_s, whitened over every valid token of the (global) batch.

    Shapes: rewards, mask (B, T) -> (B, T), 0 on padding. `rewards` are per-token, the KL penalty on every token
    and the score on the last (`token_rewards`). No critic and no groups: the batch-wide normalisation is the
    baseline. Source: [R++] section 3 (token-level KL in the reward, global advantage normalisation).
    """
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)  # V = 0, λ = 1: the reward-to-go
    return masked_whiten(returns, mask, allreduce_sum=allreduce_sum)


# --------------------------------------------------------------------------- losses




def aggregate_loss(x: Tensor, mask: Tensor, aggregation: str = "token_mean") -> Tensor:
    """token_mean: Σ x·mask / Σ mask over the batch (every token weighs the same); sequence_mean: the mean over
    rows of each row's token mean (every response weighs the same, so a long one's tokens count less).

    Shapes: x, mask (B, T) -> 0-dim. Source: sequence_mean is [GRPO] eq. 3's 1/|o_i|; token_mean is PPO's
    [N+] and the fix [DrGRPO] argues for (no length bias).
    """
    if aggregation == "token_mean":
        return masked_mean(x, mask)
    if aggregation == "sequence_mean":
        return masked_mean(x, mask, dim=-1).mean()
    raise ValueError(f"unknown loss aggregation {aggregation!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}")


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cliprange: float,
    aggregation: str = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = token-mean max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε)), ρ = exp(logπ − logπ_old) (or the mean over sequences of
    each one's token mean, `aggregate_loss`).

    Shapes: (B, T) inputs -> 0-dim loss; stats clipfrac, approxkl (½·mean Δ²), ratio (token means).
    Source: [PPO] eq. 7 (clipped surrogate, negated for minimisation), stats as in [N+].
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = aggregate_loss(torch.maximum(unclipped, clipped), mask, aggregation)

    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "approxkl": 0.5 * masked_mean(log_ratio.square(), mask),
            "ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """L = ½ · token-mean max((V − R)², (V_clip − R)²), V_clip = V_old + clip(V − V_old, ±ε).

    Shapes: (B, T) inputs -> 0-dim loss; stats clipfrac and explained_var
    (1 − Var[R − V]/Var[R], 0 when Var[R] = 0). Source: [N+] (value clipping of the
    OpenAI baselines PPO), [PPO].
    """
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    err = (values - returns).square()
    err_clipped = (values_clipped - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), mask)

    with torch.no_grad():
        var_returns = masked_var(returns, mask)
        var_residual = masked_var(returns - values, mask)
        explained = 1.0 - var_residual / var_returns.clamp(min=torch.finfo(var_returns.dtype).tiny)
        stats = {
            "clipfrac": masked_mean((err_clipped > err).to(err.dtype), mask),
            "explained_var": torch.where(var_returns > 0, explained, torch.zeros_like(explained)),
        }
    return loss, stats


# --------------------------------------------------------------------------- KL coefficient control


class _KLController:
    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController(_KLController):
    """Constant KL coefficient β."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: β stays fixed."""


class AdaptiveKLController(_KLController):
    """β ← β · (1 + clip(KL/target − 1, ±0.2) · n_steps/horizon).

    Source: [Z19] section 2.2 (proportional controller towards a target KL).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β towards the value that keeps the measured KL at ``target``."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
