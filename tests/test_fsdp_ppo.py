"""PPO with its models sharded (FSDP2, `device=cpu-fsdp`: 2 CPU processes, gloo) against the same run on DDP
replicas, and checkpoints written by a sharded run resumed sharded and on one process.

Why the two runs can agree: both start from the same weights (LoRA's random A is broadcast from process 0 in both)
and the same per-process RNG, sample with transformers' generate() (DDP with device.fast_paths=off, which fsdp
turns off itself), and compute the same forwards on the same (gathered) weights. They differ only in how the
gradients are summed over the processes (DDP all-reduces, FSDP reduce-scatters), which moves the weights by
rounding, about 1e-7 relative after an update in fp32, so the second update samples the same tokens and every
metric agrees to ~1e-7 (measured: 5e-8 at most). The tolerance, 1e-5 relative + 1e-6 absolute, leaves two orders
of magnitude for another BLAS or summation order and still catches a real difference: a trained weight that
stays frozen under sharding (the LoRA on the tiny recipe's lm_head did, before the root reshards after its
forward) moved the first update's policy loss by 25%.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from clitools import EVAL_ROWS
from test_dist import LONG_TEST, SAFETY_S, _gone, _tagged, _workers, one_process, read, rlhf, rlhf_process

FSDP = ["device=cpu-fsdp", "device.threads=1"]
DDP = ["device=cpu-ddp", "device.num_processes=2", "device.threads=1", "device.fast_paths=off"]
# 256 prompts (each process reads and renders all of them): enough for the 192 episodes of the longest run
ROWS = "data.max_rows=256"
PPO = ["ppo.total_episodes=128", "ppo.num_mini_batches=1", "ppo.eval_every=0", "ppo.save_every=1", ROWS]
UPDATES = 2
RTOL, ATOL = 1e-5, 1e-6
UNTIMED = ("time/", "eps")  # wall-clock figures differ between any two runs


def scalars(run: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"] if not t.startswith(UNTIMED)}


def differences(a: dict, b: dict) -> dict[str, float]:
    """Per metric, the largest |a - b| beyond the tolerance (empty: they agree)."""
    assert a.keys() == b.keys()
    out = {}
    for k in a:
        assert len(a[k]) == len(b[k]) == UPDATES, (k, a[k], b[k])
        worst = max(abs(x - y) - (ATOL + RTOL * abs(y)) for x, y in zip(a[k], b[k]))
        if worst > 0:
            out[k] = (a[k], b[k])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """SFT and reward on one process (a few steps on a few hundred rows: what the PPO runs start from, not what
    they test), then the same PPO run on fsdp and on ddp."""
    root = tmp_path_factory.mktemp("fsdp")
    run = root / "runs" / "tiny"
    for args in (["sft", "sft.max_steps=10", "sft.eval_steps=100", "sft.logging_steps=5", ROWS, EVAL_ROWS],
                 ["reward", "reward.max_steps=10", "reward.eval_steps=100", ROWS, EVAL_ROWS]):
        rc, _, err = one_process(root, *args, "device.threads=1")
        assert rc == 0, err[-3000:]
    rc, out, err = rlhf(root, "ppo", *FSDP, *PPO, f"ppo.output_dir={run / 'ppo-fsdp'}")
    assert rc == 0, err[-3000:]
    assert "--multi_gpu" in out + err and "fast paths: off under device.strategy=fsdp" in out + err
    rc, _, err = rlhf(root, "ppo", *DDP, *PPO, f"ppo.output_dir={run / 'ppo-ddp'}")
    assert rc == 0, err[-3000:]
    return root, run


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_sharded_ppo_matches_ddp_update_by_update(runs):
    _, run = runs
    fsdp, ddp = scalars(run / "ppo-fsdp"), scalars(run / "ppo-ddp")
    assert "loss/policy_avg" in fsdp and "objective/kl" in fsdp
    assert not differences(fsdp, ddp)
    # what trains is saved whole, under the same names as a whole run's: the same files, the same numbers
    from safetensors.torch import load_file

    a, b = (load_file(str(run / d / "adapter_model.safetensors")) for d in ("ppo-fsdp", "ppo-ddp"))
    assert a.keys() == b.keys() and any("lm_head" in k for k in a)
    for k in a:
        assert a[k].shape == b[k].shape and (a[k] - b[k]).abs().max() <= 1e-5, k
    assert (run / "ppo-fsdp" / "value" / "model.safetensors").is_file()


def _interrupted(run: Path, name: str) -> Path:
    """The fsdp run as it was when its process was killed after checkpoint 1: its partial directory."""
    partial = run / f".{name}.partial"
    shutil.copytree(run / "ppo-fsdp", partial)
    shutil.rmtree(partial / "checkpoints" / "checkpoint-2")
    (partial / "metrics.json").unlink()
    return partial


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_sharded_checkpoint_resumes_sharded_to_the_same_end(runs):
    """Weights, optimizer moments (sharded differently than they were saved: whole in the file) and RNG come
    back exactly: the resumed run's last update equals the uninterrupted run's."""
    root, run = runs
    _interrupted(run, "resumed")
    rc, out, err = rlhf(root, "ppo", *FSDP, *PPO, f"ppo.output_dir={run / 'resumed'}", "ppo.resume=true")
    assert rc == 0, err[-3000:]
    assert "checkpoint-1" in out + err and "resumed from" in out + err
    whole, resumed = read(run / "ppo-fsdp" / "metrics.json"), read(run / "resumed" / "metrics.json")
    for k, v in whole.items():
        if isinstance(v, float) and not k.startswith(UNTIMED) and k != "train_seconds":
            assert resumed[k] == pytest.approx(v, rel=RTOL, abs=ATOL), k


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_sharded_checkpoint_resumes_on_one_process(runs):
    """The checkpoint holds what trains whole: one process (twice the accumulation for the same batch) takes it
    up with ppo.resume=force, which names the keys that changed. (The value embedding trains densely, as it does
    on several processes: stepped row by row it would be another optimizer parameter.)"""
    root, run = runs
    _interrupted(run, "one")
    rc, out, err = one_process(root, "ppo", "device.threads=1", *PPO, "ppo.gradient_accumulation_steps=8",
                        "ppo.sparse_value_embedding=false", f"ppo.output_dir={run / 'one'}", "ppo.resume=force")
    assert rc == 0, err[-3000:]
    assert "checkpoint-1" in out + err and "device.num_processes" in out + err
    m = read(run / "one" / "metrics.json")
    assert m["total_episodes"] == 128 and m["updates"] == UPDATES and m["world_size"] == 1
    from peft import AutoPeftModelForCausalLM

    with contextlib.chdir(run / "one"):  # the base is recorded relative to the adapter
        AutoPeftModelForCausalLM.from_pretrained(".")


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_activation_checkpointing_under_sharding_changes_no_number(runs):
    """Checkpointed layers recompute under FSDP (their weights gathered again for it): the same run, to the
    tolerance (measured: equal to the last bit)."""
    root, run = runs
    rc, _, err = rlhf(root, "ppo", *FSDP, *PPO, "ppo.activation_checkpointing=true",
                      f"ppo.output_dir={run / 'ppo-fsdp-ac'}")
    assert rc == 0, err[-3000:]
    assert not differences(scalars(run / "ppo-fsdp-ac"), scalars(run / "ppo-fsdp"))


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_killing_one_sharded_process_ends_the_run_and_resume_continues(runs):
    """kill -9 of one process while the other waits in a collective for it: the run ends with an error and
    leaves no process behind; ppo.resume=true continues from its last checkpoint to the end."""
    root, run = runs
    out, log = run / "killed", run / "killed.log"
    args = ["ppo", *FSDP, "ppo.total_episodes=192", "ppo.num_mini_batches=1", "ppo.eval_every=0", "ppo.save_every=1",
            ROWS, f"ppo.output_dir={out}"]
    with log.open("w") as f, rlhf_process(root, *args, stdout=f, stderr=subprocess.STDOUT) as p:
        parent, deadline = psutil.Process(p.pid), time.monotonic() + SAFETY_S
        first = run / ".killed.partial" / "checkpoints" / "checkpoint-1"
        while not (first / "checksums.json").is_file() or len(_workers(parent)) < 2:
            assert p.poll() is None, f"the run ended early (exit {p.returncode}): {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint-1 after {SAFETY_S} s"
            time.sleep(0.2)
        tree = parent.children(recursive=True)
        victim = next(w for w in _workers(parent) if w.environ().get("LOCAL_RANK") == "1")
        victim.send_signal(signal.SIGKILL)
        rc = p.wait(timeout=SAFETY_S)  # a safety net for a hang: it ends at the peer's first collective
        assert rc != 0
        deadline = time.monotonic() + 120  # a safety net, not a speed requirement
        while time.monotonic() < deadline and not all(_gone(c) for c in tree):
            time.sleep(0.1)
        left = [c for c in tree + _tagged(p.tag) if not _gone(c)]
        assert not left, [(c.pid, " ".join(c.cmdline())[:200]) for c in left]
    rc, text, err = rlhf(root, *args, "ppo.resume=true")
    assert rc == 0, err[-3000:]
    assert "resumed from" in text + err
    m = read(out / "metrics.json")
    assert m["total_episodes"] == 192 and m["updates"] == 3


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_sampling_layer_by_layer_changes_no_number(runs):
    """device.fsdp.gather_for_sampling=false (a policy too large to gather whole): each sampling forward gathers
    layer by layer and the processes step together to the longest response (generate(synced_gpus=True)); the
    same tokens come out, so the same run."""
    root, run = runs
    rc, _, err = rlhf(root, "ppo", *FSDP, *PPO, "device.fsdp.gather_for_sampling=false",
                      f"ppo.output_dir={run / 'ppo-fsdp-layers'}")
    assert rc == 0, err[-3000:]
    assert not differences(scalars(run / "ppo-fsdp-layers"), scalars(run / "ppo-fsdp"))


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_two_machines_on_one_host_finish_one_sharded_run(runs):
    """Two "machines" on 127.0.0.1, one process each (`device.num_machines=2`, `device.machine_rank=0|1`): the
    same command on each, machine 0 the main one. They form one world of 2 and finish one run, written once
    (machine 0 writes; the directory is shared, as on a cluster's file system), equal to the one-machine
    2-process run to the tolerance."""
    from test_dist import _free_port

    root, run = runs
    port = _free_port()
    machine = ["device.num_processes=1", "device.num_machines=2", "device.main_process_ip=127.0.0.1",
               f"device.main_process_port={port}"]
    args = ["ppo", *FSDP, *PPO, *machine, f"ppo.output_dir={run / 'two-machines'}"]
    logs = [run / f"machine{r}.log" for r in range(2)]
    with logs[0].open("w") as f0, logs[1].open("w") as f1, \
            rlhf_process(root, *args, "device.machine_rank=0", stdout=f0, stderr=subprocess.STDOUT) as m0, \
            rlhf_process(root, *args, "device.machine_rank=1", stdout=f1, stderr=subprocess.STDOUT) as m1:
        rcs = [m.wait(timeout=SAFETY_S) for m in (m0, m1)]
    assert rcs == [0, 0], [log.read_text()[-3000:] for log in logs]
    m = read(run / "two-machines" / "metrics.json")
    assert m["world_size"] == 2 and m["updates"] == UPDATES
    assert "--num_machines 2" in logs[1].read_text() and "--machine_rank 1" in logs[1].read_text()
    assert not differences(scalars(run / "two-machines"), scalars(run / "ppo-fsdp"))
