"""TRL side of the PPO speed benchmark: TRL 1.12's experimental PPOTrainer on a bench workload.

Run inside the dedicated environment (see bench/setup_trl_env.sh):

    bench/.venv-trl112/bin/python bench/trl_side.py --workload-dir bench/work/tiny \
        --variant lora --updates 8 --response-length 32 --threads 1 [--no-gc] --out result.json

Fixed settings (the comparison contract): 32 episodes per update (per-device batch 8 x gradient
accumulation 4), one rollout forward batch of 32, 2 PPO epochs, 1 mini-batch, lr 5e-6, temperature 0.7,
no stop token (every response is exactly --response-length tokens), no EOS penalty, value model
initialised from the reward model, CPU fp32, no saving, logging, sample generations or evaluation.

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
GRAD_ACCUM = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload-dir", required=True, help="directory built by bench/workload.py")
    p.add_argument("--variant", choices=["lora", "full"], required=True)
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-gc", action="store_true", help="disable the forced gc.collect()/empty_cache() calls in trl's PPO loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="where to write the JSON result")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.updates < 1 or a.response_length < 1 or a.threads < 1:
        raise SystemExit("--updates, --response-length and --threads must be >= 1")

    # Thread pools are sized when torch first loads; set the environment before importing it.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

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
    real_gc = ppo_mod.gc
    if a.no_gc:
        ppo_mod.gc = types.SimpleNamespace(collect=lambda *args, **kw: 0)
        ppo_mod.empty_cache = lambda: None
    else:
        def timed_collect(*args, **kw):
            t = time.perf_counter()
            n = real_gc.collect(*args, **kw)
            gc_stats["seconds"] += time.perf_counter() - t
            gc_stats["calls"] += 1
            return n

        ppo_mod.gc = types.SimpleNamespace(collect=timed_collect)

    # ---- data ---------------------------------------------------------------------------------
    t_load0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(wdir / "tokenizer"))
    prompts = [json.loads(line)["prompt"] for line in (wdir / "prompts.jsonl").read_text().splitlines() if line.strip()]
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    train_ds = Dataset.from_dict({"input_ids": ids})
    eval_ds = Dataset.from_dict({"input_ids": ids[:PER_DEVICE_BATCH]})

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
        bf16=False,
        fp16=False,
        activation_checkpointing=False,  # never enabled by PPOTrainer.train(); explicit for clarity
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=a.seed,
        per_device_train_batch_size=PER_DEVICE_BATCH,
        per_device_eval_batch_size=PER_DEVICE_BATCH,
        gradient_accumulation_steps=GRAD_ACCUM,
        local_rollout_forward_batch_size=EPISODES_PER_UPDATE,
        num_ppo_epochs=2,
        num_mini_batches=1,
        learning_rate=5e-6,
        temperature=0.7,
        response_length=a.response_length,
        stop_token=None,
        stop_token_id=None,
        missing_eos_penalty=None,
        total_episodes=a.updates * EPISODES_PER_UPDATE,
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

    c0 = time.process_time()
    t0 = time.perf_counter()
    trainer.train()
    t1 = time.perf_counter()
    cpu_s = time.process_time() - c0
    train_s = t1 - t0

    stamps = batch_times[: a.updates] + [t1]
    s_per_update = [round(stamps[i + 1] - stamps[i], 4) for i in range(len(stamps) - 1)]
    if len(s_per_update) != a.updates:  # should not happen; fall back to the mean
        s_per_update = [round(train_s / a.updates, 4)] * a.updates

    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    episodes = a.updates * EPISODES_PER_UPDATE
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
        "response_length": a.response_length,
        "train_s": round(train_s, 4),
        "eps": round(episodes / train_s, 3),
        "s_per_update": s_per_update,
        "peak_rss_mb": round(peak_rss_mb, 1),
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
    print(json.dumps({k: result[k] for k in ("variant", "workload", "eps", "train_s", "peak_rss_mb", "gc_disabled", "scores_first", "scores_last")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
