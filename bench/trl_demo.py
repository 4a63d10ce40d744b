"""TRL side of the learning comparison: TRL 1.12's PPOTrainer on the demo task (polite answers).

Run inside bench/.venv-trl112 (see bench/setup_trl_env.sh); bench/learning.py prepares the inputs:

    bench/.venv-trl112/bin/python bench/trl_demo.py --policy-dir SFT_DIR --reward-dir RM_DIR \
        --prompts prompts.jsonl --settings ppo_settings.json --save-dir OUT --out result.json

The prompts file holds {"prompt": str} rows already rendered with the tokenizer's chat template (the rlhf
side renders them the same way), tokenized here without special tokens. The settings file holds the rlhf
side's PPO settings (batch sizes, mini-batches, epochs, lr and schedule, KL coefficient, GAE and clipping
constants, response length, temperature, LoRA rank/alpha/targets); the run mirrors the rlhf demo run with
them: LoRA policy whose reference is the adapter disabled, value model initialised from the reward model,
responses cut after the first EOS, no EOS penalty, raw reward-model scores. The forced gc.collect() calls
are removed (they cost time, not learning).

Per update it records the mean raw RM score (objective/scores), the KL and, from the sampled responses
themselves, the rule-checked polite rate (rlhf_cli.demo.is_polite). The final adapter is saved to
--save-dir, so that `rlhf eval` can score it next to the rlhf policy on the same held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy-dir", required=True)
    p.add_argument("--reward-dir", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--settings", required=True, help="JSON: the PPO settings of the rlhf side (bench/learning.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    torch.set_num_threads(a.threads)

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)

    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig, TaskType
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_mod

    sys.path.insert(0, str(REPO))  # rlhf_cli.demo is plain Python: the rule-based checker
    from rlhf_cli.demo import is_polite

    transformers.logging.set_verbosity_error()
    ppo_mod.gc = types.SimpleNamespace(collect=lambda *args, **kw: 0)
    ppo_mod.empty_cache = lambda: None

    tok = AutoTokenizer.from_pretrained(a.policy_dir)
    tok.padding_side = "left"
    prompts = [json.loads(line)["prompt"] for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    train_ds = Dataset.from_dict({"input_ids": ids})

    policy = AutoModelForCausalLM.from_pretrained(a.policy_dir, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(a.reward_dir, num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(a.reward_dir, num_labels=1, dtype=torch.float32)
    for m in (reward, value):
        m.config.pad_token_id = tok.pad_token_id
    st = json.loads(Path(a.settings).read_text())
    lo = st["lora"]
    peft_config = LoraConfig(r=int(lo["r"]), lora_alpha=int(lo["alpha"]), lora_dropout=float(lo.get("dropout", 0.0)),
                             target_modules=lo["target_modules"], task_type=TaskType.CAUSAL_LM)

    outdir = tempfile.mkdtemp(prefix="trl_ppo_demo_")
    cfg = PPOConfig(
        output_dir=outdir, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        eval_strategy="no", logging_steps=1, disable_tqdm=True, seed=a.seed,
        per_device_train_batch_size=int(st["per_device_train_batch_size"]), per_device_eval_batch_size=8,
        gradient_accumulation_steps=int(st["gradient_accumulation_steps"]),
        local_rollout_forward_batch_size=int(st["rollout_forward_batch_size"]),
        num_ppo_epochs=int(st["num_ppo_epochs"]), num_mini_batches=int(st["num_mini_batches"]),
        learning_rate=float(st["learning_rate"]), lr_scheduler_type=str(st["lr_scheduler_type"]),
        # transformers 5: a warmup_steps value below 1 is a fraction of the run (ppo.warmup_ratio)
        warmup_steps=float(st["warmup_ratio"]), weight_decay=float(st["weight_decay"]),
        max_grad_norm=float(st["max_grad_norm"]), gamma=float(st["gamma"]), lam=float(st["lam"]),
        cliprange=float(st["cliprange"]), cliprange_value=float(st["cliprange_value"]), vf_coef=float(st["vf_coef"]),
        kl_coef=float(st["kl_coef"]), kl_estimator=str(st["kl_estimator"]), whiten_rewards=bool(st["whiten_rewards"]),
        temperature=float(st["temperature"]), response_length=int(st["response_length"]),
        stop_token="eos", missing_eos_penalty=None, total_episodes=int(st["total_episodes"]),
        num_sample_generations=0, dataloader_num_workers=0,
        **({"adam_epsilon": float(st["adam_epsilon"])} if st.get("adam_epsilon") is not None else {}),
    )

    logs: list[dict] = []
    polite: list[float] = []

    class LogCatcher(TrainerCallback):
        def on_log(self, args, state, control, **kw):
            payload = kw.get("logs")
            if payload and "objective/scores" in payload:
                logs.append(dict(payload))

    real_generation = ppo_mod.batch_generation

    def batch_generation(model, queries, *args, **kw):
        query_responses, logitss = real_generation(model, queries, *args, **kw)
        resp = query_responses[:, queries.shape[1]:]
        resp = ppo_mod.truncate_response(tok.eos_token_id, tok.pad_token_id, resp)
        texts = tok.batch_decode(resp, skip_special_tokens=True)
        polite.append(sum(is_polite(t) for t in texts) / max(len(texts), 1))
        return query_responses, logitss

    ppo_mod.batch_generation = batch_generation

    trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=None, reward_model=reward,
                         train_dataset=train_ds, value_model=value, eval_dataset=train_ds.select(range(8)),
                         callbacks=[LogCatcher()], peft_config=peft_config)
    trainer.remove_callback(PrinterCallback)
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0

    save = Path(a.save_dir)
    save.mkdir(parents=True, exist_ok=True)
    trainer.model.policy.save_pretrained(str(save))
    tok.save_pretrained(str(save))

    result = {
        "side": "trl",
        "trl_version": trl.__version__,
        "episodes": int(st["total_episodes"]),
        "seed": a.seed,
        "train_s": round(train_s, 3),
        "rm_scores": [l["objective/scores"] for l in logs],
        "kl": [l.get("objective/kl") for l in logs],
        "polite_rate": polite[: len(logs)] if logs else polite,
        "num_eos_tokens": [l.get("val/num_eos_tokens") for l in logs],
        "save_dir": str(save),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("side", "episodes", "seed", "train_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
