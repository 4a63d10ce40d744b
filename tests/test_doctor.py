"""`rlhf doctor` and the memory plan (rlhf_cli.memory): parameter counts against real models, the precision
model (frozen weights in model.dtype, trainable ones in fp32), the sharding arithmetic, lengths from the data,
advice that fits, the real CLI on both recipes, and the tiny plans against measured peak RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from clitools import EVAL_ROWS

from rlhf_cli import memory as M
from rlhf_cli.config import compose
from rlhf_cli.settings import of

QWEN = M.KNOWN_ARCHS["Qwen/Qwen3-0.6B"]
PROBE = Path(__file__).resolve().parent.parent / "bench" / "probes" / "rss_probe.py"


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
    four = {"strategy": "deepspeed", "world": 4, "per_machine": 4}
    z2 = _items(M.plan_stage(cfg, "sft", QWEN, replace(s, zero_stage=2, **four)))
    z3 = _items(M.plan_stage(cfg, "sft", QWEN, replace(s, zero_stage=3, offload_optimizer=True, **four)))
    n = M.causal_lm_params(QWEN)
    assert single["policy weights"].bytes == n * 4  # trainable: fp32 master weights
    assert single["optimizer (policy)"].bytes == n * 8  # fp32 exp_avg + exp_avg_sq
    assert z2["policy weights"].bytes == n * 2  # DeepSpeed runs the module in bf16, ZeRO-2 keeps it whole
    assert z2["gradients (policy)"].bytes == n * 2 / 4
    assert z2["optimizer (policy)"].bytes == n * 12 / 4  # fp32 states + fp32 master, sharded
    assert z3["policy weights"].bytes == n * 2 / 4
    assert z3["optimizer (policy)"].kind == "offloaded"
    ddp = _items(M.plan_stage(cfg, "sft", QWEN, replace(s, strategy="ddp", world=2)))
    assert ddp["DDP buckets (policy)"].bytes == n * 4


def test_full_fine_tune_counts_trainable_weights_as_fp32_even_in_bf16():
    cfg = compose("sft", ["recipe=qwen3-0.6b", "model.dtype=bfloat16"])
    s = M.setup_from(cfg)
    assert (s.frozen_bytes, s.compute_bytes) == (2, 2)
    n = M.causal_lm_params(QWEN)
    sft = _items(M.plan_stage(cfg, "sft", QWEN, s))
    assert sft["policy weights"].bytes == n * 4 and sft["gradients (policy)"].bytes == n * 4
    assert sft["autocast weight copies"].bytes == n * 2  # bf16 casts held for the backward
    reward_cfg = compose("reward", ["recipe=qwen3-0.6b", "model.dtype=bfloat16"])
    reward = _items(M.plan_stage(reward_cfg, "reward", QWEN))
    assert reward["reward model weights"].bytes == M.seq_cls_params(QWEN) * 4
    # with LoRA only the adapter trains: the base stays in model.dtype
    lora = _items(M.plan_stage(compose("sft", ["recipe=qwen3-0.6b", "model.dtype=bfloat16",
                                               "sft.lora.enabled=true"]), "sft", QWEN))
    assert lora["policy base"].bytes == n * 2
    assert lora["LoRA adapter"].bytes == M.lora_params(QWEN, 16, "all-linear") * 4
    # fp32 compute over bf16 frozen weights runs at their dtype (hardware.resolve_precision)
    cpu_bf16 = M.setup_from(compose("ppo", ["model.dtype=bfloat16", "device.mixed_precision=no"]))
    assert (cpu_bf16.frozen_bytes, cpu_bf16.compute_bytes) == (2, 2)
    assert (M.setup_from(compose("ppo")).frozen_bytes, M.setup_from(compose("ppo")).compute_bytes) == (4, 4)


def test_cpu_bf16_without_units_warns_once(monkeypatch, caplog):
    """bf16 compute on a CPU without bf16 units (AVX2 only) runs its matmuls far slower than fp32: one warning
    naming the keys that switch to fp32; none for fp32, none where the CPU has the units."""
    import logging

    import rlhf_cli.hardware as hardware

    cfg = compose("ppo", ["model.dtype=bfloat16"])
    for native, expect in ((True, 0), (None, 0), (False, 1)):
        monkeypatch.setattr(hardware, "cpu_bf16_native", lambda native=native: native)
        monkeypatch.setattr(hardware, "_WARNED", set())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlhf"):
            hardware.resolve_precision(cfg)
            hardware.resolve_precision(cfg)
            hardware.resolve_precision(compose("ppo"))
        hits = [r.message for r in caplog.records if "bf16 units" in r.message]
        assert len(hits) == expect, (native, hits)
    assert "model.dtype=float32 device.mixed_precision=no" in hits[0]
    assert hardware.cpu_bf16_native() in (True, False, None)


def test_activation_formula_matches_saved_tensors():
    """The bytes autograd keeps per token per layer, counted with saved-tensor hooks on the tiny shape (a
    layer's count is the difference between a 3- and a 1-layer model), against the formula; parameters and
    their autocast copies are left out (the plan counts them per parameter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    a = tiny_arch()
    B, T = 4, 48

    def saved_per_token_layer(lora: bool, autocast: bool) -> float:
        def model(layers: int):
            torch.manual_seed(0)
            conf = Qwen3Config(vocab_size=a.vocab_size, hidden_size=a.hidden_size,
                               intermediate_size=a.intermediate_size, num_hidden_layers=layers,
                               num_attention_heads=a.num_attention_heads,
                               num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim,
                               tie_word_embeddings=True, pad_token_id=0)
            m = Qwen3ForCausalLM(conf)
            if lora:
                m = get_peft_model(m.to(torch.bfloat16 if autocast else torch.float32),
                                   LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
                for q in m.parameters():
                    if q.requires_grad:
                        q.data = q.data.float()
            return m

        def saved(m) -> int:
            ids = torch.randint(3, a.vocab_size, (B, T))
            am = torch.ones_like(ids)
            am[0, :7] = 0  # left padding: a real mask, as in every batch
            params = {q.untyped_storage().data_ptr() for q in m.parameters()}
            found = {}

            def pack(t):
                st = t.untyped_storage()
                # parameters, and autocast's 2-d casts of them, are counted per parameter
                weight_cast = t.dim() == 2 and t.shape[0] not in (B * T, B)
                if st.data_ptr() not in params and not weight_cast:
                    found[st.data_ptr()] = st.nbytes()
                return t

            ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
                m(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0),
                  logits_to_keep=1, use_cache=False)
            return sum(found.values())

        return (saved(model(3)) - saved(model(1))) / 2 / (B * T)

    for lora, autocast in ((False, False), (True, False), (True, True), (False, True)):
        cb = 2 if autocast else 4
        kw = {"trainable": not lora, "lora": M.LORA_TARGETS if lora else (), "r": 8 if lora else 0, "seq": T}
        planned = M.activation_bytes_per_token_layer(a, cb, residual_bytes=4 if not lora else cb, **kw)
        assert saved_per_token_layer(lora, autocast) == pytest.approx(planned, rel=0.06), (lora, autocast)


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
    n = M.causal_lm_params(QWEN)
    assert it["reference"].bytes == 0  # LoRA: the adapter disabled is the reference
    assert it["policy base"].bytes == n * 2  # frozen, in model.dtype
    assert it["LoRA adapter"].bytes == M.lora_params(QWEN, 32, "all-linear") * 4
    assert it["value trunk"].bytes == M.seq_cls_params(QWEN) * 2
    assert it["value LoRA + score head"].bytes == (M.lora_params(QWEN, 32, "all-linear") + 1024) * 4
    assert it["reward model weights"].bytes == M.seq_cls_params(QWEN) * 2
    assert it["KV cache"].bytes == 2 * 28 * 8 * 128 * 32 * (256 + 200) * 2
    assert it["sampling step logits"].bytes == 32 * 151936 * (2 + 32)  # one step at a time
    assert set(p.phases) == {"sampling", "scoring", "training step"}
    full = _items(M.plan_stage(compose("ppo", ["recipe=qwen3-0.6b", "ppo.lora.enabled=false"]), "ppo", QWEN))
    assert full["reference weights"].bytes == n * 2
    assert full["policy weights"].bytes == n * 4
    assert p.peak == pytest.approx(p.static + p.slack * p.transient + p.overhead)
    # a checkpoint holds what trains and its AdamW states: the two adapters (+ score head), 12 B per parameter
    assert p.checkpoint == (2 * M.lora_params(QWEN, 32, "all-linear") + 1024) * 12


@pytest.mark.parametrize("overrides,counted", [
    ([], True),                                   # cpu_matmul=auto on an AMD CPU (below)
    (["device.cpu_matmul=onednn"], True),
    (["device.cpu_matmul=blas"], False),
    (["device.fast_paths=off"], False),           # stock code: no oneDNN
    (["device.fast_paths=on"], True),
    (["model.dtype=bfloat16"], False),            # 16-bit weights keep F.linear
    (["device.mixed_precision=bf16"], False),     # autocast keeps F.linear
    (["device=cuda"], False),
])
def test_onednn_caches_are_planned_by_rule(overrides, counted, monkeypatch):
    monkeypatch.setattr(M.ppo_plan, "onednn_by_default", lambda: True)
    cfg = compose("ppo", ["recipe=qwen3-0.6b", "device=cpu", *overrides])
    names = [i.name for i in M.plan_stage(cfg, "ppo", QWEN).items]
    assert ("oneDNN primitive caches" in names) is counted
    # layers under ONEDNN_MIN_DIM wide never switch
    narrow = replace(QWEN, hidden_size=64)
    assert "oneDNN primitive caches" not in [i.name for i in M.plan_stage(cfg, "ppo", narrow).items]
    if not overrides:  # auto on an Intel CPU keeps BLAS: no caches
        monkeypatch.setattr(M.ppo_plan, "onednn_by_default", lambda: False)
        assert "oneDNN primitive caches" not in [i.name for i in M.plan_stage(cfg, "ppo", QWEN).items]


def test_the_planner_imports_no_torch_and_times_nothing():
    """Composing a config and planning every stage (with the advice) in a fresh process loads no torch, and
    memory.py imports nothing of rlhf_cli.ppo or rlhf_cli.accel but the torch-free limits."""
    import ast

    code = ("import sys\n"
            "from rlhf_cli import memory as M\n"
            "from rlhf_cli.config import compose\n"
            "from rlhf_cli.settings import of\n"
            "for recipe, device in (('tiny', 'cpu'), ('qwen3-0.6b', 'cpu'), ('qwen3-0.6b', 'cuda')):\n"
            "    cfg = compose('doctor', [f'recipe={recipe}', f'device={device}'])\n"
            "    a, s = M.arch_for_model(cfg.model)[0], M.setup_from(cfg)\n"
            "    for stage in M.PLANNERS:\n"
            "        M.remedies(of(cfg), stage, a, s, M.plan_stage(cfg, stage, a, s).peak / 4)\n"
            "heavy = sorted(m for m in sys.modules\n"
            "               if m.split('.')[0] in ('torch', 'transformers', 'trl', 'peft'))\n"
            "assert not heavy, heavy\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    mods = set()
    for path in sorted(Path(M.__file__).parent.glob("*.py")):  # the package: every module of the planner
        tree = ast.parse(path.read_text(encoding="utf-8"))
        mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {"rlhf_cli.memory.arch", "rlhf_cli.memory.plan", "rlhf_cli.memory.ppo_plan"} <= mods
    inside = {m for m in mods if m.startswith(("rlhf_cli.ppo", "rlhf_cli.accel"))}
    assert inside <= {"rlhf_cli.accel.limits"}, inside
    assert not {m for m in mods if m.split(".")[0] in ("torch", "time", "timeit")}


def test_sharded_ppo_plan():
    """device=fsdp shards every PPO model and what trains over the processes; sampling holds the whole policy
    gathered, or with device.fsdp.gather_for_sampling=false two layers and the root at a time."""
    cfg = compose("ppo", ["recipe=qwen3-0.6b", "device=fsdp", "device.num_processes=4"])
    s = M.setup_from(cfg)
    plan = M.plan_stage(cfg, "ppo", QWEN, s)
    it, n, c = _items(plan), M.causal_lm_params(QWEN), M.seq_cls_params(QWEN)
    assert it["policy base"].bytes == n * 2 / 4
    assert it["value trunk"].bytes == it["reward model weights"].bytes == c * 2 / 4
    assert it["LoRA adapter"].bytes == M.lora_params(QWEN, 32, "all-linear") * 4 / 4
    assert it["optimizer (LoRA)"].bytes == M.lora_params(QWEN, 32, "all-linear") * 8 / 4
    assert "DDP buckets (LoRA)" not in it and "merged LoRA weights" not in it
    assert it["gathered policy"].bytes == n * 2
    emb = QWEN.vocab_size * QWEN.hidden_size  # tied: one matrix in the root unit
    layer = (n - emb) / QWEN.num_hidden_layers
    assert it["gathered units (training)"].bytes == pytest.approx((2 * layer + emb) * 2)
    layered_cfg = compose("ppo", ["recipe=qwen3-0.6b", "device=fsdp", "device.num_processes=4",
                                  "device.fsdp.gather_for_sampling=false"])
    layered = M.plan_stage(layered_cfg, "ppo", QWEN, M.setup_from(layered_cfg))
    assert "gathered policy" not in _items(layered) and "gathered units (policy, every token)" in _items(layered)
    assert layered.phases["sampling"] < plan.phases["sampling"] - n
    ddp = M.plan_stage(compose("ppo", ["recipe=qwen3-0.6b", "device=ddp", "device.num_processes=4"]), "ppo", QWEN,
                       replace(s, strategy="ddp"))
    assert ddp.static > 3 * plan.static


def test_ppo_activation_checkpointing_and_merged_copies_in_the_plan():
    plain = M.plan_stage(compose("ppo", ["recipe=qwen3-0.6b"]), "ppo", QWEN)
    ck = M.plan_stage(compose("ppo", ["recipe=qwen3-0.6b", "ppo.activation_checkpointing=true"]), "ppo", QWEN)
    for what in ("policy activations", "value activations"):
        assert _items(ck)[what].bytes < _items(plain)[what].bytes / 5
    # stock generate() samples on the adapter unmerged (CUDA, fast_paths auto); the fast loop merges copies
    assert "merged LoRA weights" not in _items(plain)
    tiny_cpu = M.plan_stage(compose("ppo", ["device=cpu"]), "ppo", tiny_arch())
    assert "merged LoRA weights" in _items(tiny_cpu)
    stock = M.plan_stage(compose("ppo", ["device=cpu", "device.fast_paths=off"]), "ppo", tiny_arch())
    assert "merged LoRA weights" not in _items(stock)


@pytest.mark.parametrize("recipe, overrides, stages, gib", [
    ("qwen3-1.7b", [], ("sft", "ppo", "dpo"), 24),                  # one 24 GB GPU
    ("qwen3-1.7b", ["device=fsdp", "device.num_processes=2"], ("reward",), 24),
    ("qwen3-8b", [], ("sft", "ppo", "dpo"), 80),                    # one 80 GB GPU
    ("qwen3-8b", ["device=fsdp", "device.num_processes=8"], ("sft", "reward", "ppo", "dpo"), 80),
    ("qwen3-32b", [], ("sft", "reward", "ppo", "dpo"), 80),         # 8 × 80 GB, FSDP
])
def test_recipes_fit_the_gpus_they_name(recipe, overrides, stages, gib):
    cfg = compose("doctor", [f"recipe={recipe}", *overrides])
    a, s = M.arch_for_model(cfg.model)[0], M.setup_from(cfg)
    for stage in stages:
        peak = M.plan_stage(cfg, stage, a, s).peak
        assert peak <= gib * M.GiB, f"{recipe} {stage}: {peak / M.GiB:.1f} GiB"


def test_qwen3_ppo_fits_one_24gb_gpu_as_shipped():
    cfg = compose("ppo", ["recipe=qwen3-0.6b"])
    assert bool(cfg.ppo.value_lora)
    plan = M.plan_stage(cfg, "ppo", M.arch_for_model(cfg.model)[0], M.setup_from(cfg, 1))
    assert plan.peak <= 22 * M.GiB, f"{plan.peak / M.GiB:.2f} GiB"


def test_full_value_model_plans_more_than_value_lora():
    lora_cfg = compose("ppo", ["recipe=qwen3-0.6b", "ppo.value_lora=true"])
    full_cfg = compose("ppo", ["recipe=qwen3-0.6b", "ppo.value_lora=false"])
    lora, full = M.plan_stage(lora_cfg, "ppo", QWEN), M.plan_stage(full_cfg, "ppo", QWEN)
    assert full.peak > lora.peak + 6 * M.GiB  # fp32 weights, gradients and AdamW states of 596M parameters
    emb = QWEN.vocab_size * QWEN.hidden_size
    items = _items(full)
    # the embedding steps by rows (ppo.sparse_value_embedding): no dense gradient, moments planned for every row
    assert items["value model weights (less the embedding)"].bytes == (M.seq_cls_params(QWEN) - emb) * 4
    assert items["value embedding"].bytes == emb * 4 and "gradients (value embedding)" not in items
    assert full.checkpoint > lora.checkpoint + M.seq_cls_params(QWEN) * 11
    dense = M.plan_stage(compose("ppo", ["recipe=qwen3-0.6b", "ppo.value_lora=false",
                                         "ppo.sparse_value_embedding=false"]), "ppo", QWEN)
    assert _items(dense)["value model weights"].bytes == M.seq_cls_params(QWEN) * 4
    assert dense.peak >= full.peak + emb * 4  # at least the embedding's dense gradient
    tiny_lora = M.plan_stage(compose("ppo", ["ppo.value_lora=true"]), "ppo", tiny_arch())
    tiny_full = M.plan_stage(compose("ppo", ["ppo.value_lora=false"]), "ppo", tiny_arch())
    assert tiny_full.peak > tiny_lora.peak


def test_advice_fits_the_budget():
    cfg = compose("ppo", ["recipe=qwen3-0.6b"])
    s = M.setup_from(cfg)
    budget = 0.75 * M.plan_stage(cfg, "ppo", QWEN, s).peak
    singles, combo = M.remedies(of(cfg), "ppo", QWEN, s, budget)
    advice = singles + ([combo] if combo else [])
    assert advice
    assert all(plan.peak <= budget and label.startswith(("ppo.", "device=")) for label, plan in advice)
    sft_cfg = compose("sft", ["recipe=qwen3-0.6b", "sft.per_device_eval_batch_size=4"])
    singles, _ = M.remedies(of(sft_cfg), "sft", QWEN, M.setup_from(sft_cfg), 14 * M.GiB)
    assert singles and all(p.peak <= 14 * M.GiB for _, p in singles)


# ------------------------------------------------------------------------------------------ lengths from data
def test_plan_uses_the_prompt_length_of_the_data_and_says_so(tmp_path):
    from rlhf_cli.stages.doctor import data_lengths

    cfg = compose("ppo", [f"run_dir={tmp_path}"])
    lengths = data_lengths(cfg)  # the tiny base (tokenizer) is built locally, nothing downloaded
    cap = int(cfg.data.max_prompt_length)
    assert lengths.prompt is not None and 10 < lengths.prompt < cap
    assert lengths.sft >= lengths.prompt and lengths.reward >= lengths.prompt
    assert "longest" in lengths.source and str(lengths.prompt) in lengths.source
    s = M.setup_from(cfg, 0, lengths)
    plan = M.plan_stage(cfg, "ppo", tiny_arch(), s)
    seq = lengths.prompt + int(cfg.ppo.response_length)
    a = tiny_arch()
    assert _items(plan)["KV cache"].bytes == 2 * a.num_hidden_layers * a.kv_dim * 32 * seq * 4
    assert any(f"prompt {lengths.prompt} (the data's longest prompt" in n for n in plan.notes)
    # without data the configured maximum, and the plan says that instead
    assert M.plan_stage(cfg, "ppo", a).peak > plan.peak
    assert any(f"data.max_prompt_length={cap}" in n for n in M.plan_stage(cfg, "ppo", a).notes)
    sft = M.plan_stage(compose("sft", [f"run_dir={tmp_path}"]), "sft", a, s)
    assert any(f"sequence length {lengths.sft} tokens: the data's longest row" in n for n in sft.notes)


def test_data_lengths_never_download(tmp_path):
    from rlhf_cli.stages.doctor import data_lengths

    unknown = compose("ppo", [f"run_dir={tmp_path}", "model.name_or_path=acme/unknown-7b",
                              f"model.cache_dir={tmp_path / 'cache'}"])
    got = data_lengths(unknown)
    assert got.prompt is None and "downloads nothing" in got.source
    hub_data = compose("ppo", [f"run_dir={tmp_path}", "data.train_path=acme/some-dataset",
                               "data.eval_path=null"])
    got = data_lengths(hub_data)
    assert got.prompt is None and "not a local file" in got.source
    assert data_lengths(compose("ppo", ["recipe=qwen3-0.6b"])).source.startswith("no data")


# -------------------------------------------------------------------------------------------- the real CLI
def test_doctor_tiny(run_cli):
    rc, out, err = run_cli("doctor", timeout=600)  # a safety net: the hub checks give up after 2 s on a closed network
    assert rc == 0, err
    for needle in ("versions", "torch ", "transformers ", "trl ", "peft ", "accelerate ", "CUDA", "RAM",
                   "ModelScope:", "Hugging Face hub:", "bf16 units", "memory plan per process", "peak per process",
                   "KV cache", "sampling step logits", "-> fits", "precision: frozen weights in float32",
                   "sequence lengths: 3000 training prompts", "The plan takes the longest",
                   "the data's longest prompt", "checkpoint on disk", "PPO's fp32 linear layers run on"):
        assert needle in out, needle
    assert out.count("peak per process") == 4  # sft, reward, ppo, dpo


def test_doctor_qwen_recipe_offline(run_cli):
    rc, out, err = run_cli("doctor", "recipe=qwen3-0.6b", "doctor.memory_gib=16", timeout=600)
    assert rc == 0, err
    assert "built-in table" in out and "596.0M parameters" in out
    assert "precision: frozen weights in bfloat16 (model.dtype), compute bf16" in out
    assert "sequence lengths: the configured maxima (no data: data.train_path is not set)" in out
    assert "prompt 256 (data.max_prompt_length=256)" in out
    assert "DOES NOT FIT" in out and "to fit" in out  # ppo on 16 GiB needs changes, and says which
    rc, out, err = run_cli("doctor", "recipe=qwen3-0.6b", "device=zero3", "device.num_processes=4",
                           timeout=600)
    assert rc == 0, err
    assert "ZeRO-3" in out and "ppo runs under ddp or fsdp, not DeepSpeed" in out


def test_the_slack_covers_the_training_loop_and_an_evaluation_adds_its_excess_once():
    """Peak = static + slack × the loop's largest phase + what an evaluation needs beyond it + overhead (MiB):
    5 + 2 × 10 + (30 - 10) + 1 = 46; an evaluation within the loop's phases adds nothing: 5 + 2 × 10 + 1 = 26."""
    from rlhf_cli.memory.plan import Item, StagePlan

    def plan(evaluation: float) -> StagePlan:
        return StagePlan("ppo", items=[Item("weights", 5 * M.MiB, "", "static")], overhead=1 * M.MiB, slack=2.0,
                         phases={"sampling": 4 * M.MiB, "scoring": 10 * M.MiB, "evaluation": evaluation * M.MiB})

    assert plan(30).peak == 46 * M.MiB and plan(30).tensors == 35 * M.MiB
    assert plan(8).peak == 26 * M.MiB


# ------------------------------------------------------------------------- plan against measured peak RSS
@pytest.mark.slow
def test_tiny_plans_within_20_percent_of_measured_rss(tmp_path):
    """Peak growth of the anonymous resident memory of `rlhf sft`, `rlhf reward` and `rlhf ppo` (tiny recipe, each
    run in a process of its own, after its imports) against each stage's plan, with the lengths the doctor reads
    from the data. The same run reaches peaks up to ~20% apart (glibc keeps or returns freed blocks depending on
    timing), so each stage runs twice and its peak is the higher one. PPO runs with device.fast_paths=off: the
    doctor plans the stock forward (what GPUs run); the CPU speed paths pick kernels by what the CPU has, and their
    memory differs by CPU (tiny PPO on two AMD EPYC generations: 99 and 170 MiB), which the benchmarks measure.
    Each run's process is forked from one probe process that has done the imports once (the probe's --fork): it
    starts where a new process stands after them, and the 8 runs skip 7 interpreters' imports."""
    from rlhf_cli.stages.doctor import data_lengths

    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MALLOC_MMAP_THRESHOLD_"):
        env.pop(k, None)
    common = [f"run_dir={tmp_path / 'run'}", "device.threads=1"]
    stages = (("sft", ["sft.max_steps=5", "sft.eval_steps=100", EVAL_ROWS]),
              ("reward", ["reward.max_steps=5", "reward.eval_steps=100", EVAL_ROWS]),
              ("ppo", ["ppo.total_episodes=128", "ppo.eval_every=0", "device.fast_paths=off"]),
              # one evaluation chunk (eval.batch_size 64) of held-out prompts: the plan's evaluation item
              ("ppo+eval", ["ppo.total_episodes=128", "ppo.eval_every=16", "eval.num_prompts=64",
                            "device.fast_paths=off"]))
    runs = [[stage.split("+")[0], *common, *ov] for stage, ov in stages for _ in range(2)]
    (tmp_path / "runs.json").write_text(json.dumps(runs), encoding="utf-8")
    p = subprocess.run([sys.executable, str(PROBE), "--fork", str(tmp_path / "runs.json")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    results = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith('{"command": ')]
    assert [r["command"] for r in results] == [run[0] for run in runs], p.stdout[-2000:]
    report = []
    for i, (stage, ov) in enumerate(stages):
        command = stage.split("+")[0]
        # anonymous memory: library file pages resident or not depend on the page cache (a fresh clone's
        # environment maps more of each .so), not on the run
        measured = max(r["anon_growth_mib"] for r in results[2 * i:2 * i + 2]) * M.MiB
        cfg = compose(command, [*common, *ov])
        s = M.setup_from(cfg, 0, data_lengths(cfg))
        plan = M.plan_stage(cfg, command, M.arch_for_model(cfg.model)[0], s)
        err = (plan.peak - measured) / measured
        report.append((stage, plan.peak / M.MiB, measured / M.MiB, err))
    print("; ".join(f"tiny {s}: plan {pl:.0f} MiB, measured {me:.0f} MiB, error {100 * e:+.0f}%"
                    for s, pl, me, e in report))
    assert all(abs(e) <= 0.20 for *_, e in report), report


@pytest.mark.parametrize("overrides,by_rule,says", [
    ([], True, "oneDNN (device.cpu_matmul=auto: oneDNN on AMD family 26 and later)"),
    ([], False, "torch's BLAS (device.cpu_matmul=auto: oneDNN on AMD family 26 and later; device.cpu_matmul=onednn "
                "tries it)"),
    (["device.cpu_matmul=onednn"], False, "oneDNN (device.cpu_matmul=onednn), layers at least 128 wide"),
    (["device.cpu_matmul=blas"], True, "torch's BLAS (device.cpu_matmul=blas)"),
    (["device.fast_paths=off"], True, "torch's BLAS (device.fast_paths=off)"),
])
def test_the_doctor_names_the_cpu_matmul_kernels_and_why(overrides, by_rule, says, monkeypatch):
    from rlhf_cli.stages import doctor

    monkeypatch.setattr(doctor, "onednn_by_default", lambda: by_rule)
    assert doctor.cpu_matmul_kernel(compose("ppo", overrides)) == says


def test_qwen3_sampling_plan_holds_one_steps_logits_per_sequence():
    """The generate engine scores each step as it is sampled (ppo.sampling.StepStats): the plan's sampling phase
    is the KV cache plus one step's logits and their fp32 temporaries, far below the (F, R, V) fp32 stack
    generate()'s output_logits kept (32 × 200 × 151,936 × 4 B = 3.6 GiB)."""
    cfg = compose("ppo", ["recipe=qwen3-0.6b"])
    plan = M.plan_stage(cfg, "ppo", M.arch_for_model(cfg.model)[0], M.setup_from(cfg, 1))
    f, r, v = int(cfg.ppo.rollout_forward_batch_size), int(cfg.ppo.response_length), QWEN.vocab_size
    assert _items(plan)["sampling step logits"].bytes == f * v * (2 + 32)
    items = _items(plan)
    parts = ("KV cache", "sampling step logits", "prompt forward (one layer)", "autocast copies (sampling)")
    assert plan.phases["sampling"] == sum(items[k].bytes for k in parts)
    assert items["sampling step logits"].bytes < f * r * v * 4 / 20
    # the policy's LoRA (r 32, every decoder linear) cast to bf16 by autocast, and one layer over the prompts
    assert items["autocast copies (sampling)"].bytes == M.lora_params(QWEN, 32, "all-linear") * 2
    assert items["prompt forward (one layer)"].bytes == f * 256 * M.layer_working_bytes(QWEN, 2)
