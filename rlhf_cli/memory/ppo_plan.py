"""PPO's memory plan: its models' weights, the rollout's sampling and scoring, the training step and the
evaluation during training."""

from __future__ import annotations

from dataclasses import replace

from rlhf_cli.accel.limits import (
    CPU_MERGE_MAX_BYTES,
    ONEDNN_CACHE_BYTES,
    ONEDNN_CACHE_CAPACITY,
    ONEDNN_MIN_DIM,
    enabled,
    onednn_by_default,
)
from rlhf_cli.choices import REWARD_MODEL
from rlhf_cli.memory.arch import (
    Arch,
    MiB,
    activations,
    adapted_weight_params,
    causal_lm_params,
    layer_working_bytes,
    logit_temporaries,
    lora_params,
    lora_targets,
    seq_cls_params,
)
from rlhf_cli.memory.plan import (
    STOCK_RUNTIME_MIB,
    Item,
    Setup,
    StagePlan,
    add_frozen,
    add_trainable,
    casts_trainable,
    prompt_tokens,
)


def recomputes_logprobs(run, s: Setup) -> bool:
    """ppo.recompute_logprobs: auto recomputes the old log-probs when compute is not fp32."""
    v = str(run.ppo.recompute_logprobs).lower()
    return v == "true" or (v == "auto" and s.compute_bytes < 4)


def _ppo_weights(plan: StagePlan, p, a: Arch, ps: Setup) -> float:
    """The models of a PPO run (policy + reference, value model for gae, reward model when `ppo.reward` uses
    it), their gradients and optimizer states; returns the bytes of the autocast copies of what trains."""
    pl, pc = causal_lm_params(a), seq_cls_params(a)
    targets, r = lora_targets(p.lora.target_modules), int(p.lora.r)
    value_targets = tuple(t for t in targets if t != "lm_head")  # a value model has no LM head
    copies = 0.0
    if bool(p.lora.enabled):
        add_frozen(plan, ps, "policy base", pl, sharded=True, a=a)
        plan.items.append(Item("reference", 0, "the policy base with its adapter disabled"))
        n_policy = lora_params(a, r, targets)
        copies += add_trainable(plan, ps, "LoRA adapter", n_policy, "LoRA")
    else:
        n_policy = pl
        copies += add_trainable(plan, ps, "policy weights", pl, "policy")
        add_frozen(plan, ps, "reference weights", pl, sharded=True)
    n_value = 0
    if str(p.advantage) != "gae":
        plan.items.append(Item("value model", 0, f"none: ppo.advantage={p.advantage} needs no critic"))
    elif bool(p.value_lora):
        add_frozen(plan, ps, "value trunk", pc, sharded=True, a=a)
        n_value = lora_params(a, r, value_targets) + a.hidden_size
        copies += add_trainable(plan, ps, "value LoRA + score head", n_value, "value LoRA")
    elif bool(p.sparse_value_embedding) and ps.world == 1 and not float(p.weight_decay):
        # the embedding steps through the rows tokens reach (rlhf_cli/accel/sparse_rows.py): no dense gradient; its
        # moments grow with the distinct tokens seen, planned here for every row (a long run's upper bound)
        n_value, emb = pc, a.vocab_size * a.hidden_size
        copies += add_trainable(plan, ps, "value model weights (less the embedding)", pc - emb, "value model")
        plan.items.append(Item("value embedding", emb * 4, f"{emb / 1e6:.2f}M × 4 B (fp32, stepped by rows)"))
        plan.items.append(Item("optimizer (value embedding rows)", emb * 8,
                               "AdamW moments of the rows seen, 8 B/param; at most every row"))
    else:
        n_value = pc
        copies += add_trainable(plan, ps, "value model weights", pc, "value model")
    sources = p.reward
    if REWARD_MODEL in ([sources] if isinstance(sources, str) else list(sources)):
        add_frozen(plan, ps, "reward model weights", pc, sharded=True, a=a)
    # what a checkpoint holds: the trainable weights (fp32) and their AdamW states, plus counters and RNG
    plan.checkpoint = (n_policy + n_value) * (4 + 8)
    return copies


def _onednn_caches(run, a: Arch, s: Setup) -> bool:
    """Whether PPO's linear layers run on oneDNN here (rlhf_cli.accel.cpu_linear): on the CPU, device.fast_paths
    not off, device.cpu_matmul onednn (or auto on a CPU onednn_by_default names), fp32 weights and compute, layers
    at least ONEDNN_MIN_DIM wide."""
    d = run.device
    matmul = str(d.cpu_matmul)
    return (s.accelerator == "cpu" and str(d.fast_paths) != "off" and not s.quantization
            and (matmul == "onednn" or (matmul == "auto" and onednn_by_default()))
            and s.compute_name == "fp32" and s.frozen_bytes == 4 and a.hidden_size >= ONEDNN_MIN_DIM)


def _sharded_units(plan: StagePlan, a: Arch, ps: Setup, params: float, what: str) -> float:
    """Under FSDP, the weights a forward holds gathered besides its shards: the decoder layer running and the
    next one (prefetched), and one vocabulary matrix (the embedding, or an untied output layer: units of their
    own, rlhf_cli.ppo.shard), all in model.dtype; 0 unsharded."""
    if ps.strategy != "fsdp" or ps.world <= 1:
        return 0.0
    matrix = a.vocab_size * a.hidden_size
    layer = (params - matrix * (1 if a.tie_word_embeddings else 2)) / a.num_hidden_layers
    nbytes = (2 * layer + matrix) * ps.frozen_bytes
    plan.items.append(Item(f"gathered units ({what})", nbytes, f"2 decoder layers + a vocabulary matrix × "
                           f"{ps.frozen_bytes} B, all-gathered for one forward", "transient"))
    return nbytes


def _ppo_sampling(plan: StagePlan, run, a: Arch, ps: Setup, f: int, prompt: int, seq: int, adapted: tuple | None,
                  copies: float = 0.0) -> None:
    """Rollout, step 1: sampling `f` sequences of `seq` tokens (`prompt` of them the prompt's) with a KV cache
    (adapted: the LoRA policy's adapted layers, None without LoRA; copies: the policy's trainable weights cast to
    the compute dtype, which autocast keeps for the rollout). Sharded, the policy is gathered whole for the phase
    (`device.fsdp.gather_for_sampling`, rlhf_cli.ppo.shard.gathered) or layer by layer at every token."""
    cb, wb, V, L = ps.compute_bytes, ps.frozen_bytes, a.vocab_size, a.num_hidden_layers
    kv = 2 * L * a.kv_dim * f * seq * cb
    step_logits = f * V * (cb + 32)
    prefill = f * prompt * layer_working_bytes(a, cb)
    plan.items.append(Item("KV cache", kv, f"2·{L} layers·{a.kv_dim}·{f} seqs·{seq} tokens × {cb} B",
                           "transient"))
    plan.items.append(Item("sampling step logits", step_logits, f"{f}·{V} × ({cb} + 32) B: one step's "
                           "logits and their fp32 log-prob / entropy temporaries (no engine keeps earlier steps')",
                           "transient"))
    plan.items.append(Item("prompt forward (one layer)", prefill, f"{f}·{prompt} prompt tokens through one decoder "
                           "layer at a time", "transient"))
    if copies:
        plan.items.append(Item("autocast copies (sampling)", copies, f"the policy's trainable weights × {cb} B, "
                               "kept by autocast for the rollout", "transient"))
    merged = gathered = 0.0
    sharded = ps.strategy == "fsdp" and ps.world > 1
    if sharded and gathers_for_sampling(run):
        gathered = causal_lm_params(a) * wb
        plan.items.append(Item("gathered policy", gathered, f"the whole policy × {wb} B, all-gathered once for "
                               "the phase (device.fsdp.gather_for_sampling)", "transient"))
    elif sharded:
        gathered = _sharded_units(plan, a, ps, causal_lm_params(a), "policy, every token")
    elif adapted is not None and fast_paths_on(run, ps):
        # the fast sampling loop (rlhf_cli.accel) samples on the LoRA merged into a copy of each adapted weight,
        # except on a CPU with adapted weights over CPU_MERGE_MAX_BYTES; stock generate() runs unmerged
        merged = adapted_weight_params(a, adapted) * wb
        if ps.accelerator == "cpu" and merged > CPU_MERGE_MAX_BYTES:
            merged = 0.0
        else:
            plan.items.append(Item("merged LoRA weights", merged,
                                   f"W + B·A copies of the adapted weights × {wb} B", "transient"))
    plan.phases["sampling"] = kv + step_logits + prefill + copies + merged + gathered


def _policy_copies(p, a: Arch, ps: Setup) -> float:
    """Bytes of the policy's trainable weights cast to the compute dtype under autocast (0 where nothing casts)."""
    if not casts_trainable(ps):
        return 0.0
    n = lora_params(a, int(p.lora.r), lora_targets(p.lora.target_modules)) if bool(p.lora.enabled) \
        else causal_lm_params(a)
    return n * ps.compute_bytes


def gathers_for_sampling(run) -> bool:
    """device.fsdp.gather_for_sampling; true where the settings hold no value (a config without the key)."""
    fsdp = run.device.get("fsdp") or {}
    value = fsdp.get("gather_for_sampling")
    return True if value is None else bool(value)


def fast_paths_on(run, s: Setup) -> bool:
    """Whether rlhf_cli.accel's speed paths run (device.fast_paths on this accelerator; never sharded)."""
    sharded = s.strategy == "fsdp" and s.world > 1
    checkpointed = bool(run.ppo.get("activation_checkpointing", False))  # rlhf_cli.accel.configure turns them off
    return not (sharded or checkpointed or s.quantization) and enabled(str(run.device.get("fast_paths") or "auto"), s.accelerator)


def _ppo_scoring(plan: StagePlan, run, a: Arch, ps: Setup, f: int, seq: int, resp: int) -> None:
    """Rollout, step 2: scoring (reference / recomputed log-probs, values, reward), no gradients."""
    cb, V = ps.compute_bytes, a.vocab_size
    recompute = recomputes_logprobs(run, ps)
    frv = f * resp * V
    extra = logit_temporaries(cb) if recompute else 8
    one_layer = f * seq * layer_working_bytes(a, cb)
    scored = "recomputed log-probs with their entropy" if recompute else "reference log-probs"
    if recompute and cb < 4:
        # low-precision logits: log-probs and entropy are taken one row at a time (ppo.core), so the float32
        # temporaries cover one (R, V) row, not the chunk
        score = frv * cb + resp * V * extra
        what = f"{f}·{resp}·{V} × {cb} B + one row's {resp}·{V} × {extra} B: {scored}"
    else:
        score = frv * (cb + extra)
        what = f"{f}·{resp}·{V} × ({cb} + {extra}) B: {scored}"
    plan.items.append(Item("scoring logits", score, what + "; or one layer's working set, the larger", "transient"))
    # a scoring forward peaks inside a decoder layer or at the head: the logits exist once every layer is done
    plan.phases["scoring"] = max(score, one_layer) + _sharded_units(plan, a, ps, causal_lm_params(a), "scoring")


def _ppo_training(plan: StagePlan, p, a: Arch, ps: Setup, seq: int, copies: float) -> None:
    """Step 5, a training micro-batch: the policy's forward, log-softmax and backward, then the value model's
    (PPOTrainer.micro_batch_step): the two sets of activations are never alive together."""
    cb, wb, V, L = ps.compute_bytes, ps.frozen_bytes, a.vocab_size, a.num_hidden_layers
    b, resp = int(p.per_device_train_batch_size), int(p.response_length)
    targets, r = lora_targets(p.lora.target_modules), int(p.lora.r)
    value_targets = tuple(t for t in targets if t != "lm_head")  # a value model has no LM head
    lora, value_lora, cast = bool(p.lora.enabled), bool(p.value_lora), casts_trainable(ps)
    ck = bool(p.get("activation_checkpointing", False))
    held = f"micro-batch {b} × {seq} tokens × {L} layers" + (", checkpointed: each layer's input, one layer's "
                                                              "activations" if ck else "")
    act_p = activations(a, b, seq, cb, checkpointing=ck, trainable=not lora, lora=targets if lora else (), r=r,
                         cast=cast, residual_bytes=wb if lora else 4)
    plan.items.append(Item("policy activations", act_p, held, "transient"))
    act_v = 0.0
    if str(p.advantage) == "gae":
        act_v = activations(a, b, seq, cb, checkpointing=ck, trainable=not value_lora,
                             lora=value_targets if value_lora else (), r=r, cast=cast,
                             residual_bytes=wb if value_lora else 4)
        plan.items.append(Item("value activations", act_v, held, "transient"))
    per_logit = cb + logit_temporaries(cb)
    logits = b * resp * V * per_logit
    plan.items.append(Item("policy logits", logits, f"{b}·{resp}·{V} × ({cb} + {per_logit - cb}) B: logits, "
                           "fp32 log-softmax and entropy temporaries", "transient"))
    if copies:
        plan.items.append(Item("autocast weight copies", copies, f"trainable weights × {cb} B for a step",
                               "transient"))
    units = _sharded_units(plan, a, ps, causal_lm_params(a), "training")
    plan.phases["training step"] = copies + max(act_p + logits, act_v) + units


def ppo_setup(s: Setup) -> Setup:
    """The setup PPO runs under: FSDP2 shards (several processes, device.strategy=fsdp, nothing offloaded), else
    whole models (one process, or DDP replicas: DeepSpeed is planned as the ddp run it would be)."""
    sharded = s.strategy == "fsdp" and s.world > 1
    return replace(s, strategy="fsdp" if sharded else "ddp" if s.world > 1 else "single", zero_stage=0,
                   offload_optimizer=False, offload_params=False)


def plan_ppo(run, a: Arch, s: Setup) -> StagePlan:
    p = run.ppo
    plan = StagePlan("ppo")
    ps = ppo_setup(s)
    copies = _ppo_weights(plan, p, a, ps)
    if _onednn_caches(run, a, ps):
        plan.items.append(Item("oneDNN primitive caches", ONEDNN_CACHE_BYTES,
                               f"{ONEDNN_CACHE_CAPACITY} compiled products × 2 caches (device.cpu_matmul)"))
    if not fast_paths_on(run, ps):
        plan.items.append(Item("stock code runtime", STOCK_RUNTIME_MIB * MiB, "generate()'s code and caches, "
                               "allocated at its first call, and the stock forwards' resident free blocks"))
    b, resp = int(p.per_device_train_batch_size), int(p.response_length)
    prompt, prompt_note = prompt_tokens(run, s)
    seq = prompt + resp
    plan.notes.append(f"sequence length {seq} tokens: prompt {prompt} ({prompt_note}) + response {resp} "
                      "(ppo.response_length)")
    local_batch = b * int(p.gradient_accumulation_steps) * int(p.num_mini_batches)
    f = min(int(p.rollout_forward_batch_size), local_batch)
    buffer = local_batch * (seq * 8 * 3 + resp * (8 + 4 * 6))
    plan.items.append(Item("rollout buffer", buffer, f"{local_batch} episodes × {seq} tokens (ids, masks, "
                           "log-probs, values, rewards)"))
    adapted = lora_targets(p.lora.target_modules) if bool(p.lora.enabled) else None
    _ppo_sampling(plan, run, a, ps, f, prompt, seq, adapted, _policy_copies(p, a, ps))
    _ppo_scoring(plan, run, a, ps, f, seq, resp)
    _ppo_training(plan, p, a, ps, seq, copies)
    if int(p.get("eval_every", 0) or 0) > 0:
        _ppo_evaluation(plan, run, a, ps, prompt, adapted)
    return plan


def _ppo_evaluation(plan: StagePlan, run, a: Arch, ps: Setup, prompt: int, adapted: tuple | None) -> None:
    """ppo.eval_every: held-out prompts sampled and scored in chunks of eval.batch_size (rlhf_cli.ppo.evaluation),
    each process taking its share of eval.num_prompts; the same two steps as a rollout at that chunk size."""
    e = run.eval
    f = max(1, min(int(e.batch_size), -(-int(e.num_prompts) // max(ps.world, 1))))
    resp = int(e.response_length)
    sub = StagePlan("ppo")
    _ppo_sampling(sub, run, a, ps, f, prompt, prompt + resp, adapted, _policy_copies(run.ppo, a, ps))
    _ppo_scoring(sub, run, a, ps, f, prompt + resp, resp)
    total = max(sub.phases.values())
    plan.items.append(Item("evaluation (ppo.eval_every)", total, f"sampling and scoring {f} held-out prompts at a "
                           f"time (eval.batch_size) × {prompt + resp} tokens", "transient"))
    plan.phases["evaluation"] = total
