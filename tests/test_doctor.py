"""`rlhf doctor` and the memory plan (rlhf_cli.memory): parameter counts against real models, the sharding
arithmetic, advice that fits, the real CLI on both recipes, and the tiny plan against measured peak RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf_cli import memory as M
from rlhf_cli.config import compose

QWEN = M.KNOWN_ARCHS["Qwen/Qwen3-0.6B"]
PROBE = Path(__file__).with_name("rss_probe.py")


def tiny_arch():
    return M.arch_for_model(compose("ppo").model)[0]


# ------------------------------------------------------------------------------------------ parameter counts
def test_qwen3_0_6b_counts():
    # published: 0.6B parameters, 0.44B without embeddings
    assert M.causal_lm_params(QWEN) == pytest.approx(596.05e6, rel=1e-4)
    assert M.causal_lm_params(QWEN) - QWEN.vocab_size * QWEN.hidden_size == pytest.approx(440.4e6, rel=1e-3)


def _tiny_models():
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen3Config, Qwen3ForCausalLM

    t = compose("ppo").model.tiny
    conf = Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                       intermediate_size=t.intermediate_size, num_hidden_layers=t.num_hidden_layers,
                       num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                       head_dim=t.head_dim, tie_word_embeddings=True, pad_token_id=0, num_labels=1)
    with torch.device("meta"):
        return conf, Qwen3ForCausalLM(conf), AutoModelForSequenceClassification.from_config(conf)


def test_counts_match_transformers_and_peft():
    from peft import LoraConfig, get_peft_model

    conf, lm, cls = _tiny_models()
    a = M.arch_from_config(conf.to_dict())
    assert a == tiny_arch()
    assert M.causal_lm_params(a) == sum(p.numel() for p in lm.parameters())
    assert M.seq_cls_params(a) == sum(p.numel() for p in cls.parameters())
    peft_model = get_peft_model(lm, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert M.lora_params(a, 8, "all-linear") == trainable
    qv = a.num_hidden_layers * 8 * (2 * a.hidden_size + a.q_dim + a.kv_dim)
    assert M.lora_params(a, 8, ["q_proj", "v_proj"]) == qv


def test_arch_from_a_local_config_json(tmp_path):
    conf, _, _ = _tiny_models()
    (tmp_path / "config.json").write_text(json.dumps(conf.to_dict()))
    cfg = compose("ppo", [f"model.name_or_path={tmp_path}"])
    a, source = M.arch_for_model(cfg.model)
    assert a == tiny_arch() and source == str(tmp_path / "config.json")
    qwen = compose("ppo", ["recipe=qwen3-0.6b", "model.cache_dir=" + str(tmp_path / "none")])
    a, source = M.arch_for_model(qwen.model)
    assert a == QWEN and "built-in table" in source
    with pytest.raises(ValueError, match="built-in table"):
        M.arch_for_model(compose("ppo", ["model.name_or_path=acme/unknown-7b"]).model)


# ---------------------------------------------------------------------------------------- plan arithmetic
def _items(plan):
    return {i.name: i for i in plan.items}


def test_sharding_divides_what_it_should():
    cfg = compose("sft", ["recipe=qwen3-0.6b"])
    single = _items(M.plan_stage(cfg, "sft", QWEN))
    s = M.setup_from(cfg)
    four = dict(strategy="deepspeed", world=4, per_machine=4)
    z2 = _items(M.plan_stage(cfg, "sft", QWEN, replace(s, zero_stage=2, **four)))
    z3 = _items(M.plan_stage(cfg, "sft", QWEN, replace(s, zero_stage=3, offload_optimizer=True, **four)))
    n = M.causal_lm_params(QWEN)
    assert single["policy weights"].bytes == n * 2
    assert single["optimizer (policy)"].bytes == n * 4  # torch AdamW: 2 states in bf16
    assert z2["policy weights"].bytes == n * 2  # ZeRO-2 keeps whole weights
    assert z2["gradients (policy)"].bytes == n * 2 / 4
    assert z2["optimizer (policy)"].bytes == n * 12 / 4  # fp32 states + fp32 master, sharded
    assert z3["policy weights"].bytes == n * 2 / 4
    assert z3["optimizer (policy)"].kind == "offloaded"
    ddp = _items(M.plan_stage(cfg, "sft", QWEN, replace(s, strategy="ddp", world=2)))
    assert ddp["DDP gradient buckets"].bytes == n * 2


def test_checkpointing_and_micro_batch_lower_the_peak():
    cfg = compose("sft", ["recipe=qwen3-0.6b"])
    base = M.plan_stage(cfg, "sft", QWEN)
    ck = M.plan_stage(compose("sft", ["recipe=qwen3-0.6b", "sft.activation_checkpointing=true"]), "sft", QWEN)
    assert _items(ck)["activations"].bytes < _items(base)["activations"].bytes / 5
    half_cfg = compose("sft", ["recipe=qwen3-0.6b", "sft.per_device_train_batch_size=2"])
    half = M.plan_stage(half_cfg, "sft", QWEN)
    assert _items(half)["activations"].bytes == pytest.approx(_items(base)["activations"].bytes / 2)


def test_ppo_plan_terms():
    cfg = compose("ppo", ["recipe=qwen3-0.6b"])
    p = M.plan_stage(cfg, "ppo", QWEN)
    it = _items(p)
    assert it["reference"].bytes == 0  # LoRA: the adapter disabled is the reference
    assert it["KV cache"].bytes == 2 * 28 * 8 * 128 * 32 * (256 + 200) * 2
    assert it["generation logits"].bytes == 5 * 32 * 151936 * 4  # one step at a time
    full = _items(M.plan_stage(compose("ppo", ["recipe=qwen3-0.6b", "ppo.lora.enabled=false"]), "ppo", QWEN))
    assert full["reference weights"].bytes == M.causal_lm_params(QWEN) * 2
    assert p.peak == pytest.approx(p.static + p.slack * p.transient + p.overhead)


def test_advice_fits_the_budget():
    cfg = compose("ppo", ["recipe=qwen3-0.6b"])
    s = M.setup_from(cfg)
    budget = 24 * M.GiB
    assert M.plan_stage(cfg, "ppo", QWEN, s).peak > budget
    singles, combo = M.remedies(cfg, "ppo", QWEN, s, budget)
    advice = singles + ([combo] if combo else [])
    assert advice
    assert all(plan.peak <= budget and label.startswith("ppo.") for label, plan in advice)
    sft_cfg = compose("sft", ["recipe=qwen3-0.6b", "sft.per_device_eval_batch_size=4"])
    singles, _ = M.remedies(sft_cfg, "sft", QWEN, M.setup_from(sft_cfg), 6 * M.GiB)
    assert all(p.peak <= 6 * M.GiB for _, p in singles)


# -------------------------------------------------------------------------------------------- the real CLI
def test_doctor_tiny(run_cli):
    t0 = time.perf_counter()
    rc, out, err = run_cli("doctor", timeout=60)
    assert rc == 0, err
    assert time.perf_counter() - t0 < 20
    for needle in ("versions", "torch ", "transformers ", "trl ", "peft ", "accelerate ", "CUDA", "RAM",
                   "ModelScope:", "Hugging Face hub:", "memory plan per process", "peak per process",
                   "KV cache", "generation logits", "-> fits"):
        assert needle in out, needle
    assert out.count("peak per process") == 3  # sft, reward, ppo


def test_doctor_qwen_recipe_offline(run_cli):
    t0 = time.perf_counter()
    rc, out, err = run_cli("doctor", "recipe=qwen3-0.6b", "doctor.memory_gib=24", timeout=60)
    assert rc == 0, err
    assert time.perf_counter() - t0 < 20
    assert "built-in table" in out and "596.0M parameters" in out
    assert "DOES NOT FIT" in out and "to fit" in out  # ppo on 24 GiB needs changes, and says which
    rc, out, err = run_cli("doctor", "recipe=qwen3-0.6b", "device=zero3", "device.num_processes=4",
                           timeout=60)
    assert rc == 0, err
    assert "ZeRO-3" in out and "ppo runs under ddp only" in out


# ------------------------------------------------------------------------- plan against measured peak RSS
@pytest.mark.slow
def test_tiny_ppo_plan_within_30_percent_of_measured_rss(tmp_path):
    """Peak RSS growth of `rlhf ppo` (tiny recipe, in a fresh process, after its imports) against the plan."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MALLOC_MMAP_THRESHOLD_"):
        env.pop(k, None)
    run_dir = f"run_dir={tmp_path / 'run'}"
    for args in (["sft", "sft.max_steps=5", "sft.eval_steps=100"],
                 ["reward", "reward.max_steps=5", "reward.eval_steps=100"]):
        p = subprocess.run([sys.executable, "-m", "rlhf_cli.cli", *args, run_dir, "device.threads=1"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    ov = [run_dir, "device.threads=1", "ppo.total_episodes=128"]
    p = subprocess.run([sys.executable, str(PROBE), "ppo", *ov], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    measured = json.loads(p.stdout.strip().splitlines()[-1])["growth_mib"] * M.MiB
    cfg = compose("ppo", ov)
    plan = M.plan_stage(cfg, "ppo", M.arch_for_model(cfg.model)[0])
    err = (plan.peak - measured) / measured
    print(f"tiny ppo: plan {plan.peak / M.MiB:.0f} MiB, measured {measured / M.MiB:.0f} MiB, "
          f"error {100 * err:+.0f}%")
    assert abs(err) <= 0.30
