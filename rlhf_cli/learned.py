"""Did a stage learn? One warning line, before the next stage builds on what it wrote.

- SFT: answers sampled for held-out prompts that rarely end (below SFT_MIN_EOS_RATE) or pass the data's checker
  less than half as often as the data's own answers to them (SFT_MIN_GROUND_TRUTH): the policy writes noise. The
  held-out loss and token accuracy do not tell: the demo's SFT ends at loss 4.9 and token accuracy 0.31 and
  answers well, one epoch on a 200-row file at 3.8 and 0.64 and writes noise;
- reward: the held-out preference accuracy below REWARD_MIN_ACCURACY;
- PPO: the reward model and the ground-truth checker disagreeing on more than GAMING_DISAGREEMENT of the responses
  (`objective/rm_gt_disagreement`) over GAMING_WINDOW updates, or the reward rising while the ground truth falls:
  the policy is gaming the reward model.
`rlhf ppo` repeats the SFT and reward warnings before its first update (`earlier_stage_warnings`). The thresholds
come from the tiny recipe's runs on the demo and on own data (bench/results/NOTES.md, "Own data on the tiny path").
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger("rlhf")

SFT_MIN_EOS_RATE = 0.8  # share of those answers that end with the stop token
SFT_MIN_GROUND_TRUTH = 0.5  # share that pass data.ground_truth, relative to the data's answers for those prompts
REWARD_MIN_ACCURACY = 0.75
GAMING_DISAGREEMENT = 0.3
GAMING_WINDOW = 4      # updates averaged before the PPO checks speak
GAMING_SCORE_RISE = 0.3   # reward (ppo.reward's score) up by this much ...
GAMING_GT_DROP = 0.1      # ... while the ground-truth rate falls by this much, first window to latest


def sft_warning(metrics: dict) -> str | None:
    """The warning for an SFT run's metrics.json (None: it learned, or nothing was sampled): its held-out answers
    (`rlhf_cli.stages._sampling.answer_check`) rarely end, or rarely pass the checker."""
    eos, gt = metrics.get("answers_eos_rate"), metrics.get("answers_ground_truth_rate")
    floor = SFT_MIN_GROUND_TRUTH * (metrics.get("data_ground_truth_rate") or 0.0)
    if eos is not None and eos < SFT_MIN_EOS_RATE:
        what = f"{eos:.0%} of its sampled answers end (< {SFT_MIN_EOS_RATE:.0%})"
    elif gt is not None and gt < floor:
        what = (f"{gt:.0%} of its sampled answers pass data.ground_truth, under half of the data's own answers "
                f"({metrics['data_ground_truth_rate']:.0%})")
    else:
        return None
    return (f"sft did not learn the answers: {what} after {metrics.get('steps')} steps (eval loss "
            f"{_num(metrics.get('eval_loss_end'))}); PPO would start from a policy that writes noise: train longer "
            "(sft.num_train_epochs=N) or start from a pretrained model (model.name_or_path=Qwen/Qwen3-0.6B)")


def reward_warning(metrics: dict) -> str | None:
    """The warning for a reward run's metrics.json (None: it learned, or there was no eval split)."""
    acc = metrics.get("eval_accuracy")
    if acc is None or math.isnan(acc) or acc >= REWARD_MIN_ACCURACY:
        return None
    return (f"reward model did not learn the preferences: held-out accuracy {acc:.2f} < {REWARD_MIN_ACCURACY}; "
            "PPO would follow a noisy reward: train longer (reward.num_train_epochs=N), give more pairs, or "
            "reward with a function (ppo.reward=[module:function])")


def earlier_stage_warnings(policy_dir, reward_dir) -> list[str]:
    """The SFT and reward warnings for the directories PPO starts from (their metrics.json; none when absent)."""
    out = []
    for d, check in ((policy_dir, sft_warning), (reward_dir, reward_warning)):
        metrics = _read_metrics(d)
        msg = check(metrics) if metrics else None
        if msg:
            out.append(msg)
    return out


def rm_gt_disagreement(rm_scores: list[float], ground_truth: list[float], threshold: float) -> float:
    """Share of responses where the reward model and the checker disagree: the RM score above `threshold` (the
    mean score of the reward stage's training answers, chosen and rejected) while the checker fails it (< 0.5),
    or below it while the checker passes it."""
    pairs = list(zip(rm_scores, ground_truth))
    return sum((r > threshold) != (g >= 0.5) for r, g in pairs) / len(pairs) if pairs else 0.0


class GamingWatch:
    """Fed each update's metrics; returns the one-line warning the first time the reward looks gamed."""

    def __init__(self) -> None:
        self.history: list[dict] = []
        self.warned: set[str] = set()

    def feed(self, update: int, m: dict) -> str | None:
        if "objective/ground_truth_rate" not in m:
            return None
        self.history.append(m)
        if len(self.history) < 2 * GAMING_WINDOW:
            return None
        first, last = self.history[:GAMING_WINDOW], self.history[-GAMING_WINDOW:]
        mean = lambda rows, key: sum(r.get(key, 0.0) for r in rows) / len(rows)
        gt_first, gt_last = mean(first, "objective/ground_truth_rate"), mean(last, "objective/ground_truth_rate")
        rise = mean(last, "objective/scores") - mean(first, "objective/scores")
        disagree = mean(last, "objective/rm_gt_disagreement") if "objective/rm_gt_disagreement" in m else None
        if disagree is not None and disagree > GAMING_DISAGREEMENT and "disagree" not in self.warned:
            self.warned.add("disagree")
            return (f"ppo: the reward is being gamed: at update {update} the reward model and the ground truth "
                    f"disagree on {disagree:.0%} of responses (> {GAMING_DISAGREEMENT:.0%}; ground truth "
                    f"{gt_last:.2f}); check the SFT and reward warnings above, train SFT longer, or raise ppo.kl_coef")
        if rise > GAMING_SCORE_RISE and gt_first - gt_last > GAMING_GT_DROP and "trend" not in self.warned:
            self.warned.add("trend")
            return (f"ppo: the reward is being gamed: by update {update} the score rose {rise:+.2f} while the ground "
                    f"truth fell {gt_first:.2f} -> {gt_last:.2f}; raise ppo.kl_coef or improve the reward model")
        return None


def watch_gaming(trainer) -> None:
    """Chain a `GamingWatch` in front of the trainer's on_update hook (main process): its warning goes to the log."""
    watch, user = GamingWatch(), trainer.hooks.on_update

    def on_update(update: int, m: dict) -> None:
        msg = watch.feed(update, m)
        if msg:
            log.warning(msg)
        user(update, m)

    trainer.hooks.on_update = on_update


def _read_metrics(d) -> dict | None:
    try:
        return json.loads((Path(str(d)) / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None


def _mean(xs) -> float:
    return sum(float(x) for x in xs) / len(xs)


def _num(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "n/a"
