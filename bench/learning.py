"""Learning comparison on the demo task: does rlhf's PPO learn at least as much per episode as TRL 1.12's?

Run with the project's environment (bench/run.py calls it):

    .venv/bin/python bench/learning.py --seeds 0 1 --out bench/results/learning.json

1. In bench/work/demo/, `rlhf sft` and `rlhf reward` (tiny recipe) give the SFT policy and the reward model
   (skipped when runs/tiny/{sft,reward} already exist).
2. The demo train questions are rendered with the SFT tokenizer's chat template, exactly as the rlhf stage
   renders them, and written for the TRL side.
3. Per seed, both sides train with the tiny recipe's PPO settings, read from rlhf's composed config and given
   to both (lr and schedule, kl_coef, epochs, episodes, batch sizes, GAE and clipping constants,
   response length, temperature, LoRA rank/alpha on all linear layers; value model from the RM, responses cut
   at EOS), on the same objective: raw RM scores (ppo.normalize_scores=false), no empty-response or
   missing-EOS penalty. One mini-batch per epoch on both sides: TRL's num_mini_batches does not change when it
   steps (see render_prompts), so only that value means the same work on both.
4. Per update each side records the mean raw RM score and the rule-checked polite rate of its own training
   samples (rlhf_cli.demo.is_polite). Then `rlhf eval` scores the SFT policy and both PPO policies on the same
   held-out prompts with the same sampling seed.

Two kinds of gain are reported. Held-out gains (these decide the target): final policy minus the shared SFT
start, on the same held-out prompts and sampling seed. Training gains: last minus first, each the mean over a
window of updates (--window, default 4 updates = 128 episodes) of the side's own training samples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = REPO / ".venv" / "bin" / "python"
RLHF = REPO / ".venv" / "bin" / "rlhf"
TRL_PY = HERE / ".venv-trl112" / "bin" / "python"


def sh(cmd: list[str], cwd: Path, log: Path, threads: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONUNBUFFERED="1")
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        r = subprocess.run([str(c) for c in cmd], cwd=str(cwd), env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(map(str, cmd))}; see {log}")


def scalars(tb_dir: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.step)]


def window_gain(xs: list[float], w: int) -> dict:
    if not xs:
        return {"first": None, "last": None, "gain": None}
    w = max(1, min(w, len(xs) // 2 or 1))
    first, last = sum(xs[:w]) / w, sum(xs[-w:]) / w
    return {"first": round(first, 4), "last": round(last, 4), "gain": round(last - first, 4)}


def inputs_digest() -> dict:
    """What the SFT policy and reward model depend on: a change retrains them."""
    import hashlib

    files = [REPO / "rlhf_cli" / "demo" / "data" / "polite_train.jsonl", REPO / "rlhf_cli" / "demo" / "data" /
             "polite_test.jsonl", REPO / "recipes" / "tiny.yaml", REPO / "conf" / "stage" / "sft.yaml",
             REPO / "conf" / "stage" / "reward.yaml", REPO / "conf" / "model" / "tiny.yaml",
             REPO / "rlhf_cli" / "tiny.py"]
    return {str(f.relative_to(REPO)): hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in files if f.exists()}


# PPO settings both sides take from the tiny recipe (rlhf's own config): the comparison is at equal settings
SHARED = ("learning_rate", "kl_coef", "num_ppo_epochs", "total_episodes", "response_length", "temperature",
          "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
          "rollout_forward_batch_size", "warmup_ratio", "lr_scheduler_type", "weight_decay", "max_grad_norm", "gamma",
          "lam", "cliprange", "cliprange_value", "vf_coef", "kl_estimator", "whiten_rewards")


def render_prompts(work: Path, out: Path) -> dict:
    """The stage's own rendering of the training prompts (chat template, length filter)."""
    from omegaconf import OmegaConf

    from rlhf_cli import data as D
    from rlhf_cli.config import compose
    from rlhf_cli.models import load_tokenizer

    cfg = compose("ppo", ["recipe=tiny", f"run_dir={work / 'runs' / 'tiny'}"])
    tok = load_tokenizer(cfg.ppo.policy_dir, cfg.model)
    train, _ = D.load_examples(cfg.data, need_rejected=False)
    thinking, templ = bool(cfg.model.enable_thinking), bool(cfg.data.chat_template)
    train = D.filter_long_prompts(train, tok, int(cfg.data.max_prompt_length), str(cfg.data.train_path), thinking,
                                  templ)
    with open(out, "w", encoding="utf-8") as f:
        for ex in train:
            f.write(json.dumps({"prompt": D.prompt_text(tok, ex.prompt, thinking, templ)}, ensure_ascii=False) + "\n")
    p = cfg.ppo
    settings = {k: (OmegaConf.to_container(p[k]) if OmegaConf.is_config(p[k]) else p[k]) for k in SHARED}
    settings["lora"] = {k: (OmegaConf.to_container(p.lora[k]) if OmegaConf.is_config(p.lora[k]) else p.lora[k])
                        for k in ("r", "alpha", "target_modules")}
    # TRL 1.12 takes one optimizer step per `gradient_accumulation_steps` micro-batches whatever its
    # num_mini_batches (accelerate's accumulation spans its mini-batches), and its rollout batch is
    # per-device × accumulation; rlhf takes one step per mini-batch over a rollout of per-device × accumulation ×
    # mini-batches. The two mean the same only with one mini-batch, so both sides run with one.
    settings["recipe_num_mini_batches"] = settings["num_mini_batches"]
    settings["num_mini_batches"] = 1
    settings["n_prompts"] = len(train)
    return settings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", default=str(HERE / "work" / "demo"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--episodes", type=int, default=None, help="default: the tiny recipe's ppo.total_episodes")
    ap.add_argument("--window", type=int, default=4, help="updates averaged at each end for the gains")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(HERE / "results" / "learning.json"))
    a = ap.parse_args(argv)

    work = Path(a.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = work / "learning.log"
    runs = work / "runs" / "tiny"
    t_start = time.perf_counter()
    marker = runs / "bench_inputs.json"
    inputs = inputs_digest()
    fresh = marker.exists() and json.loads(marker.read_text()) == inputs
    if not (fresh and (runs / "sft" / "config.json").exists() and (runs / "reward" / "config.json").exists()):
        print("learning: rlhf sft + rlhf reward (tiny recipe)", flush=True)
        import shutil

        shutil.rmtree(runs, ignore_errors=True)  # base, SFT, RM and PPO runs of older inputs
        runs.mkdir(parents=True)
        sh([RLHF, "sft", f"device.threads={a.threads}"], work, log, a.threads)
        sh([RLHF, "reward", f"device.threads={a.threads}"], work, log, a.threads)
        marker.write_text(json.dumps(inputs, indent=1) + "\n")
    prompts_file = work / "trl_prompts.jsonl"
    settings = render_prompts(work, prompts_file)
    episodes = int(a.episodes or settings["total_episodes"])
    settings["total_episodes"] = episodes
    if settings["whiten_rewards"] or settings["kl_estimator"] not in ("k1", "k3"):
        raise SystemExit("the comparison needs ppo.whiten_rewards=false and a k1/k3 KL estimator (TRL's)")
    settings_file = work / "ppo_settings.json"
    settings_file.write_text(json.dumps(settings, indent=1) + "\n")
    def ov(v):
        if isinstance(v, list):
            return "[" + ",".join(map(str, v)) + "]"
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    pinned = [f"ppo.{k}={ov(settings[k])}" for k in SHARED]
    pinned += [f"ppo.lora.{k}={ov(v)}" for k, v in settings["lora"].items()]

    per_seed = []
    for seed in a.seeds:
        ours_dir, trl_dir = runs / f"ppo_rlhf_s{seed}", runs / f"ppo_trl_s{seed}"
        print(f"learning: seed {seed}: rlhf ppo", flush=True)
        t0 = time.perf_counter()
        sh([RLHF, "ppo", f"seed={seed}", f"ppo.output_dir={ours_dir}", *pinned, "ppo.value_init=reward",
            "ppo.stop_token=eos", "ppo.normalize_scores=false", "ppo.empty_response_penalty=null",
            "ppo.missing_eos_penalty=null", "ppo.sample_every=0", f"device.threads={a.threads}"], work, log, a.threads)
        ours_s = time.perf_counter() - t0
        print(f"learning: seed {seed}: TRL 1.12 PPOTrainer", flush=True)
        trl_json = work / f"trl_demo_s{seed}.json"
        sh([TRL_PY, HERE / "trl_demo.py", "--policy-dir", runs / "sft", "--reward-dir", runs / "reward",
            "--prompts", prompts_file, "--settings", settings_file, "--seed", seed, "--threads", a.threads,
            "--save-dir", trl_dir, "--out", trl_json], work, log, a.threads)
        trl = json.loads(trl_json.read_text())
        print(f"learning: seed {seed}: rlhf eval (sft, rlhf, trl on held-out prompts)", flush=True)
        eval_dir = runs / f"eval_s{seed}"
        sh([RLHF, "eval", "seed=0", f"ppo.output_dir={ours_dir}", f"eval.output_dir={eval_dir}",
            f"+eval.policies.trl={trl_dir}", f"device.threads={a.threads}"], work, log, a.threads)
        report = json.loads((eval_dir / "report.json").read_text())
        pol = report["policies"]
        tb = ours_dir / "tensorboard"
        ours_rm, ours_gt = scalars(tb, "objective/rm_scores"), scalars(tb, "objective/ground_truth_rate")
        keep = ("rm_score_mean", "ground_truth_rate", "kl_to_ref_mean", "response_length_mean", "eos_rate")
        per_seed.append({
            "seed": seed,
            "rlhf": {"train_s": round(ours_s, 1), "updates": len(ours_rm),
                     "rm_score": window_gain(ours_rm, a.window), "polite_rate": window_gain(ours_gt, a.window),
                     "kl_last": (scalars(tb, "objective/kl") or [None])[-1]},
            "trl": {"train_s": trl["train_s"], "updates": len(trl["rm_scores"]),
                    "rm_score": window_gain(trl["rm_scores"], a.window),
                    "polite_rate": window_gain(trl["polite_rate"], a.window), "kl_last": (trl["kl"] or [None])[-1]},
            "heldout": {"num_prompts": report["num_prompts"],
                        **{name: {k: pol[src].get(k) for k in keep}
                           for name, src in (("sft", "sft"), ("rlhf", "ppo"), ("trl", "trl"))}},
        })
        s = per_seed[-1]
        print(f"learning: seed {seed}: RM gain rlhf {s['rlhf']['rm_score']['gain']:+.3f} trl "
              f"{s['trl']['rm_score']['gain']:+.3f}; held-out polite sft "
              f"{s['heldout']['sft']['ground_truth_rate']:.3f} rlhf {s['heldout']['rlhf']['ground_truth_rate']:.3f} "
              f"trl {s['heldout']['trl']['ground_truth_rate']:.3f}",
              flush=True)

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return round(sum(xs) / len(xs), 4) if xs else None

    summary = {}
    for side in ("rlhf", "trl"):
        summary[side] = {
            "train_rm_gain_mean": mean([s[side]["rm_score"]["gain"] for s in per_seed]),
            "train_polite_gain_mean": mean([s[side]["polite_rate"]["gain"] for s in per_seed]),
            "heldout_rm_gain_mean": mean([s["heldout"][side]["rm_score_mean"] - s["heldout"]["sft"]["rm_score_mean"]
                                          for s in per_seed]),
            "heldout_polite_gain_mean": mean([s["heldout"][side]["ground_truth_rate"]
                                              - s["heldout"]["sft"]["ground_truth_rate"] for s in per_seed]),
            "heldout_polite_mean": mean([s["heldout"][side]["ground_truth_rate"] for s in per_seed]),
            "heldout_rm_mean": mean([s["heldout"][side]["rm_score_mean"] for s in per_seed]),
            "heldout_kl_mean": mean([s["heldout"][side]["kl_to_ref_mean"] for s in per_seed]),
        }
    summary["sft"] = {"heldout_polite_mean": mean([s["heldout"]["sft"]["ground_truth_rate"] for s in per_seed]),
                      "heldout_rm_mean": mean([s["heldout"]["sft"]["rm_score_mean"] for s in per_seed])}
    r, t = summary["rlhf"], summary["trl"]
    # The gains that decide: from the shared SFT start to each final policy, on the same held-out prompts and
    # sampling seed (the first training batches of the two sides differ only by sampling noise).
    summary["target_rm_gain_met"] = r["heldout_rm_gain_mean"] >= t["heldout_rm_gain_mean"]
    summary["target_polite_gain_met"] = r["heldout_polite_gain_mean"] >= t["heldout_polite_gain_mean"]
    result = {"task": "demo (polite answers), tiny recipe", "settings": {**settings, "window_updates": a.window,
              "seeds": a.seeds, "normalize_scores": False, "stop": "eos"},
              "per_seed": per_seed, "summary": summary, "wall_s": round(time.perf_counter() - t_start, 1)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
