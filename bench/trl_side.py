"""TRL side of the PPO speed benchmark: TRL 1.12's experimental PPOTrainer on a bench workload.

Run inside the dedicated environment (see bench/setup_trl_env.sh):

    bench/.venv-trl112/bin/python bench/trl_side.py --workload-dir bench/work/tiny \
        --variant lora --updates 8 --response-length 32 --threads 1 [--no-gc] --out result.json

Fixed settings (the comparison contract): 32 episodes per update (per-device batch 8 x gradient
accumulation 4), one rollout forward batch of 32, 2 PPO epochs, 1 mini-batch, lr 5e-6, temperature 0.7,
no stop token (every response is exactly --response-length tokens), no EOS penalty, value model
initialised from the reward model, CPU, no saving, logging, sample generations or evaluation.
--episodes-per-update E --micro-batch M change the batch to E episodes per update (micro-batch M x accumulation
E/M, rollout forward batch E).

--precision fp32 (default): models loaded in fp32, bf16=False.
--precision bf16: TRL's own bf16 option, PPOConfig(bf16=True): the models stay fp32 and accelerate wraps the
prepared policy-and-value module's forward in bf16 autocast. TRL 1.12 samples with `unwrapped_model.policy` and
scores with `model.policy` (reference), the unwrapped value model and the reward model, none of which goes through
that forward: generation and scoring stay fp32, the PPO epochs' forward and backward run in bf16 autocast.

variant lora: LoRA r 8 / alpha 16 on all linear layers of the policy; the reference is the policy with the
              adapter disabled (ref_model=None).
variant full: full fine-tuning; the reference is a second copy of the policy loaded from disk.

--no-gc replaces the `gc` module and the `empty_cache` helper as seen by trl's ppo_trainer module with
no-ops, which removes the forced `gc.collect()` calls TRL makes twice per update (and the device
cache flushes, which do nothing on CPU). Python's automatic generational collection stays on. Without
--no-gc the same calls are only wrapped to count and time them (gc_calls / gc_s in the result).

Timing covers trainer.train() only. Per-update times are taken from the moment each update asks the
dataloader for its batch (the first thing an update does) to the next such moment, the last one ending
when train() returns; they add up to train_s minus the short set-up before the first update.
The split of each update: generate_s = trl's batch_generation(); score_s = from there to the first forward with
gradients (reference log-probs, values, reward scores, advantages); train_s = the PPO epochs, from that forward to
the metrics; other_s = the rest (metrics, logging, the forced gc.collect() calls).
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
    p.add_argument("--no-gc", action="store_true",
                   help="disable the forced gc.collect()/empty_cache() calls in trl's PPO loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="also write a cProfile of trainer.train() here")
    p.add_argument("--out", required=True, help="where to write the JSON result")
    return p.parse_args(argv)


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
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if a.precision == "bf16":
        # PPOTrainer builds its own Accelerator(gradient_accumulation_steps=...) and never passes bf16 on; with
        # transformers 4 TrainingArguments(bf16=True) exported this variable, which is what the Accelerator reads.
        # Under transformers 5 it is no longer exported, so bf16=True alone leaves mixed_precision at "no".
        os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"

    import torch

    torch.set_num_threads(a.threads)

    import resource
    import types
    import warnings

    # transformers 5 deprecation notices triggered by trl 1.12 internals (e.g. is_gradient_checkpointing).
    warnings.filterwarnings("ignore", category=FutureWarning)

    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig, TaskType
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from transformers.trainer_callback import PrinterCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_mod

    transformers.logging.set_verbosity_error()

    wdir = Path(a.workload_dir)
    meta = json.loads((wdir / "workload.json").read_text())

    # ---- gc handling inside trl's PPO module --------------------------------------------------
    gc_stats = {"calls": 0, "seconds": 0.0}
    gc_calls: list[tuple[float, float]] = []  # (start, seconds) of each forced collection
    real_gc = ppo_mod.gc
    if a.no_gc:
        ppo_mod.gc = types.SimpleNamespace(collect=lambda *args, **kw: 0)
        ppo_mod.empty_cache = lambda: None
    else:
        def timed_collect(*args, **kw):
            t = time.perf_counter()
            n = real_gc.collect(*args, **kw)
            dt = time.perf_counter() - t
            gc_stats["seconds"] += dt
            gc_stats["calls"] += 1
            gc_calls.append((t, dt))
            return n

        ppo_mod.gc = types.SimpleNamespace(collect=timed_collect)

    # ---- time split: generation (batch_generation), scoring (until the first forward with gradients), epochs
    marks: list[tuple[str, float]] = []
    real_batch_generation, real_forward = ppo_mod.batch_generation, ppo_mod.forward

    def timed_batch_generation(*args, **kw):
        marks.append(("gen_start", time.perf_counter()))
        out = real_batch_generation(*args, **kw)
        marks.append(("gen_end", time.perf_counter()))
        return out

    def marked_forward(*args, **kw):
        if torch.is_grad_enabled() and (not marks or marks[-1][0] != "train_start"):
            marks.append(("train_start", time.perf_counter()))
        return real_forward(*args, **kw)

    ppo_mod.batch_generation, ppo_mod.forward = timed_batch_generation, marked_forward

    # ---- data ---------------------------------------------------------------------------------
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memtrace import RssSampler, memory_status

    sampler = RssSampler()
    sampler.start()
    t_load0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(wdir / "tokenizer"))
    prompts = [json.loads(line)["prompt"] for line in (wdir / "prompts.jsonl").read_text().splitlines() if line.strip()]
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    train_ds = Dataset.from_dict({"input_ids": ids})
    eval_ds = Dataset.from_dict({"input_ids": ids[:a.micro_batch]})

    # ---- models -------------------------------------------------------------------------------
    policy = AutoModelForCausalLM.from_pretrained(str(wdir / "policy"), dtype=torch.float32)
    ref_model = None
    peft_config = None
    if a.variant == "full":
        ref_model = AutoModelForCausalLM.from_pretrained(str(wdir / "policy"), dtype=torch.float32)
    else:
        peft_config = LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type=TaskType.CAUSAL_LM
        )
    reward = AutoModelForSequenceClassification.from_pretrained(str(wdir / "reward"), num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(str(wdir / "reward"), num_labels=1, dtype=torch.float32)
    load_s = time.perf_counter() - t_load0

    outdir = tempfile.mkdtemp(prefix="trl_ppo_bench_")
    cfg = PPOConfig(
        output_dir=outdir,
        use_cpu=True,
        bf16=a.precision == "bf16",
        fp16=False,
        activation_checkpointing=False,  # never enabled by PPOTrainer.train(); explicit for clarity
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=a.seed,
        per_device_train_batch_size=a.micro_batch,
        per_device_eval_batch_size=a.micro_batch,
        gradient_accumulation_steps=a.episodes_per_update // a.micro_batch,
        local_rollout_forward_batch_size=a.episodes_per_update,
        num_ppo_epochs=2,
        num_mini_batches=1,
        learning_rate=5e-6,
        temperature=0.7,
        response_length=a.response_length,
        stop_token=None,
        stop_token_id=None,
        missing_eos_penalty=None,
        total_episodes=a.updates * a.episodes_per_update,
        num_sample_generations=0,
        dataloader_num_workers=0,
    )

    logs: list[dict] = []

    class LogCatcher(TrainerCallback):
        def on_log(self, args, state, control, **kw):
            payload = kw.get("logs")
            if payload and "objective/scores" in payload:
                logs.append(dict(payload))

    t_init0 = time.perf_counter()
    trainer = PPOTrainer(
        args=cfg,
        processing_class=tok,
        model=policy,
        ref_model=ref_model,
        reward_model=reward,
        train_dataset=train_ds,
        value_model=value,
        eval_dataset=eval_ds,
        callbacks=[LogCatcher()],
        peft_config=peft_config,
    )
    init_s = time.perf_counter() - t_init0
    # disable_tqdm=True makes the trainer print every metrics dict; keep stdout to the one result line.
    trainer.remove_callback(PrinterCallback)

    # Time stamp each update's batch request: train() iterates `trainer.dataloader` endlessly and
    # takes exactly one batch at the start of every update.
    batch_times: list[float] = []

    class StampedLoader:
        def __init__(self, inner):
            self.inner = inner

        def __iter__(self):
            for batch in self.inner:
                batch_times.append(time.perf_counter())
                yield batch

        def __len__(self):
            return len(self.inner)

    trainer.dataloader = StampedLoader(trainer.dataloader)

    profiler = None
    if a.profile:
        import cProfile

        profiler = cProfile.Profile()
    c0 = time.process_time()
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.runcall(trainer.train)
        profiler.dump_stats(a.profile)
    else:
        trainer.train()
    t1 = time.perf_counter()
    cpu_s = time.process_time() - c0
    train_s = t1 - t0
    sampler.stop()

    stamps = batch_times[: a.updates] + [t1]
    s_per_update = [round(stamps[i + 1] - stamps[i], 4) for i in range(len(stamps) - 1)]
    if len(s_per_update) != a.updates:  # should not happen; fall back to the mean
        s_per_update = [round(train_s / a.updates, 4)] * a.updates

    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    mem = memory_status()
    episodes = a.updates * a.episodes_per_update
    split = {"generate_s": [], "score_s": [], "train_s": [], "other_s": []}

    def gc_between(t0, t1):
        return sum(dt for t, dt in gc_calls if t0 <= t < t1)

    for i in range(len(stamps) - 1):
        inside = {k: t for k, t in marks if stamps[i] <= t < stamps[i + 1]}
        if len(inside) != 3:
            split = None  # train() changed shape: no split
            break
        gc_score = gc_between(inside["gen_end"], inside["train_start"])
        gc_rest = gc_between(inside["train_start"], stamps[i + 1])
        split["generate_s"].append(round(inside["gen_end"] - inside["gen_start"], 4))
        split["score_s"].append(round(inside["train_start"] - inside["gen_end"] - gc_score, 4))
        # the epochs run from the first forward with gradients to the metrics; the metrics themselves (a few ms)
        # are not separated from them without patching train()
        split["train_s"].append(round(stamps[i + 1] - inside["train_start"] - gc_rest, 4))
        split["other_s"].append(round(s_per_update[i] - split["generate_s"][-1] - split["score_s"][-1]
                                      - split["train_s"][-1], 4))
    mixed = str(getattr(trainer.accelerator, "mixed_precision", "no"))
    phases = [("load", t_load0, stamps[0])]
    for i in range(len(stamps) - 1):
        inside = {k: t for k, t in marks if stamps[i] <= t < stamps[i + 1]}
        if len(inside) == 3:
            phases += [(f"update {i + 1} other", stamps[i], inside["gen_start"]),
                       (f"update {i + 1} generate", inside["gen_start"], inside["gen_end"]),
                       (f"update {i + 1} score", inside["gen_end"], inside["train_start"]),
                       (f"update {i + 1} train", inside["train_start"], stamps[i + 1])]
    scores = [l["objective/scores"] for l in logs]
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)

    result = {
        "side": "trl",
        "trl_version": trl.__version__,
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
        "precision_detail": ("fp32 weights and compute" if a.precision == "fp32" else
                             f"PPOConfig(bf16=True): fp32 weights, accelerate mixed_precision={mixed} (autocast on "
                             "the PPO epochs' policy-and-value forward; generation and scoring fp32)"),
        "accelerate_mixed_precision": mixed,
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
        "cpu_s": round(cpu_s, 4),  # process CPU time over train(): less sensitive than train_s to a busy machine
        "threads": a.threads,
        "gc_disabled": bool(a.no_gc),
        "gc_calls": None if a.no_gc else gc_stats["calls"],
        "gc_s": None if a.no_gc else round(gc_stats["seconds"], 4),
        "scores_first": scores[0] if scores else None,
        "scores_last": scores[-1] if scores else None,
        "kl_last": logs[-1].get("objective/kl") if logs else None,
        "trainable_params": trainable,
        "load_s": round(load_s, 3),
        "init_s": round(init_s, 3),
    }
    shutil.rmtree(outdir, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("variant", "workload", "eps", "train_s", "peak_rss_mb", "gc_disabled",
                                             "scores_first", "scores_last")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
