"""Device settings of multi-process runs: `rlhf <stage> device=ddp|cpu-ddp|zero2|zero3|fsdp` starts itself
again under `accelerate launch`, one process per GPU (or CPU slot), each running `python -m rlhf_cli.cli
<stage> <same overrides>`. The started processes see the launcher's LOCAL_RANK / WORLD_SIZE and run the stage
instead of launching again. This module says what each strategy needs (checks, accelerate / DeepSpeed / FSDP
settings, the launch line); `rlhf_cli.supervise` starts the launch and watches it.

    strategy   launch                                              sft / reward (trl)          ppo
    ddp        accelerate launch --multi_gpu --num_processes N     DDP                          DDP
    deepspeed  accelerate launch --config_file <generated yaml>    TrainingArguments.deepspeed  refused
    fsdp       accelerate launch --config_file <generated yaml>    TrainingArguments.fsdp       FSDP2 (*)

(*) ppo shards its models itself (`rlhf_cli.ppo.shard`): it is launched like ddp, and accelerate only starts
the processes and their process group.

Collectives give up after `device.collective_timeout_s`, so a process whose peer is gone ends with an error
instead of waiting.

Kept import-light: torch is imported only to count GPUs for `device.num_processes=auto`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from rlhf_cli.choices import STRATEGIES  # device.strategy's values
from rlhf_cli.errors import RlhfError
from rlhf_cli.stage_table import TRAIN_STAGES as TRAIN_COMMANDS  # the commands launched over processes

# torchrun and accelerate launch set these in every process they start (never in the process that launches)
LAUNCHED_ENV = ("LOCAL_RANK", "WORLD_SIZE")
# overrides the dispatcher adds itself (cli.translate_overrides); the relaunched command adds them again
_INJECTED = ("hydra.searchpath=", "command=")
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800


def is_launched() -> bool:
    """True inside a process started by torchrun / accelerate launch."""
    return any(k in os.environ for k in LAUNCHED_ENV)


def strategy(device) -> str:
    s = str(device.get("strategy") or "single")
    if s not in STRATEGIES:
        raise RlhfError(f"device.strategy={s} is unknown; use one of {', '.join(STRATEGIES)} "
                        "(or pick a device file: device=ddp, zero2, zero3, fsdp, cpu-ddp, cpu-fsdp)")
    return s


def num_processes(device) -> int:
    """Processes per machine; `auto` counts the visible GPUs."""
    n = device.num_processes
    if str(n) == "auto":
        if device.accelerator != "cuda":
            raise RlhfError("device.num_processes=auto counts GPUs; on the CPU give a number "
                            "(device=cpu-ddp device.num_processes=2)")
        import torch

        n = torch.cuda.device_count()
        if n < 1:
            raise RlhfError("device.num_processes=auto found no visible GPU; set device.num_processes=N "
                            "(or use device=cpu-ddp to run processes on the CPU)")
    try:
        n = int(n)
    except (TypeError, ValueError):
        raise RlhfError(f"device.num_processes={n} must be a number or auto") from None
    if n < 1:
        raise RlhfError(f"device.num_processes must be >= 1 (got {n})")
    return n


def check_stage_support(run) -> None:
    """Reject stage / strategy combinations that cannot work (before launching, and again in each process);
    `run`: the run's settings (rlhf_cli.settings.of)."""
    d, command = run.device, run.command
    s = strategy(d)
    if s == "single" or command not in TRAIN_COMMANDS:
        return
    if s == "deepspeed":
        if int(d.zero_stage) not in (1, 2, 3):
            raise RlhfError(f"device.zero_stage={d.zero_stage} is not a ZeRO stage; use 2 (device=zero2) "
                            "or 3 (device=zero3)")
        if d.accelerator != "cuda":
            raise RlhfError("DeepSpeed needs GPUs (device.accelerator=cuda); on the CPU use device=cpu-ddp")
    if s == "deepspeed" and command == "ppo":
        raise RlhfError(f"rlhf ppo runs under ddp or fsdp, not {d.name} (DeepSpeed): use device=fsdp to shard its "
                        "models over the GPUs (device=cpu-fsdp on the CPU), or device=ddp")
    if s == "fsdp" and command == "ppo":
        if bool(d.offload_params):
            raise RlhfError(f"device.offload_params=true: rlhf ppo keeps its shards on the device under "
                            f"{d.name}; set device.offload_params=false")
        if bool(run.ppo.merge):
            raise RlhfError(f"ppo.merge=true under {d.name}: the adapter is trained sharded; merge it after the "
                            "run with `rlhf export` (or drop ppo.merge)")
    if command == "sft" and s in ("deepspeed", "fsdp") and bool(run.sft.lora.enabled) and \
            (s == "fsdp" or int(d.zero_stage) == 3):
        raise RlhfError(f"sft.lora.enabled=true with {d.name}: the adapter is merged into the weights before "
                        "saving, which needs unsharded weights; use device=zero2 or ddp, or full fine-tuning")


def check_launch(run) -> None:
    """Process counts and multi-node settings of a launch (`run`: the run's settings, rlhf_cli.settings.of)."""
    d = run.device
    s = strategy(d)
    n = num_processes(d)
    if s == "single":
        if n != 1:
            raise RlhfError(f"device={d.name} runs one process but device.num_processes={n}; use device=ddp "
                            f"device.num_processes={n} (device=cpu-ddp on the CPU)")
        return
    if s == "ddp" and n * int(d.num_machines) < 2:
        raise RlhfError(f"device={d.name} with one process in total is a single-process run; set "
                        "device.num_processes=2 or more, or use device=cuda / cpu")
    if int(d.num_machines) > 1 and not d.main_process_ip:
        raise RlhfError(f"device.num_machines={d.num_machines} needs device.main_process_ip (the address of "
                        "machine 0) and, on each machine, its own device.machine_rank")
    if not 0 <= int(d.machine_rank) < int(d.num_machines):
        raise RlhfError(f"device.machine_rank={d.machine_rank} must be in 0..{int(d.num_machines) - 1} "
                        f"(device.num_machines={d.num_machines})")
    collective_timeout_s(d)


def collective_timeout_s(device) -> int:
    """Seconds a process waits in a collective (all-reduce, barrier, broadcast) before the run fails: a peer
    that died or hangs then ends the run with an error instead of leaving the others waiting for it."""
    v = device.get("collective_timeout_s")
    if v is None:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        seconds = float(v)
    except (TypeError, ValueError):
        seconds = 0.0
    if not 1 <= seconds < float("inf") or isinstance(v, bool):
        raise RlhfError(f"device.collective_timeout_s={v} must be a number of seconds >= 1 "
                        f"(default {DEFAULT_COLLECTIVE_TIMEOUT_S})")
    return int(seconds)


def accelerator_kwargs(device) -> dict:
    """Keyword arguments for `accelerate.Accelerator(**...)` in a stage that drives accelerate itself (ppo).

    `mixed_precision="no"`: the stage decides its compute dtype (hardware.resolve_compute_dtype) and autocasts
    itself, so accelerate must not add its own autocast (nor take one from an outer `accelerate launch`). The
    process group gets `device.collective_timeout_s`, so a lost peer fails the run instead of hanging it."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    return {
        "cpu": device.accelerator == "cpu",
        "mixed_precision": "no",
        "kwargs_handlers": [InitProcessGroupKwargs(timeout=timedelta(seconds=collective_timeout_s(device)))],
    }


# ------------------------------------------------------------------------------- DeepSpeed / FSDP settings
def deepspeed_config(device) -> dict:
    """The DeepSpeed config for `TrainingArguments(deepspeed=...)`: the trainer fills the "auto" fields from
    its own arguments (micro-batch, accumulation, clipping, bf16/fp16), so they cannot disagree."""
    stage = int(device.zero_stage)
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": "auto"}
    if bool(device.offload_optimizer):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto",
                    stage3_gather_16bit_weights_on_model_save=True)
        if bool(device.offload_params):
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


def fsdp_config(device) -> dict:
    """`TrainingArguments(fsdp=True, fsdp_config=...)`: FSDP2, one shard unit per decoder layer (the model's
    `_no_split_modules`), full state dict on save."""
    f = device.fsdp
    return {
        "version": int(f.version),
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "reshard_after_forward": bool(f.reshard_after_forward),
        "cpu_offload": bool(device.offload_params),
        "state_dict_type": str(f.state_dict_type),
        "activation_checkpointing": bool(f.activation_checkpointing),
        "cpu_ram_efficient_loading": False,
    }


def trainer_strategy_kwargs(device) -> dict:
    """The TrainingArguments fields of the device: the collective timeout (`ddp_timeout`, read when the
    trainer sets up the process group) and the strategy's settings (DeepSpeed config, fsdp_config; none for
    ddp)."""
    s = strategy(device)
    kw: dict = {"ddp_timeout": collective_timeout_s(device)}
    if s == "deepspeed":
        kw["deepspeed"] = deepspeed_config(device)
    elif s == "fsdp":
        kw.update(fsdp=True, fsdp_config=fsdp_config(device))
    return kw


def is_sharded(device) -> bool:
    """Weights are split over processes (ZeRO-3, FSDP): saving and forward passes are collective."""
    s = strategy(device)
    return s == "fsdp" or (s == "deepspeed" and int(device.zero_stage) == 3)


def accelerate_config(device, per_machine: int | None = None) -> dict:
    """The `accelerate launch --config_file` contents (accelerate's ClusterConfig fields) for the device."""
    d = device
    s = strategy(d)
    n = per_machine if per_machine is not None else num_processes(d)
    machines = int(d.num_machines)
    port = d.main_process_port
    if port is None:
        port = 0 if machines == 1 else 29500  # 0: accelerate picks a free port
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": {"ddp": "MULTI_GPU", "deepspeed": "DEEPSPEED", "fsdp": "FSDP"}.get(s, "NO"),
        "mixed_precision": "no",  # each stage picks its compute dtype itself (device.mixed_precision)
        "use_cpu": False,  # CPU processes use the multi-GPU launcher too; accelerate's --cpu starts only one
        "num_processes": n * machines,  # accelerate counts processes over all machines
        "num_machines": machines,
        "machine_rank": int(d.machine_rank),
        "main_process_ip": d.main_process_ip,
        "main_process_port": int(port),
        "rdzv_backend": str(d.rdzv_backend),
        "same_network": True,
        "gpu_ids": "all",
        "downcast_bf16": "no",
        "debug": False,
        "dynamo_config": {},
    }
    if s == "deepspeed":
        cfg["deepspeed_config"] = {
            "zero_stage": int(d.zero_stage),
            "offload_optimizer_device": "cpu" if bool(d.offload_optimizer) else "none",
            "offload_param_device": "cpu" if bool(d.offload_params) and int(d.zero_stage) == 3 else "none",
            "zero3_init_flag": False,
            "zero3_save_16bit_model": int(d.zero_stage) == 3,
            "deepspeed_multinode_launcher": "standard",  # one launcher per machine, as for ddp
        }
    elif s == "fsdp":
        f = fsdp_config(d)
        cfg["fsdp_config"] = {
            "fsdp_version": f["version"],
            "fsdp_auto_wrap_policy": f["auto_wrap_policy"],
            "fsdp_reshard_after_forward": f["reshard_after_forward"],
            "fsdp_offload_params": f["cpu_offload"],
            "fsdp_state_dict_type": f["state_dict_type"],
            "fsdp_activation_checkpointing": f["activation_checkpointing"],
            "fsdp_cpu_ram_efficient_loading": f["cpu_ram_efficient_loading"],
        }
    return cfg


# ------------------------------------------------------------------------------------------------- launch
def launcher_prefix() -> list[str]:
    """`accelerate launch` of this environment (the script beside this Python, else `python -m`)."""
    exe = Path(sys.executable).with_name("accelerate")
    if exe.exists():
        return [str(exe), "launch"]
    return [sys.executable, "-m", "accelerate.commands.launch"]


def quiet_launch_argv(argv: list[str]) -> list[str]:
    """The launch command `argv` (from `launch_argv`) through `rlhf_cli.accelerate_launch`: the same launch,
    with one line instead of the launcher's traceback when a process fails."""
    prefix = launcher_prefix()
    if argv[: len(prefix)] != prefix:
        raise ValueError(f"not an accelerate launch command: {argv[:3]}")
    return [sys.executable, "-m", "rlhf_cli.accelerate_launch", *argv[len(prefix):]]


def launch_argv(run, overrides: list[str], config_file: str | Path | None = None) -> list[str]:
    """The full launch command of the run's settings (`run`: rlhf_cli.settings.of): ddp as explicit flags;
    DeepSpeed / FSDP through the generated config file."""
    d = run.device
    strategy(d)  # an unknown strategy is refused before anything else
    ac = accelerate_config(d)
    argv = launcher_prefix()
    if not uses_config_file(run):
        argv += ["--multi_gpu", "--num_processes", str(ac["num_processes"]), "--num_machines",
                 str(ac["num_machines"])]
        if ac["num_machines"] > 1:
            argv += ["--machine_rank", str(ac["machine_rank"]), "--main_process_ip",
                     str(ac["main_process_ip"]), "--rdzv_backend", ac["rdzv_backend"], "--same_network"]
        argv += ["--main_process_port", str(ac["main_process_port"]), "--mixed_precision", "no",
                 "--dynamo_backend", "no"]
    else:
        if config_file is None:
            raise ValueError("DeepSpeed / FSDP launches need the generated accelerate config file")
        argv += ["--config_file", str(config_file)]
    threads = int(d.get("threads") or 0)
    if threads > 0:
        argv += ["--num_cpu_threads_per_process", str(threads)]
    return [*argv, "-m", "rlhf_cli.cli", str(run.command), *overrides]


def uses_config_file(run) -> bool:
    """Whether the launch carries accelerate's DeepSpeed / FSDP settings (a generated config file): sft and
    reward, whose trainers take them from accelerate; ppo places its models itself and launches like ddp.
    `run`: the run's settings (rlhf_cli.settings.of)."""
    s = strategy(run.device)
    return s == "deepspeed" or (s == "fsdp" and str(run.command) != "ppo")


def child_overrides(task_overrides: list[str]) -> list[str]:
    """This run's overrides as the started processes get them (the dispatcher adds its own again)."""
    return [o for o in task_overrides if not o.startswith(_INJECTED) and not o.startswith("dry_run=")]


def write_accelerate_config(run, directory: str | Path) -> Path:
    """`accelerate_config.yaml` in `directory` from the device of the run's settings (`run`:
    rlhf_cli.settings.of)."""
    import yaml

    path = Path(directory) / "accelerate_config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(accelerate_config(run.device), sort_keys=False)
    head = f"# written by `rlhf {run.command}` from its device.* settings; used by accelerate launch\n"
    path.write_text(head + text, encoding="utf-8")
    return path
