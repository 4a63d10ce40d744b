"""Held-out evaluation, one definition for `rlhf eval` and for `rlhf ppo` while it trains:

    sample_and_score   responses to held-out prompts through PPO's own sampling path (`make_experience`), with
                       each one's reward-model score and KL to the reference (k1 summed over the response)
    summarise          one policy's row: the means, the ground-truth rate, pass@1 / pass@k / mean@k over the
                       samples of each prompt, the truncation rate, the RM / ground-truth disagreement
    pass_at_k          the unbiased pass@k estimator
    Evaluator          what the trainer calls every `ppo.eval_every` updates: the two above as `eval/*` metrics
    keep_best_metric   `ppo.keep_best` read and checked; `write_best` puts the best update's adapter in best/

So the `eval/*` curves of a PPO run and the report of `rlhf eval` measure the same things the same way.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_cli import devices
from rlhf_cli.errors import RlhfError
from rlhf_cli.learned import rm_gt_disagreement
from rlhf_cli.ppo import core
from rlhf_cli.ppo.experience import Sampling, make_experience
from rlhf_cli.ppo.rewards import GroundTruth

# TensorBoard tag -> the key of `summarise`'s row it shows
EVAL_TAGS = {"eval/ground_truth_rate": "ground_truth_rate", "eval/rm_score": "rm_score_mean",
             "eval/kl": "kl_to_ref_mean", "eval/length_mean": "response_length_mean", "eval/eos_rate": "eos_rate",
             "eval/empty_rate": "empty_rate", "eval/truncation_rate": "truncation_rate",
             "eval/rm_gt_disagreement": "rm_gt_disagreement", "eval/pass_at_1": "pass_at_1",
             "eval/pass_at_k": "pass_at_k", "eval/mean_at_k": "mean_at_k"}
GT_TAGS = ("eval/ground_truth_rate", "eval/pass_at_1", "eval/pass_at_k", "eval/mean_at_k")  # need a checker
BEST_FILE = "best.json"  # in best/: the update kept, its metric and value


@torch.no_grad()
def sample_and_score(policy, ref, rm, tok, prompts: list[str], s: Sampling, device, seed: int, autocast,
                     progress=None) -> dict:
    """Responses of `policy` to `prompts` through PPO's own sampling path, with their RM score (None without a
    reward model) and KL to `ref` (None: the policy with its adapter disabled)."""
    torch.manual_seed(seed)
    out = {"texts": [], "rm_score": [], "kl": [], "length": [], "eos": [], "empty": []}
    for i in range(0, len(prompts), s.forward_batch_size):
        with autocast():
            exp = make_experience(prompts[i: i + s.forward_batch_size], tok, policy, s, ref_model=ref,
                                  reward_model=rm, device=device)
        out["texts"] += exp.texts
        out["rm_score"] += exp.rm_scores.tolist() if exp.rm_scores is not None else [None] * len(exp.texts)
        out["kl"] += core.masked_sum(exp.logprobs - exp.ref_logprobs, exp.response_mask, dim=-1).tolist()
        out["length"] += exp.response_mask.sum(-1).tolist()
        out["eos"] += exp.has_stop.tolist()
        out["empty"] += exp.empty.tolist()
        if progress is not None:
            progress.update(len(exp.texts))
    return out


def mean(xs) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples of which c pass: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"), computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which
    never forms a binomial coefficient (no overflow for large n)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every choice of k samples holds a passing one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def per_prompt(values: list, k: int) -> list[list]:
    """The per-response `values` grouped by prompt: each prompt's k samples are consecutive."""
    if k < 1 or len(values) % k:
        raise ValueError(f"{len(values)} responses are not a whole number of groups of {k} samples per prompt")
    return [values[i: i + k] for i in range(0, len(values), k)]


def verifiable(ground_truth: list[float], k: int) -> dict:
    """pass@1 and pass@k (a sample passes at a checker value >= 0.5) and mean@k (the mean checker value, partial
    credit kept), each averaged over prompts; `ground_truth` holds k consecutive samples per prompt."""
    groups = per_prompt([float(x) for x in ground_truth], k)
    passed = [sum(x >= 0.5 for x in g) for g in groups]
    return {"pass_at_1": mean([pass_at_k(k, c, 1) for c in passed]),
            "pass_at_k": mean([pass_at_k(k, c, k) for c in passed]),
            "mean_at_k": mean([mean(g) for g in groups])}


def summarise(s: dict, samples_per_prompt: int = 1, rm_line: float | None = None) -> dict:
    """One policy's row. The truncation rate: the share of responses cut at the response cap (no stop token).
    With ground truth (`s["ground_truth"]`, values in [0, 1]; a response passes at ≥ 0.5): its mean, pass@1,
    pass@k and mean@k over the `samples_per_prompt` consecutive responses of each prompt, the RM score on passing
    and failing responses, and how often the RM and the checker disagree (`rm_gt_disagreement`, as PPO logs it:
    an RM score above `rm_line`, the reward stage's mean score, where the checker fails, or below it where the
    checker passes; without `rm_line` the responses' own mean score)."""
    scored = all(r is not None for r in s["rm_score"])
    row = {"rm_score_mean": mean(s["rm_score"]) if scored else None, "kl_to_ref_mean": mean(s["kl"]),
           "response_length_mean": mean(s["length"]), "eos_rate": mean([float(x) for x in s["eos"]]),
           "truncation_rate": mean([float(not x) for x in s["eos"]]),
           "empty_rate": mean([float(x) for x in s["empty"]]), "ground_truth_rate": None}
    if s.get("ground_truth") is not None:
        row["ground_truth_rate"] = mean([float(x) for x in s["ground_truth"]])
        row.update(verifiable(s["ground_truth"], samples_per_prompt))
        if not scored:
            return row
        ok = [x >= 0.5 for x in s["ground_truth"]]
        bad = [r for r, g in zip(s["rm_score"], ok) if not g]
        good = [r for r, g in zip(s["rm_score"], ok) if g]
        # reward hacking: responses the checker rejects but the RM scores like the ones it accepts
        row["rm_score_mean_on_gt_fail"] = mean(bad) if bad else None
        row["rm_score_mean_on_gt_pass"] = mean(good) if good else None
        line = rm_line if rm_line is not None else mean(s["rm_score"])
        row["rm_gt_disagreement"] = rm_gt_disagreement(s["rm_score"], [float(x) for x in s["ground_truth"]], line)
    return row


def metric_names(reward_model: bool, ground_truth: bool) -> tuple[str, ...]:
    """The `eval/*` metrics an evaluation gives: the RM score with a reward model, the ground-truth rate with a
    checker, their disagreement with both."""
    skip = set() if reward_model else {"eval/rm_score", "eval/rm_gt_disagreement"}
    if not ground_truth:
        skip |= {*GT_TAGS, "eval/rm_gt_disagreement"}
    return tuple(t for t in EVAL_TAGS if t not in skip)


def keep_best_metric(spec: str | None, eval_every: int, names=None) -> tuple[str, float] | None:
    """`ppo.keep_best` as (metric, sign): higher is better, a leading minus makes lower better (`-eval/kl`); None
    when off. `names`: the metrics the run's evaluation gives (None: not checked here)."""
    if spec is None:
        return None
    name, sign = (spec[1:], -1.0) if spec.startswith("-") else (spec, 1.0)
    if not eval_every:
        raise RlhfError(f"ppo.keep_best={spec} keeps the adapter of the best evaluation, but ppo.eval_every=0 "
                        "never evaluates; set ppo.eval_every=N (updates between evaluations)")
    if names is not None and name not in names:
        raise RlhfError(f"ppo.keep_best={spec}: this run's evaluation has no {name}; use one of "
                        f"{', '.join(names)} (a leading - keeps the lowest, e.g. -eval/kl)")
    return name, sign


@dataclass
class Evaluator:
    """The trainer's held-out evaluation (`PPOTrainer(evaluator=...)`): the current policy samples `prompts`
    with `sampling` (the eval settings) and is measured as `rlhf eval` measures it, against the trainer's
    reference and reward model. Each evaluation draws from `seed`, so updates are compared on the same random
    stream, and leaves the training's random stream where it was."""

    prompts: list[str]
    sampling: Sampling
    seed: int
    rows: list[dict] | None = None  # each prompt's data row fields (for the checker)
    ground_truth: GroundTruth | None = None  # the data's checker (data.ground_truth)
    samples_per_prompt: int = 1  # responses per prompt (eval.samples_per_prompt): pass@k's k

    def __call__(self, trainer) -> dict[str, float]:
        # Every process samples its shard of the prompts and the per-response values are gathered: the means are
        # exact whatever the shard sizes, every process gets the same numbers (so all agree on which update is
        # best without a broadcast), and the evaluation takes 1/N of the time instead of idling N-1 processes.
        rank, world, device = trainer.rank, trainer.world, trainer.device
        k = self.samples_per_prompt
        prompts = [p for p in self.prompts[rank::world] for _ in range(k)]  # whole groups on every process
        rows = [r for r in self.rows[rank::world] for _ in range(k)] if self.rows else None
        gpu = devices.rng_index(device)
        with torch.random.fork_rng(devices=[gpu] if gpu is not None else []):
            s = sample_and_score(trainer.unwrapped, trainer.ref, trainer.reward, trainer.tok, prompts, self.sampling,
                                 device, self.seed, trainer.autocast)
        if self.ground_truth is not None:
            s["ground_truth"] = self.ground_truth(s["texts"], prompts, rows)
        if world > 1:
            import torch.distributed as dist

            parts = [None] * world
            dist.all_gather_object(parts, s)
            s = {k: [x for p in parts for x in p[k]] for k in s}
        stats = getattr(trainer, "score_stats", None)
        row = summarise(s, k, stats["mean"] if stats else None)
        return {tag: float(row[key]) for tag, key in EVAL_TAGS.items() if row.get(key) is not None}


def is_better(value: float, best: dict | None, sign: float) -> bool:
    """`value` beats the best so far (`best["value"]`, or none yet); ties keep the earlier update."""
    if not math.isfinite(value):
        return False
    return best is None or sign * value > sign * float(best["value"])


def read_best(path: Path) -> dict | None:
    """best.json of `path` (best/), or None when there is none."""
    from rlhf_cli.io import read_json

    file = Path(path) / BEST_FILE
    if not file.is_file():
        return None
    try:
        best = read_json(file)
    except (OSError, ValueError) as e:
        raise RlhfError(f"{file} is unreadable ({type(e).__name__}); delete {Path(path)} (the best update so far is "
                        "then chosen again from here on), or start over with ppo.fresh=true") from e
    if not isinstance(best, dict):
        raise RlhfError(f"{file} is not a JSON object; delete {Path(path)} (the best update so far is then chosen "
                        "again from here on), or start over with ppo.fresh=true")
    return best


def write_best(path: Path, policy, value_model, tok, record: dict, root: Path) -> None:
    """Replace `path` (`<run>/best/`) atomically by the policy's adapter (or full weights), the tokenizer, the
    value model (value/, when there is one) and `record` as best.json. Marked as a PPO output, so `rlhf export
    ppo.output_dir=<it>` writes its merged/ inside it; adapters record their base relative to `root` (the run
    directory), so that it loads where the run is moved to. The main process alone calls this."""
    from rlhf_cli.io import publish, write_json
    from rlhf_cli.ppo.checkpoint import save_model

    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"  # a killed run's is removed by the next publish
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_model(policy, tmp, root)
        tok.save_pretrained(str(tmp))
        if value_model is not None:
            save_model(value_model, tmp / "value", root)
        write_json(tmp / BEST_FILE, record)
        publish(tmp, path, "ppo")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
