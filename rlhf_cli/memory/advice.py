"""The plan of every training stage (`plan_stage`), what to change when one does not fit (`remedies`), and the
plan as text."""

from __future__ import annotations

from dataclasses import replace

from rlhf_cli import quantization, settings
from rlhf_cli.memory.arch import Arch, GiB, MiB
from rlhf_cli.memory.plan import (
    ALLOCATOR_SLACK,
    RUNTIME_OVERHEAD_MIB,
    Setup,
    StagePlan,
    plan_dpo,
    plan_reward,
    plan_sft,
    setup_from,
)
from rlhf_cli.memory.ppo_plan import gathers_for_sampling, plan_ppo

PLANNERS = {"sft": plan_sft, "reward": plan_reward, "ppo": plan_ppo, "dpo": plan_dpo}  # each training stage (test)


def plan_stage(run, stage: str, a: Arch, s: Setup | None = None) -> StagePlan:
    """The memory plan of `stage` (`run`: the run's settings, rlhf_cli.settings.of) under `s` (default: the
    setup `run` describes)."""
    s = s or setup_from(run)
    plan = PLANNERS[stage](run, a, s)
    kind = "cuda" if s.accelerator == "cuda" else "cpu"
    plan.overhead = RUNTIME_OVERHEAD_MIB[kind][stage] * MiB
    plan.slack = ALLOCATOR_SLACK[kind]
    key = quantization.LORA_KEYS.get(stage)
    if s.quantization and key and not bool(run[stage].lora.enabled):
        plan.notes.append(f"planned unquantized: {stage} refuses model.quantization={s.quantization} with "
                          f"{key}=false (set it true for QLoRA)")
    return plan


def _changes(run, stage: str, s: Setup) -> list[tuple[dict, dict]]:
    """Single changes that can lower a stage's peak: ({config key: value}, {Setup field: value})."""
    st = run[stage]
    out: list[tuple[dict, dict]] = []
    b = int(st.per_device_train_batch_size)
    if b > 1:  # half the micro-batch, twice the accumulation: the same batch per optimizer step
        out.append(({f"{stage}.per_device_train_batch_size": b // 2,
                     f"{stage}.gradient_accumulation_steps": int(st.gradient_accumulation_steps) * 2}, {}))
    if stage == "sft" and int(st.per_device_eval_batch_size) > 1:
        out.append(({"sft.per_device_eval_batch_size": max(int(st.per_device_eval_batch_size) // 2, 1)}, {}))
    if stage in ("sft", "reward", "dpo"):
        if not bool(st.activation_checkpointing):
            out.append(({f"{stage}.activation_checkpointing": True}, {}))
        if s.accelerator == "cuda":
            n = max(s.per_machine, 2)
            many = {"world": n * max(s.world // max(s.per_machine, 1), 1), "per_machine": n}
            for kw in ({"strategy": "deepspeed", "zero_stage": 2}, {"strategy": "deepspeed", "zero_stage": 3},
                       {"strategy": "fsdp", "zero_stage": 0}):
                if (s.strategy, s.zero_stage) != (kw["strategy"], kw["zero_stage"]):
                    out.append(({}, {**many, **kw}))
            offloaded = s.offload_optimizer and s.offload_params
            if s.strategy == "deepspeed" and s.zero_stage == 3 and not offloaded:
                out.append(({}, {"offload_optimizer": True, "offload_params": True}))
    if stage == "ppo":
        f = int(st.rollout_forward_batch_size)
        if f > 1:
            out.append(({"ppo.rollout_forward_batch_size": f // 2}, {}))
        if not bool(st.value_lora):
            out.append(({"ppo.value_lora": True}, {}))
        if not bool(st.get("activation_checkpointing", False)):
            out.append(({"ppo.activation_checkpointing": True}, {}))
        sharded = s.strategy == "fsdp" and s.world > 1
        if sharded and gathers_for_sampling(run):
            out.append(({"device.fsdp.gather_for_sampling": False}, {}))
        if s.accelerator == "cuda" and not sharded:
            n = max(s.per_machine, 8)
            out.append(({}, {"strategy": "fsdp", "zero_stage": 0, "per_machine": n,
                             "world": n * max(s.world // max(s.per_machine, 1), 1)}))
    return out


def _apply(run, s: Setup, keys: dict, fields: dict):
    """The run's settings with `keys` ({dotted key: value}) changed, and the setup with `fields` changed."""
    return (settings.with_values(run, keys) if keys else run), (replace(s, **fields) if fields else s)


def _device_label(s: Setup) -> list[str]:
    name = {"deepspeed": f"zero{s.zero_stage}", "fsdp": "fsdp", "ddp": "ddp"}.get(s.strategy, "cuda")
    out = [f"device={name}", f"device.num_processes={s.per_machine}"]
    if s.offload_optimizer:
        out.append("device.offload_optimizer=true")
    if s.offload_params:
        out.append("device.offload_params=true")
    return out


def remedies(run, stage: str, a: Arch, s: Setup, budget: float) -> tuple[list[tuple[str, StagePlan]],
                                                                           tuple[str, StagePlan] | None]:
    """(single changes whose plan fits `budget`, else a greedy combination that fits - or None); `run`: the run's
    settings (rlhf_cli.settings.of), which each change copies with its keys set (settings.with_values)."""
    singles = []
    for keys, fields in _changes(run, stage, s):
        c, s2 = _apply(run, s, keys, fields)
        p = plan_stage(c, stage, a, s2)
        if p.peak <= budget:
            label = " ".join([f"{k}={str(v).lower()}" for k, v in keys.items()]
                             + (_device_label(s2) if fields else []))
            singles.append((label, p))
    if singles:
        return sorted(singles, key=lambda x: x[1].peak, reverse=True), None
    c, s2, chosen = run, s, {}
    current = plan_stage(c, stage, a, s2).peak
    for _ in range(12):
        options = []
        for keys, fields in _changes(c, stage, s2):
            c3, s3 = _apply(c, s2, keys, fields)
            options.append((plan_stage(c3, stage, a, s3).peak, keys, c3, s3))
        if not options:
            break
        peak, keys, c3, s3 = min(options, key=lambda o: o[0])
        if peak >= current:
            break
        c, s2, current = c3, s3, peak
        chosen.update(keys)
        if current <= budget:
            label = " ".join([f"{k}={str(v).lower()}" for k, v in chosen.items()]
                             + (_device_label(s2) if s2 != s else []))
            return [], (label, plan_stage(c, stage, a, s2))
    return [], None


def fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n else "0"


def format_plan(plan: StagePlan) -> list[str]:
    lines = [f"  {plan.stage}"]
    lines += [f"    {note}" for note in plan.notes]
    for it in plan.items:
        tag = {"transient": " (peak of a phase)", "offloaded": " (CPU memory)"}.get(it.kind, "")
        lines.append(f"    {it.name:<28}{fmt_bytes(it.bytes):>12}  {it.note}{tag}")
    phase = max(plan.phases, key=plan.phases.get) if plan.phases else "-"
    if len(plan.phases) > 1:
        lines.append(f"    {'phases':<28}{'':>12}  "
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in plan.phases.items()))
    lines.append(f"    {'tensors at peak':<28}{fmt_bytes(plan.tensors):>12}  static "
                 f"{fmt_bytes(plan.static)} + {phase} {fmt_bytes(plan.transient)}")
    lines.append(f"    {'runtime overhead':<28}{fmt_bytes(plan.peak - plan.tensors):>12}  "
                 f"{fmt_bytes(plan.overhead)} runtime constant + allocator slack ×{plan.slack:g} on the "
                 f"training loop's transient part{'' if plan.loop >= plan.transient else ', evaluation its excess'}")
    lines.append(f"    {'peak per process':<28}{fmt_bytes(plan.peak):>12}")
    if plan.checkpoint:
        lines.append(f"    {'checkpoint on disk':<28}{fmt_bytes(plan.checkpoint):>12}  what trains (fp32) "
                     "and its AdamW states, counters, RNG")
    return lines
