"""Device configs (conf/device/*.yaml): they compose, their generated accelerate / DeepSpeed / FSDP settings
parse, and the launch line that `dry_run=true` prints is the one that would run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import timedelta

import psutil
import pytest
import yaml
from omegaconf import OmegaConf

from rlhf_cli import launch, supervise
from rlhf_cli.config import CONF_DIR, compose
from rlhf_cli.errors import RlhfError
from rlhf_cli.settings import of

DEVICES = sorted(p.stem for p in (CONF_DIR / "device").glob("*.yaml"))
EXPECTED = {  # name: (accelerator, strategy, zero stage)
    "cpu": ("cpu", "single", 0), "cuda": ("cuda", "single", 0), "cpu-ddp": ("cpu", "ddp", 0),
    "ddp": ("cuda", "ddp", 0), "zero2": ("cuda", "deepspeed", 2), "zero3": ("cuda", "deepspeed", 3),
    "fsdp": ("cuda", "fsdp", 0), "cpu-fsdp": ("cpu", "fsdp", 0),
}


def test_every_expected_device_file_exists():
    assert set(EXPECTED) <= set(DEVICES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("command", ["sft", "reward", "ppo", "doctor"])
def test_device_composes(device, command):
    cfg = compose(command, [f"device={device}"])
    d = cfg.device
    assert d.name == device
    if device in EXPECTED:
        assert (d.accelerator, d.strategy, d.zero_stage) == EXPECTED[device]
    for key in ("num_processes", "threads", "mixed_precision", "num_machines", "machine_rank",
                "main_process_ip", "main_process_port", "offload_optimizer", "offload_params"):
        assert key in d  # inherited from cpu.yaml
    launch.strategy(d)


def test_device_choice_beats_the_recipe_and_keys_override():
    cfg = compose("sft", ["recipe=qwen3-0.6b", "device=zero3", "device.num_processes=8",
                          "device.offload_optimizer=true"])
    assert cfg.device.name == "zero3" and cfg.device.num_processes == 8 and cfg.device.offload_optimizer


@pytest.mark.parametrize("device", ["ddp", "cpu-ddp", "zero2", "zero3", "fsdp"])
def test_accelerate_config_parses(device, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    cfg = compose("sft", [f"device={device}", "device.num_processes=4"])
    path = launch.write_accelerate_config(of(cfg), tmp_path)
    loaded = load_config_from_file(str(path))
    want = {"ddp": DistributedType.MULTI_GPU, "cpu-ddp": DistributedType.MULTI_GPU,
            "zero2": DistributedType.DEEPSPEED, "zero3": DistributedType.DEEPSPEED,
            "fsdp": DistributedType.FSDP}[device]
    assert loaded.distributed_type == want
    assert loaded.num_processes == 4 and loaded.num_machines == 1 and loaded.main_process_port == 0
    if device.startswith("zero"):
        assert loaded.deepspeed_config["zero_stage"] == int(device[-1])
    if device == "fsdp":
        assert loaded.fsdp_config["fsdp_version"] == 2
        assert loaded.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"


def test_multi_node_settings_pass_through(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    ov = ["device=zero2", "device.num_processes=8", "device.num_machines=2", "device.machine_rank=1",
          "device.main_process_ip=10.1.2.3", "device.main_process_port=29600"]
    loaded = load_config_from_file(str(launch.write_accelerate_config(of(compose("sft", ov)), tmp_path)))
    # accelerate counts processes over all machines
    assert (loaded.num_processes, loaded.num_machines, loaded.machine_rank) == (16, 2, 1)
    assert (loaded.main_process_ip, loaded.main_process_port) == ("10.1.2.3", 29600)
    assert loaded.deepspeed_config["deepspeed_multinode_launcher"] == "standard"
    argv = launch.launch_argv(of(compose("sft", ["device=ddp", *ov[1:]])), ["device=ddp"])
    i = argv.index("--num_processes")
    assert argv[i + 1] == "16"
    for flag, value in (("--machine_rank", "1"), ("--main_process_ip", "10.1.2.3"), ("--num_machines", "2"),
                        ("--main_process_port", "29600")):
        assert argv[argv.index(flag) + 1] == value


@pytest.mark.parametrize("stage,offload", [(2, False), (2, True), (3, False), (3, True)])
def test_deepspeed_dict(stage, offload):
    d = compose("sft", [f"device=zero{stage}", f"device.offload_optimizer={offload}",
                        f"device.offload_params={offload}"]).device
    ds = json.loads(json.dumps(launch.deepspeed_config(d)))  # plain JSON, as DeepSpeed reads it
    z = ds["zero_optimization"]
    assert z["stage"] == stage
    assert ("offload_optimizer" in z) == offload
    assert ("offload_param" in z) == (offload and stage == 3)
    assert z.get("stage3_gather_16bit_weights_on_model_save", False) == (stage == 3)
    # batch sizes, accumulation, clipping and precision are left to the trainer, so they cannot disagree
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert ds[key] == "auto"
    assert launch.trainer_strategy_kwargs(d) == {"deepspeed": launch.deepspeed_config(d), "ddp_timeout": 1800}
    assert launch.is_sharded(d) == (stage == 3)


def test_fsdp_settings_are_trainingarguments():
    from transformers import TrainingArguments

    d = compose("sft", ["device=fsdp", "device.offload_params=true"]).device
    kw = launch.trainer_strategy_kwargs(d)
    assert kw["fsdp"] is True and kw["fsdp_config"]["cpu_offload"] is True
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], **kw)
    assert args.ddp_timeout == 1800  # device.collective_timeout_s
    assert args.fsdp_plugin_args["fsdp_version"] == 2
    assert args.fsdp_plugin_args["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert args.fsdp_plugin_args["state_dict_type"] == "FULL_STATE_DICT"
    assert launch.is_sharded(d)
    assert launch.trainer_strategy_kwargs(compose("sft", ["device=ddp"]).device) == {"ddp_timeout": 1800}


# -------------------------------------------------------------------------------------- dry runs (real CLI)
def test_ppo_ddp_dry_run_prints_the_launch_line(run_cli):
    rc, out, err = run_cli("ppo", "device=ddp", "dry_run=true", "ppo.kl_coef=0.1")
    assert rc == 0, err
    line = out.strip().splitlines()[0]
    argv = shlex.split(line)
    assert (argv[0].endswith("accelerate") and argv[1] == "launch"
            or argv[1:3] == ["-m", "accelerate.commands.launch"])
    assert "--multi_gpu" in argv
    assert argv[argv.index("--num_processes") + 1] == "2"  # ddp.yaml's default
    assert argv[argv.index("--num_machines") + 1] == "1"
    assert argv[argv.index("--dynamo_backend") + 1] == "no"
    assert argv[argv.index("--mixed_precision") + 1] == "no"  # the stage autocasts itself
    tail = argv[argv.index("-m") :]
    # the started processes run this command with the same overrides (and without dry_run)
    assert tail == ["-m", "rlhf_cli.cli", "ppo", "device=ddp", "ppo.kl_coef=0.1"]


def test_dry_run_with_process_count_and_cpu_processes(run_cli):
    rc, out, err = run_cli("sft", "device=ddp", "device.num_processes=4", "dry_run=true")
    assert rc == 0, err
    argv = shlex.split(out.strip().splitlines()[0])
    assert argv[argv.index("--num_processes") + 1] == "4"
    assert argv[-3:] == ["sft", "device=ddp", "device.num_processes=4"]
    rc, out, err = run_cli("reward", "device=cpu-ddp", "dry_run=true")
    assert rc == 0, err
    argv = shlex.split(out.strip().splitlines()[0])
    assert "--multi_gpu" in argv and argv[argv.index("--num_cpu_threads_per_process") + 1] == "1"


def test_deepspeed_dry_run_uses_a_config_file(run_cli, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    rc, out, err = run_cli("sft", "device=zero3", "dry_run=true")
    assert rc == 0, err
    argv = shlex.split(out.strip().splitlines()[0])
    path = argv[argv.index("--config_file") + 1]
    assert load_config_from_file(path).deepspeed_config["zero_stage"] == 3
    assert "zero_stage: 3" in out  # the file's contents are shown under the line


def test_single_process_dry_run(run_cli):
    rc, out, err = run_cli("sft", "dry_run=true", "sft.max_steps=3")
    assert rc == 0, err
    assert out.strip().endswith("-m rlhf_cli.cli sft sft.max_steps=3")


@pytest.mark.parametrize("args,needle", [
    (["ppo", "device=zero2"], "ppo runs under ddp or fsdp, not zero2 (DeepSpeed): use device=fsdp"),
    (["ppo", "device=zero3"], "ppo runs under ddp or fsdp, not zero3 (DeepSpeed): use device=fsdp"),
    (["ppo", "device=fsdp", "device.offload_params=true"], "set device.offload_params=false"),
    (["ppo", "device=cpu-fsdp", "ppo.merge=true"], "merge it after the run with `rlhf export`"),
    (["sft", "device=zero3", "sft.lora.enabled=true"], "unsharded weights"),
    (["sft", "device=cpu-ddp", "device.num_processes=1"], "single-process run"),
    (["sft", "device=cuda", "device.num_processes=4"], "device=ddp device.num_processes=4"),
    (["sft", "device=ddp", "device.num_machines=2"], "main_process_ip"),
    (["sft", "device=zero2", "device.accelerator=cpu"], "DeepSpeed needs GPUs"),
    (["sft", "device=ddp", "device.strategy=mpi"], "device.strategy=mpi is unknown"),
])
def test_unsupported_combinations_fail_fast(run_cli, args, needle):
    rc, out, err = run_cli(*args, "dry_run=true")
    assert rc == 2, (out, err)
    assert needle in err and err.count("\n") == 1  # one line


@pytest.mark.parametrize("device", ["fsdp", "cpu-fsdp"])
def test_ppo_under_fsdp_launches_like_ddp(run_cli, device):
    """ppo shards its models itself: its launch line has no accelerate FSDP config (sft's has)."""
    rc, out, err = run_cli("ppo", f"device={device}", "dry_run=true")
    assert rc == 0, err
    assert "--multi_gpu" in out and "--num_processes 2" in out and "--config_file" not in out
    rc, out, err = run_cli("sft", f"device={device}", "dry_run=true")
    assert rc == 0, err
    assert "--config_file" in out and "fsdp_version: 2" in out


def test_launched_processes_do_not_launch_again(monkeypatch, tmp_path, capsys):
    cfg = compose("sft", ["device=cpu-ddp", "dry_run=true"])
    assert supervise.handle(of(cfg), ["device=cpu-ddp"], tmp_path) == 0  # the launching process: prints the line
    assert "--multi_gpu" in capsys.readouterr().out
    armed = []
    monkeypatch.setattr(supervise, "die_with_launcher", lambda: armed.append(1))  # not on the test process
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert supervise.handle(of(cfg), ["device=cpu-ddp"], tmp_path) is None  # a started process: runs the stage
    assert armed  # ... and ends when its launcher does
    with pytest.raises(RlhfError, match="ppo runs under ddp"):
        supervise.handle(of(compose("ppo", ["device=zero2"])), [], tmp_path)  # still checked in each process


def test_child_overrides_drop_what_the_dispatcher_adds():
    task = ["hydra.searchpath=[file:///x]", "command=sft", "recipes=qwen3-0.6b", "device=ddp", "dry_run=true",
            "chat.prompt='a b'"]
    assert launch.child_overrides(task) == ["recipes=qwen3-0.6b", "device=ddp", "chat.prompt='a b'"]


def test_eval_ignores_the_training_strategy(run_cli):
    rc, out, err = run_cli("eval", "device=ddp", "dry_run=true")
    assert rc == 0, err
    assert "accelerate" not in out and out.strip().endswith("-m rlhf_cli.cli eval device=ddp")


def test_yaml_of_every_device_file_is_small_and_inherits():
    for name in DEVICES:
        data = yaml.safe_load((CONF_DIR / "device" / f"{name}.yaml").read_text())
        if name != "cpu":
            assert data["defaults"][0] in DEVICES  # starts from another device file
            assert len(data) <= 8


# ------------------------------------------------------------------------------------ precision, timeouts
@pytest.mark.parametrize("precision", ["auto", "no", "bf16", "fp16"])
def test_accelerate_never_adds_its_own_autocast(precision, tmp_path):
    """device.mixed_precision is the stage's business (models.resolve_compute_dtype): the launcher always
    tells accelerate `no`, on the command line and in the generated config file."""
    from accelerate.commands.config.config_args import load_config_from_file

    argv = launch.launch_argv(of(compose("sft", ["device=ddp", f"device.mixed_precision={precision}"])), [])
    assert argv[argv.index("--mixed_precision") + 1] == "no"
    for device in ("zero2", "fsdp"):
        cfg = compose("sft", [f"device={device}", f"device.mixed_precision={precision}"])
        assert launch.accelerate_config(cfg.device)["mixed_precision"] == "no"
        loaded = load_config_from_file(str(launch.write_accelerate_config(of(cfg), tmp_path / device)))
        assert loaded.mixed_precision == "no"


def test_collective_timeout_reaches_trainers_and_the_accelerator():
    import inspect

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    d = compose("ppo", ["device=cpu-ddp"]).device
    assert launch.collective_timeout_s(d) == 1800  # cpu.yaml's default, inherited by every device file
    d = compose("ppo", ["device=cpu-ddp", "device.collective_timeout_s=90"]).device
    assert launch.trainer_strategy_kwargs(d)["ddp_timeout"] == 90
    kw = launch.accelerator_kwargs(d)
    assert set(kw) <= set(inspect.signature(Accelerator).parameters)
    assert kw["cpu"] is True and kw["mixed_precision"] == "no"
    (handler,) = kw["kwargs_handlers"]
    assert isinstance(handler, InitProcessGroupKwargs)
    assert handler.to_kwargs() == {"timeout": timedelta(seconds=90)}
    assert launch.accelerator_kwargs(compose("ppo", ["device=ddp"]).device)["cpu"] is False
    # a device config without the key (written for an older rlhf) gets the default
    assert launch.collective_timeout_s(OmegaConf.create({"accelerator": "cpu"})) == 1800


@pytest.mark.parametrize("value", ["0", "-5", "abc"])
def test_bad_collective_timeout_is_one_line(value, run_cli):
    with pytest.raises(RlhfError, match="device.collective_timeout_s"):
        launch.collective_timeout_s(OmegaConf.create({"collective_timeout_s": value}))
    rc, out, err = run_cli("sft", "device=cpu-ddp", f"device.collective_timeout_s={value}", "dry_run=true")
    assert rc == 2 and "device.collective_timeout_s" in err and err.count("\n") == 1, (out, err)


# ------------------------------------------------------------------------------------- process lifetime
# Stand-ins for `accelerate launch` and its workers (plain Python, no torch): the launcher starts a worker in
# a session of its own, as torch's agent does, and optionally a helper in its own process group.
_LAUNCHER = """
import os, subprocess, sys, time
ready, with_helper = sys.argv[1], sys.argv[2] == "helper"
worker = "import os, sys, time; from rlhf_cli import supervise; supervise.die_with_launcher(); " \\
         "open(sys.argv[1] + '.tmp', 'w').write('armed'); os.replace(sys.argv[1] + '.tmp', sys.argv[1]); " \\
         "time.sleep(900)"
subprocess.Popen([sys.executable, "-c", worker, ready + "/worker"], start_new_session=True,
                 env=dict(os.environ, LOCAL_RANK="0", WORLD_SIZE="1"))
if with_helper:
    helper = "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(900)"
    subprocess.Popen([sys.executable, "-c", helper, ready + "/helper"])
time.sleep(900)
"""
_RLHF = ("import os, sys; from rlhf_cli import supervise; "
         "sys.exit(supervise.run_launcher(sys.argv[1:], dict(os.environ)))")


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until(predicate, what: str, limit_s: float = 600.0, proc: subprocess.Popen | None = None):
    """Poll `predicate` (a safety-net limit, not a speed requirement); fail early if `proc` has ended."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the process ended (exit {proc.returncode}) before {what}")
        time.sleep(0.1)
    pytest.fail(f"no {what} after {limit_s} s")


@pytest.fixture
def spawned():
    """Start `python -c code args` in its own session; on the way out kill it and everything it started."""
    started: list[subprocess.Popen] = []
    seen: list[psutil.Process] = []

    def start(code: str, *args: str) -> tuple[subprocess.Popen, list[psutil.Process]]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for k in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
            env.pop(k, None)
        p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        started.append(p)
        return p, seen

    yield start
    for p in started:
        try:
            seen.extend(psutil.Process(p.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for q in seen:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass


def _start_tree(spawned, tmp_path, helper: bool):
    ready = tmp_path / "ready"
    ready.mkdir()
    outer, seen = spawned(_RLHF, sys.executable, "-c", _LAUNCHER, str(ready), "helper" if helper else "-")
    want = ["worker", "helper"] if helper else ["worker"]
    _wait_until(lambda: all((ready / n).exists() for n in want), "armed worker", proc=outer)
    tree = psutil.Process(outer.pid).children(recursive=True)
    seen.extend(tree)
    assert len(tree) == len(want) + 1  # launcher + worker (+ helper)
    return outer, tree


def test_signals_to_rlhf_reach_the_launch_group_and_its_workers(spawned, tmp_path):
    outer, tree = _start_tree(spawned, tmp_path, helper=True)
    outer.send_signal(signal.SIGTERM)
    _, err = outer.communicate(timeout=600)
    assert outer.returncode == 128 + signal.SIGTERM, err
    assert "stopped the launched processes on SIGTERM" in err
    _wait_until(lambda: all(_gone(p) for p in tree), "end of every launched process")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux only")
def test_killing_rlhf_outright_ends_the_launcher_and_its_workers(spawned, tmp_path):
    outer, tree = _start_tree(spawned, tmp_path, helper=False)
    outer.kill()  # SIGKILL: no handler runs; the kernel's parent-death signals take over
    outer.wait()
    _wait_until(lambda: all(_gone(p) for p in tree), "end of every launched process")


def test_exit_codes_and_the_failure_line():
    from rlhf_cli.cli import _launch_failure

    assert supervise.exit_code(-15) == 143 and supervise.exit_code(3) == 3 and supervise.exit_code(0) == 0
    assert "stopped by SIGTERM (exit 143)" in _launch_failure(143)
    assert "failed (exit 1)" in _launch_failure(1)


def test_started_processes_leave_their_errors_and_the_run_reports_them_once(tmp_path, monkeypatch, capsys):
    from rlhf_cli.cli import fail

    monkeypatch.setenv(supervise.ERRORS_ENV, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stop:
            fail("ppo", "ppo.policy_dir=/x: no model there; run rlhf sft first")
        assert stop.value.code == 2
    assert capsys.readouterr().err == ""  # left for the launching process, not printed by each rank
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0", "rank-1"]
    # both failed the same way: the message once
    assert supervise.launch_errors(tmp_path, 2) == "ppo.policy_dir=/x: no model there; run rlhf sft first"
    # one of two failed: it is named
    (tmp_path / "rank-0").unlink()
    assert supervise.launch_errors(tmp_path, 2) == \
        "rank 1: ppo.policy_dir=/x: no model there; run rlhf sft first"
    # different messages: each after its ranks, in rank order; a half-written file is not read
    (tmp_path / "rank-0").write_text("out of memory\n")
    (tmp_path / "rank-2").write_text("out of memory")
    (tmp_path / "rank-3.part").write_text("half")
    assert supervise.launch_errors(tmp_path, 4) == \
        "ranks 0, 2: out of memory; rank 1: ppo.policy_dir=/x: no model there; run rlhf sft first"
    assert supervise.launch_errors(tmp_path / "none", 2) is None


def test_errors_are_printed_where_no_launching_process_collects_them(tmp_path, monkeypatch, capsys):
    from rlhf_cli.cli import fail

    monkeypatch.delenv(supervise.ERRORS_ENV, raising=False)
    with pytest.raises(SystemExit):
        fail("sft", "bad")
    assert capsys.readouterr().err == "rlhf sft: error: bad\n"
    # started by a plain `accelerate launch` (the dry-run line), or the folder is gone: print it
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(supervise.ERRORS_ENV, str(tmp_path / "gone"))
    with pytest.raises(SystemExit):
        fail("sft", "bad")
    assert capsys.readouterr().err == "rlhf sft: error: bad\n"
    assert not supervise.record_error("bad")
