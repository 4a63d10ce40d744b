"""rlhf side of the PPO speed benchmark: our PPO stage (`rlhf_cli.stages.ppo.run`) on a bench workload.

Run with the project's environment:

    .venv/bin/python bench/rlhf_side.py --workload-dir bench/work/tiny \
        --variant lora --updates 8 --response-length 32 --threads 1 --out result.json

The settings are those of bench/trl_side.py (the comparison contract): 32 episodes per update (micro-batch 8 x
gradient accumulation 4), one rollout forward batch of 32, 2 PPO epochs, 1 mini-batch, lr 5e-6, temperature 0.7,
no stop token (every response is exactly --response-length tokens), no EOS or empty-response penalty, raw
reward-model scores, value model initialised from the reward model, CPU, no sample tables.
--episodes-per-update E --micro-batch M change the batch to E episodes per update (micro-batch M x accumulation
E/M, rollout forward batch E; the real workload uses 8 = 2 x 4).

--precision fp32 (default): model.dtype=float32 device.mixed_precision=no, everything in fp32.
--precision bf16: model.dtype=bfloat16 device.mixed_precision=bf16: frozen weights (the LoRA policy's base, which
is also the reference, and the reward model) stored in bf16; trainable weights (LoRA adapters, the value model)
fp32 master weights; every forward under bf16 autocast; old log-probs recomputed with the training forward
(ppo.recompute_logprobs=auto).

variant lora: LoRA r 8 / alpha 16 on all linear layers; the reference is the policy with its adapter disabled.
variant full: full fine-tuning (ppo.lora.enabled=false); the reference is a frozen copy of the policy.

The stage wants a policy directory and a reward directory that hold their tokenizer, and chat-style prompt rows.
The first run prepares them inside the workload directory (rlhf_policy/, rlhf_reward/, rlhf_prompts.jsonl); the
prompts are used as plain text (data.chat_template=false), and the run checks that every prompt tokenizes to
exactly the ids the TRL side feeds its trainer.

Timing: the stage runs in this process and is observed through the trainer's hooks (`rlhf_cli.ppo.trainer.Hooks`).
Per-update times go from the start of an update (before it asks for its prompts, like TRL's batch request) to the
next such moment; the last update ends when its metrics are logged, before the stage writes its final checkpoint
(TRL's side saves nothing). train_s is their sum; eps = episodes /
train_s. The stage's own `train_seconds` (which also counts the set-up before the first update and the writing
of the outputs) is kept as stage_train_s. The split of each update comes from the trainer's own metrics:
time/generate_s (sampling), time/score_s (old / reference log-probs, values, reward-model scores),
time/train_s (the PPO epochs); the rest of an update (advantages, metrics, logging) is other_s.

Peak RSS is the process's VmHWM; the result also keeps RssAnon / RssFile at the end of the run (anonymous memory
and mapped files), because the file part depends on how the library files sit in the page cache (see
bench/run.py: the benchmark runs this side from a private copy of the project's environment for that reason).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

EPISODES_PER_UPDATE = 32
PER_DEVICE_BATCH = 8
PREP_VERSION = 1
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload-dir", required=True, help="directory built by bench/workload.py")
    p.add_argument("--variant", choices=["lora", "full"], required=True)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--episodes-per-update", type=int, default=EPISODES_PER_UPDATE)
    p.add_argument("--micro-batch", type=int, default=PER_DEVICE_BATCH)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", default=None, help="keep the stage's run directory here (default: a temp dir, removed)")
    p.add_argument("--profile", default=None, help="also write a cProfile of the stage run (models loaded, loop) here")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra rlhf overrides after the contract's (for experiments; the benchmark passes none)")
    p.add_argument("--out", required=True, help="where to write the JSON result")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------- preparation
def _link_or_copy(src: str, dst: str) -> None:
    """Weights are hard-linked (the real workload's are 1.2 GB each), copied where links are not possible."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy_with_tokenizer(src: Path, tok_dir: Path, dst: Path) -> None:
    tmp = dst.parent / f".{dst.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def prepare(wdir: Path) -> dict:
    """rlhf_policy/ and rlhf_reward/ (model + tokenizer) and rlhf_prompts.jsonl, once per workload directory."""
    marker = wdir / "rlhf_prepared.json"
    paths = {"policy": wdir / "rlhf_policy", "reward": wdir / "rlhf_reward", "prompts": wdir / "rlhf_prompts.jsonl"}
    try:
        if json.loads(marker.read_text()).get("version") == PREP_VERSION and all(p.exists() for p in paths.values()):
            return paths
    except (OSError, ValueError):
        pass
    _copy_with_tokenizer(wdir / "policy", wdir / "tokenizer", paths["policy"])
    _copy_with_tokenizer(wdir / "reward", wdir / "tokenizer", paths["reward"])
    rows = [json.loads(line)["prompt"] for line in (wdir / "prompts.jsonl").read_text().splitlines() if line.strip()]
    tmp = paths["prompts"].with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for text in rows:  # prompt + empty completion: the "messages" format, prompt = one user turn
            f.write(json.dumps({"prompt": text, "completion": ""}, ensure_ascii=False) + "\n")
    os.replace(tmp, paths["prompts"])
    marker.write_text(json.dumps({"version": PREP_VERSION}) + "\n")
    return paths


def check_prompt_tokens(wdir: Path, cfg, policy_dir: Path) -> int:
    """Every prompt as the stage renders and tokenizes it == the ids trl_side.py gives its trainer."""
    from transformers import AutoTokenizer

    from rlhf_cli import data as D
    from rlhf_cli.models import load_tokenizer

    trl_tok = AutoTokenizer.from_pretrained(str(wdir / "tokenizer"))
    prompts = [json.loads(line)["prompt"] for line in (wdir / "prompts.jsonl").read_text().splitlines() if line.strip()]
    trl_ids = trl_tok(prompts, add_special_tokens=False)["input_ids"]
    tok = load_tokenizer(policy_dir, cfg.model)
    examples = D.to_examples(D.read_rows(str(cfg.data.train_path)), "auto", str(cfg.data.train_path))
    ours = [tok(D.prompt_text(tok, ex.prompt, False, bool(cfg.data.chat_template)),
                add_special_tokens=False)["input_ids"] for ex in examples]
    if ours != trl_ids:
        bad = next(i for i, (a, b) in enumerate(zip(ours, trl_ids)) if a != b) if len(ours) == len(trl_ids) else -1
        raise SystemExit(f"prompt token ids differ from the TRL side's (first difference at prompt {bad})")
    if tok.pad_token_id != trl_tok.pad_token_id or tok.eos_token_id != trl_tok.eos_token_id:
        raise SystemExit("pad/eos ids differ from the TRL side's")
    return len(ours)


# ----------------------------------------------------------------------------------------------------- main
def phase_intervals(t0: float, t1: float, stamps: list[float], end: list[float], split: dict) -> list:
    """(name, start, end) of the run's phases: loading (until the first update), each update's generation,
    scoring, PPO epochs and rest (from the trainer's time/* metrics), then saving."""
    if not stamps or not end:
        return [("run", t0, t1)]
    out = [("load", t0, stamps[0])]
    bounds = stamps + [end[-1]]
    for i in range(len(stamps)):
        a = bounds[i]
        for key, name in (("generate_s", "generate"), ("score_s", "score"), ("train_s", "train")):
            vals = split.get(key) or []
            if i < len(vals):
                out.append((f"update {i + 1} {name}", a, a + vals[i]))
                a += vals[i]
        out.append((f"update {i + 1} other", a, bounds[i + 1]))
    out.append(("save", end[-1], t1))
    return out


def code_digest() -> str:
    """A digest of rlhf_cli's sources as this run imported them (the tree changes while others work on it)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted((REPO / "rlhf_cli").rglob("*.py")):
        h.update(f.relative_to(REPO).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.updates < 1 or a.response_length < 1 or a.threads < 1:
        raise SystemExit("--updates, --response-length and --threads must be >= 1")
    if a.micro_batch < 1 or a.episodes_per_update % a.micro_batch:
        raise SystemExit("--micro-batch must divide --episodes-per-update")

    # Thread pools are sized when torch first loads; set the environment before importing it.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

    import logging
    import resource

    import torch

    torch.set_num_threads(a.threads)

    import transformers

    import rlhf_cli
    from rlhf_cli.config import compose
    from rlhf_cli.stages import ppo as ppo_mod

    logging.getLogger("rlhf").setLevel(logging.WARNING)
    digest = code_digest()
    wdir = Path(a.workload_dir).resolve()
    meta = json.loads((wdir / "workload.json").read_text())
    paths = prepare(wdir)

    run_dir = Path(a.keep).resolve() if a.keep else Path(tempfile.mkdtemp(prefix="rlhf_ppo_bench_"))
    episodes = a.updates * a.episodes_per_update
    precision = {"fp32": ["model.dtype=float32", "device.mixed_precision=no"],
                 "bf16": ["model.dtype=bfloat16", "device.mixed_precision=bf16"]}[a.precision]
    overrides = [
        f"run_dir={run_dir}",
        f"seed={a.seed}",
        f"data.train_path={paths['prompts']}",
        "data.eval_path=null",
        "data.ground_truth=null",
        "data.chat_template=false",
        "data.max_prompt_length=128",
        "device=cpu",
        *precision,
        f"device.threads={a.threads}",
        f"ppo.policy_dir={paths['policy']}",
        f"ppo.reward_dir={paths['reward']}",
        f"ppo.output_dir={run_dir}/ppo",
        "ppo.value_init=reward",
        f"ppo.lora.enabled={'true' if a.variant == 'lora' else 'false'}",
        "ppo.lora.r=8",
        "ppo.lora.alpha=16",
        "ppo.lora.target_modules=all-linear",
        f"ppo.per_device_train_batch_size={a.micro_batch}",
        f"ppo.gradient_accumulation_steps={a.episodes_per_update // a.micro_batch}",
        "ppo.num_mini_batches=1",
        f"ppo.rollout_forward_batch_size={a.episodes_per_update}",
        "ppo.num_ppo_epochs=2",
        "ppo.learning_rate=5e-6",
        "ppo.temperature=0.7",
        f"ppo.response_length={a.response_length}",
        "ppo.stop_token=null",
        "ppo.missing_eos_penalty=null",
        "ppo.empty_response_penalty=null",
        "ppo.normalize_scores=false",
        f"ppo.total_episodes={episodes}",
        "ppo.sample_every=0",
        "ppo.eval_every=0",         # the bench times training; held-out evaluation is off
        "ppo.save_every=0",
        "ppo.merge=false",
        *a.set,
    ]
    cfg = compose("ppo", overrides)

    # ---- instrumentation through the trainer's hooks: update stamps, logged scores, trainable parameters ----
    from rlhf_cli.ppo.trainer import Hooks

    stamps: list[float] = []
    end_stamp: list[float] = []
    cpu_stamps: list[float] = []
    logged: dict[str, list[float]] = {}
    captured: dict = {}

    def on_train_start(trainer):
        # a value embedding stepped by rows (rlhf_cli.accel.sparse_rows: its weight out of autograd, its lookup
        # swapped) still trains all of its rows
        value = trainer.value_model()
        emb = value.get_input_embeddings() if value is not None else None
        rows = emb is not None and not emb.weight.requires_grad and "forward" in emb.__dict__
        captured["trainable"] = sum(q.numel() for q in trainer.pol_params + trainer.val_params) + \
            (emb.weight.numel() if rows else 0)

    def on_update_start(update):
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.process_time())

    def on_update(update, metrics):
        for tag, value in metrics.items():
            logged.setdefault(tag, []).append(float(value))
        if update == a.updates:
            end_stamp.append(time.perf_counter())
            cpu_stamps.append(time.process_time())

    hooks = Hooks(on_train_start=on_train_start, on_update_start=on_update_start, on_update=on_update)

    profiler = None
    if a.profile:
        import cProfile

        # imported here so that the profile shows the stage, not the first import of its dependencies
        import accelerate  # noqa: F401
        import peft  # noqa: F401
        import torch.utils.tensorboard  # noqa: F401
        from transformers import GenerationConfig, get_scheduler  # noqa: F401

        profiler = cProfile.Profile()
    from memtrace import RssSampler, memory_status

    sampler = RssSampler()
    sampler.start()
    t_run0 = time.perf_counter()
    if profiler is not None:
        profiler.runcall(ppo_mod.run, cfg, hooks)
        profiler.dump_stats(a.profile)
    else:
        ppo_mod.run(cfg, hooks)
    t_run1 = time.perf_counter()
    sampler.stop()

    # after the run, so that the check's tokenizers and rows are not part of the measured peak RSS
    n_prompts = check_prompt_tokens(wdir, cfg, paths["policy"])
    out_dir = run_dir / "ppo"
    summary = json.loads((out_dir / "metrics.json").read_text())
    stage_train_s = float(summary["train_seconds"])
    if len(stamps) == a.updates and end_stamp:
        bounds = stamps + [end_stamp[-1]]
        s_per_update = [round(bounds[i + 1] - bounds[i], 4) for i in range(a.updates)]
        train_s = end_stamp[-1] - stamps[0]
    else:  # the stage changed shape: fall back to its own loop time
        train_s = stage_train_s
        s_per_update = [round(train_s / a.updates, 4)] * a.updates
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    mem = memory_status()
    split = {key: [round(v, 4) for v in logged.get(f"time/{key}", [])] for key in ("generate_s", "score_s", "train_s")}
    if all(len(v) == len(s_per_update) for v in split.values()):
        split["other_s"] = [round(t - sum(v[i] for v in split.values()), 4) for i, t in enumerate(s_per_update)]

    phases = phase_intervals(t_run0, t_run1, stamps, end_stamp, split)
    scores = logged.get("objective/scores", [])
    trainable = captured.get("trainable")

    result = {
        "side": "rlhf",
        "rlhf_version": getattr(rlhf_cli, "__version__", None),
        "rlhf_cli_digest": digest,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "variant": a.variant,
        "workload": meta.get("name", wdir.name),
        "workload_dir": str(wdir),
        "updates": a.updates,
        "episodes": episodes,
        "episodes_per_update": a.episodes_per_update,
        "micro_batch": a.micro_batch,
        "precision": a.precision,
        "precision_detail": {"fp32": "fp32 weights and compute",
                             "bf16": "frozen weights (LoRA base = reference, reward model) bf16, trainable "
                                     "(LoRA, value model) fp32, bf16 autocast, old log-probs recomputed"}[a.precision],
        "response_length": a.response_length,
        "response_tokens": episodes * a.response_length,
        "train_s": round(train_s, 4),
        "eps": round(episodes / train_s, 6),
        "tokens_per_s": round(episodes * a.response_length / train_s, 2),
        "s_per_update": s_per_update,
        "split_s": split,
        "peak_rss_mb": round(peak_rss_mb, 1),
        "rss_anon_end_mb": mem.get("RssAnon"),
        "rss_file_end_mb": mem.get("RssFile"),
        "rss_peak_phase": sampler.peak_phase(phases),
        "rss_phase_peaks_mb": sampler.phase_peaks([(n.split()[-1], a, b) for n, a, b in phases]),
        "cpu_s": round(cpu_stamps[-1] - cpu_stamps[0], 4) if len(cpu_stamps) > 1 else None,
        "threads": a.threads,
        "gc_disabled": False,  # the stage never forces a collection; automatic collection stays on
        "gc_calls": 0,
        "gc_s": 0.0,
        "scores_first": scores[0] if scores else None,
        "scores_last": scores[-1] if scores else summary.get("objective/scores"),
        "kl_last": summary.get("objective/kl"),
        "trainable_params": trainable,
        "stage_train_s": stage_train_s,
        "run_s": round(t_run1 - t_run0, 3),
        "prompts_checked": n_prompts,
        "prompt_tokens_identical": True,
    }
    if not a.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("variant", "workload", "eps", "train_s", "peak_rss_mb", "scores_first",
                                              "scores_last")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
