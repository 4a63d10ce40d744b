"""`rlhf eval`: compare policies (by default the run's SFT and PPO) on held-out prompts.

For each policy: mean reward-model score (none with `eval.reward_dir=null`), mean KL to the reference (the
SFT policy: k1 summed over the response, on the policy's own samples), response length, EOS and empty rates,
the truncation rate (responses cut at the cap `eval.response_length`, no stop token) and the ground-truth rate
where the data defines a checker (`data.ground_truth`: `demo_polite`, or any `module:function` returning a bool
or a number in [0, 1]); with a checker also pass@1, pass@k and mean@k over `eval.samples_per_prompt` (k)
responses per prompt (verifiable tasks: compare them at the same cap). Across policies: the RM win rate of PPO
over SFT on the same prompts, and where the RM and the ground truth disagree (reward hacking shows up there
first). Without a reward model (a run rewarded by functions alone) the report has everything else.

Writes `eval.output_dir`: report.json, report.md, responses.jsonl (every response with its RM score, KL and
ground-truth verdict), training_curves.png (from the PPO TensorBoard events) and, for each policy that is a DPO
output, <name>_training_curves.png (from its own events: loss, implicit-reward accuracy and margin, log-probs).
What one policy is measured
by is `rlhf_cli.ppo.evaluation`, which `rlhf ppo` runs every `ppo.eval_every` updates too (its `eval/*` curves).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rlhf_cli import accel, devices, settings
from rlhf_cli.config import require_dir
from rlhf_cli.hardware import resolve_precision, setup_torch
from rlhf_cli.io import atomic_dir, check_output_dir, output_kind, read_json, write_json
from rlhf_cli.models import check_vocab, load_policy, load_tokenizer, quantization_config
from rlhf_cli.ppo.evaluation import mean, sample_and_score, summarise
from rlhf_cli.ppo.reward_model import know_prompts, load_reward_model, own_tokenizer
from rlhf_cli.stage_table import POLICIES
from rlhf_cli.stages import _sampling
from rlhf_cli.stages._console import progress_bar

log = logging.getLogger("rlhf")

CURVES = [("objective/scores", "score (ppo.reward)"), ("objective/ground_truth_rate", "ground-truth rate"),
          ("objective/kl", "KL to reference (nats/seq)"), ("objective/entropy", "entropy (nats/seq)"),
          ("response/length_mean", "response length (tokens)"), ("loss/value_avg", "value loss")]
# trl's DPOTrainer logs through transformers' TensorBoard callback: train/* every logging step, eval/* per eval
DPO_CURVES = [("train/loss", "loss"), ("train/rewards/accuracies", "preference accuracy (implicit reward)"),
              ("train/rewards/margins", "reward margin β·log π/π_ref"), ("eval/rewards/accuracies",
              "held-out preference accuracy"), ("train/logps/chosen", "log π(chosen)"),
              ("train/logps/rejected", "log π(rejected)")]


def win_rate(a: list[float], b: list[float]) -> float:
    """P(score_a > score_b) on the same prompts, ties counted half."""
    return mean([1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(a, b)])


def plot_curves(tb_dir: Path, png: Path, title: str = "PPO training", curves=CURVES, xlabel: str = "episodes") -> bool:
    """Training curves (PPO's against episodes, by default) from TensorBoard scalars: a panel per tag of `curves`
    that the events hold; False (nothing written) when they hold none."""
    if not tb_dir.is_dir():
        return False
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its event-file notes are not the user's business
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags().get("scalars", []))
    panels = [(t, label) for t, label in curves if t in tags]
    if not panels:
        return False
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (tag, label) in zip(axes.flat, panels):
        ev = acc.Scalars(tag)
        ax.plot([x.step for x in ev], [x.value for x in ev], lw=1.6)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def markdown(report: dict) -> str:
    pols = report["policies"]
    n = report.get("samples_per_prompt", 1)
    label = {"pass_at_1": "pass@1", "pass_at_k": f"pass@{n}", "mean_at_k": f"mean@{n}"}
    keys = ["rm_score_mean", "ground_truth_rate", "pass_at_1", "pass_at_k", "mean_at_k", "kl_to_ref_mean",
            "response_length_mean", "eos_rate", "truncation_rate", "empty_rate", "rm_score_mean_on_gt_fail",
            "rm_gt_disagreement"]
    keys = [k for k in keys if any(pols[p].get(k) is not None for p in pols)
            and not (n == 1 and k in ("pass_at_k", "mean_at_k"))]  # one response per prompt: they are pass@1
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"# rlhf eval: {report['num_prompts']} held-out prompts", "",
             (f"{n} response(s) per prompt, at most {report.get('response_cap')} tokens each (the response cap; "
              "truncation_rate: the share cut there without a stop token)"), "",
             "| metric | " + " | ".join(pols) + " |", "|---|" + "---|" * len(pols)]
    lines += [f"| {label.get(k, k)} | " + " | ".join(fmt(pols[p].get(k)) for p in pols) + " |" for k in keys]
    lines += [""] + [f"- win rate {k.replace('_vs_', ' over ')} (reward model): **{v:.3f}**"
                     for k, v in report["win_rate"].items()]
    if report.get("ground_truth"):
        lines += ["", f"ground truth: `{report['ground_truth']}` (data.ground_truth)" + (
            "; rm_gt_disagreement: share of responses where the reward model (a score above the mean score of the "
            "reward stage's training answers) and the checker disagree, as `rlhf ppo` logs it."
            if report.get("reward_dir") else ".")]
    lines += [""]
    if report.get("plot"):
        lines += [f"![training curves]({report['plot']})", ""]
    for name, png in report.get("dpo_plots", {}).items():
        lines += [f"![{name} training curves]({png})", ""]
    lines += ["## Samples", ""]
    for name, samples in report["samples"].items():
        lines += [f"### {name}", ""] + [f"- `{s['prompt']}` → {s['response']!r}"
                                        + (f" (RM {s['rm_score']:+.2f})" if s["rm_score"] is not None else "")
                                        for s in samples] + [""]
    return "\n".join(lines)


def run(cfg) -> None:
    typed = settings.of(cfg)  # what the stage reads
    setup_torch(typed)
    e = typed.eval
    policies = {name: path for name, path in e.policies.items() if path is not None}  # NAME=null: left out
    inputs = [typed.ppo.policy_dir, e.reward_dir, typed.ppo.output_dir, *policies.values()]  # never replaced
    check_output_dir(e.output_dir, "eval", inputs)  # before the sampling, not after it (atomic_dir checks again)
    device = devices.of_accelerator(typed.device.accelerator)
    paths = accel.configure(typed, device.type)
    storage, compute = resolve_precision(typed)
    ref_dir = require_dir(typed.ppo.policy_dir, "SFT policy (the reference, ppo.policy_dir)", "rlhf sft")
    reward_dir = None if e.reward_dir is None else \
        require_dir(e.reward_dir, "reward model (eval.reward_dir)", "rlhf reward", marker="config.json",
                    or_else="set eval.reward_dir=null to evaluate without one")
    made_by = {name: f"rlhf {name}" for name in POLICIES}
    policy_dirs = {name: require_dir(path, f"policy '{name}' (eval.policies.{name})", made_by.get(name, "rlhf ppo"))
                   for name, path in policies.items()}
    tok = load_tokenizer(ref_dir, typed.model)
    rm_tok = own_tokenizer(reward_dir, tok, typed) if reward_dir is not None else None
    prompts, evals = _sampling.prompts(typed, tok, "eval", limit=int(e.num_prompts))
    gt = _sampling.ground_truth(typed.data, evals)
    k = int(e.samples_per_prompt)  # each prompt's k samples are consecutive (evaluation.per_prompt)
    prompts, evals = [p for p in prompts for _ in range(k)], [x for x in evals for _ in range(k)]
    rows = _sampling.rows(evals)

    quant = quantization_config(typed)  # the frozen weights as PPO held them: its policy was trained on them
    rm = load_reward_model(reward_dir, tok, storage, typed, device, rm_tok, quant) if reward_dir is not None else None
    know_prompts(rm, (prompts, evals))
    ref = load_policy(ref_dir, storage, typed.model, merge=True, quant=quant).to(device).eval()
    s = _sampling.sampling(typed, tok, check_vocab(tok, ref, ref_dir),
                           recompute=_sampling.recompute_logprobs(typed.ppo.recompute_logprobs, compute), evaluation=True,
                           engine=paths.sampler)
    autocast = lambda: devices.autocast(device, compute)  # noqa: E731
    results = {}
    with progress_bar(total=len(prompts) * len(policy_dirs), unit="resp", desc="eval", dynamic_ncols=True) as bar:
        for name, path in policy_dirs.items():
            policy = load_policy(path, storage, typed.model, base_dir=ref_dir, quant=quant).to(device).eval()
            results[name] = sample_and_score(policy, ref, rm, tok, prompts, s, device, int(typed.seed), autocast, bar)
            if gt is not None:
                results[name]["ground_truth"] = gt(results[name]["texts"], prompts, rows)
            del policy
            log.info("eval: %s done", name)

    stats = reward_dir / "score_stats.json" if reward_dir is not None else None
    rm_line = read_json(stats).get("mean") if stats is not None and stats.is_file() else None  # as PPO's
    report = {"num_prompts": len(prompts) // k, "samples_per_prompt": k, "response_cap": int(e.response_length),
              "reward_dir": str(reward_dir) if reward_dir else None, "reference": str(ref_dir),
              "policies": {n: summarise(s, k, rm_line) for n, s in results.items()}, "win_rate": {}, "samples": {}}
    if gt is not None:
        report["ground_truth"] = gt.spec
    names = list(results) if rm is not None else []  # win rates compare reward-model scores
    for a in names:
        for b in names:
            if a != b and not (a == "sft" and b in ("ppo", "dpo")):  # each trained policy over SFT, not back
                report["win_rate"][f"{a}_vs_{b}"] = win_rate(results[a]["rm_score"], results[b]["rm_score"])
    for n, s in results.items():
        report["samples"][n] = [{"prompt": evals[i].prompt[-1]["content"], "response": s["texts"][i],
                                 "rm_score": s["rm_score"][i]} for i in range(0, min(6 * k, len(prompts)), k)]
    ppo_dir = Path(typed.ppo.output_dir)
    with atomic_dir(e.output_dir, "eval", inputs) as out:
        write_report(out, report, results, evals, gt, ppo_dir, str(typed.ppo.advantage), policy_dirs)
    print_summary(report, bool(e.greedy), e.output_dir)


def write_report(out: Path, report: dict, results: dict, evals, gt, ppo_dir: Path, advantage: str,
                 policy_dirs: dict[str, Path] | None = None) -> None:
    """report.json, report.md, responses.jsonl and the training curves into the eval directory `out`: PPO's, and
    those of each policy in `policy_dirs` that is a DPO output."""
    if (ppo_dir / "metrics.json").exists():
        report["ppo_train"] = read_json(ppo_dir / "metrics.json")
    estimator = report.get("ppo_train", {}).get("advantage", advantage)
    if plot_curves(ppo_dir / "tensorboard", out / "training_curves.png", f"PPO training ({estimator})"):
        report["plot"] = "training_curves.png"
    for name, path in (policy_dirs or {}).items():
        if output_kind(path) == "dpo" and plot_curves(path / "tensorboard", out / f"{name}_training_curves.png",
                                                      f"DPO training ({name})", DPO_CURVES, "optimizer steps"):
            report.setdefault("dpo_plots", {})[name] = f"{name}_training_curves.png"
    write_json(out / "report.json", report)
    with open(out / "responses.jsonl", "w", encoding="utf-8") as f:  # every response, for a closer look
        for n, s in results.items():
            for i, ex in enumerate(evals):
                row = {"policy": n, "prompt": ex.prompt[-1]["content"], "response": s["texts"][i],
                       "rm_score": s["rm_score"][i], "kl": s["kl"][i]}
                if gt is not None:
                    row["ground_truth"] = s["ground_truth"][i]
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(markdown(report), encoding="utf-8")


def print_summary(report: dict, greedy: bool, out_dir) -> None:
    """One line per policy, the win rates, and where the report is."""
    k = report["samples_per_prompt"]
    for n, row in report["policies"].items():
        gt_s = f", ground truth {row['ground_truth_rate']:.3f}" if row["ground_truth_rate"] is not None else ""
        if row.get("pass_at_1") is not None:
            gt_s += f", pass@1 {row['pass_at_1']:.3f}" + (f", pass@{k} {row['pass_at_k']:.3f}" if k > 1 else "")
        rm_s = f"RM {row['rm_score_mean']:+.3f}" if row["rm_score_mean"] is not None else "no RM"
        print(f"{n:>6}: {rm_s}{gt_s}, KL {row['kl_to_ref_mean']:.2f}, "
              f"length {row['response_length_mean']:.1f}, EOS {row['eos_rate']:.2f}, empty {row['empty_rate']:.2f}, "
              f"truncated {row['truncation_rate']:.2f} (cap {report['response_cap']})")
    for k, v in report["win_rate"].items():
        print(f"win rate {k}: {v:.3f}")
    if greedy:
        print("KL with eval.greedy=true: the log-ratio of the greedy tokens (temperature 1), a measure of how far "
              "the policies' choices moved, not the KL of a sampling distribution")
    print(f"report: {Path(out_dir) / 'report.md'}")
