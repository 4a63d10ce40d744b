"""Multi-process runs on the CPU (gloo): global whitening with a real all-reduce, the 2-process chain through
the relaunch path (`device=cpu-ddp device.num_processes=2`), and the rank logic of atomic stage directories.

One torch thread per process throughout (2-core box). Every multi-process run is tagged (an environment
variable its processes inherit) and whatever carries the tag is killed when the test ends, passed or failed;
time limits are generous safety nets, never a speed requirement."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import clitools
import psutil
import pytest
import torch

from rlhf_cli.io import atomic_dir

RLHF = Path(sys.executable).with_name("rlhf")
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
           HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
for _k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
    ENV.pop(_k, None)
TAG = "RLHF_TEST_RUN_TAG"
SAFETY_S = 1500  # per CLI run: only catches a hang, a busy machine stays well inside it
# pytest's own limit (addopts --timeout) for tests that run the CLI on 2 processes, several times
LONG_TEST = pytest.mark.timeout(6 * SAFETY_S)


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG) == tag:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def _kill_all(procs) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=30)


@contextlib.contextmanager
def rlhf_process(cwd: Path, *args: str, **popen):
    """`rlhf *args` in `cwd`, in a session of its own. On the way out, passed or failed, everything the run
    started is killed: its process group, its process tree, and every process that carries the run's tag
    (torch's agent starts each worker in a session of its own, so the group alone does not reach them)."""
    exe = [str(RLHF)] if RLHF.exists() else [sys.executable, "-m", "rlhf_cli.cli"]
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([*exe, *args], cwd=str(cwd), env={**ENV, TAG: tag}, start_new_session=True,
                            **popen)
    proc.tag = tag
    try:
        yield proc
    finally:
        tree = []
        if proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                tree = psutil.Process(proc.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        _kill_all([*tree, *_tagged(tag)])
        proc.kill()
        proc.wait()


def rlhf(cwd: Path, *args: str, timeout: float = SAFETY_S) -> tuple[int, str, str]:
    with rlhf_process(cwd, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`rlhf {' '.join(args)}` still running after {timeout} s (a safety net for a hang)")
    return p.returncode, out, err


def one_process(cwd: Path, *args: str) -> tuple[int, str, str]:
    """`rlhf *args` on one process, where how processes start and end is not what is tested: in the test
    process (clitools.rlhf; a new process with RLHF_TEST_CLI=process), which saves an interpreter's imports."""
    proc = clitools.rlhf(cwd, *args, timeout=SAFETY_S)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def reap_children():
    """Kill what the test process started and left behind (torch.multiprocessing workers of a failed test)."""
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    yield
    _kill_all([c for c in me.children(recursive=True) if c.pid not in before])


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------ global whitening, real all-reduce
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _whiten_worker(rank: int, world: int, port: int, x, mask, out_dir: str) -> None:
    import torch.distributed as dist

    from rlhf_cli.ppo import core

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def allreduce_sum(t):
        t = t.clone()
        dist.all_reduce(t)
        return t

    rows = x.shape[0] // world
    xs, ms = x[rank * rows:(rank + 1) * rows], mask[rank * rows:(rank + 1) * rows]
    res = {
        "whiten": core.masked_whiten(xs, ms, allreduce_sum=allreduce_sum),
        "whiten_keep_mean": core.masked_whiten(xs, ms, keep_mean=True, allreduce_sum=allreduce_sum),
        "mean": core.masked_mean(xs, ms, allreduce_sum=allreduce_sum),
        "var": core.masked_var(xs, ms, allreduce_sum=allreduce_sum),
    }
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # neither process leaves while the other still has gloo traffic in flight
    dist.destroy_process_group()


@pytest.mark.dist
def test_global_whitening_matches_whole_batch(tmp_path, reap_children):
    import torch.multiprocessing as mp

    from rlhf_cli.ppo import core

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64) * 3 + 1
    mask = (torch.rand(8, 6, generator=g) > 0.3).double()
    mask[4:] = 0  # rank 1 holds no valid token at all: its collectives must still pair up with rank 0's
    mask[4:6, :2] = 1
    mask[6:] = 0
    mp.spawn(_whiten_worker, args=(2, _free_port(), x, mask, str(tmp_path)), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    whole = core.masked_whiten(x, mask)
    got = torch.cat([p["whiten"] for p in parts])
    valid = mask.bool()
    assert torch.allclose(got[valid], whole[valid], atol=1e-10)
    got_keep = torch.cat([p["whiten_keep_mean"] for p in parts])
    assert torch.allclose(got_keep[valid], core.masked_whiten(x, mask, keep_mean=True)[valid], atol=1e-10)
    for p in parts:  # every rank sees the global statistics
        assert torch.allclose(p["mean"], core.masked_mean(x, mask), atol=1e-12)
        assert torch.allclose(p["var"], core.masked_var(x, mask), atol=1e-12)
    # the whitened values over all processes have mean 0 and variance 1
    assert abs(got[valid].mean().item()) < 1e-9
    assert got[valid].var().item() == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------------- atomic dirs under a launcher
def test_atomic_dir_main_rank_renames_others_do_not_touch(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    final = tmp_path / "sft"
    monkeypatch.setenv("RANK", "1")
    with atomic_dir(final) as out1:  # a non-main rank: no directory is created, renamed or removed
        assert out1.name == ".sft.tmp-abc123" and not out1.exists()
    assert not final.exists()
    monkeypatch.setenv("RANK", "0")
    with atomic_dir(final) as out0:
        assert out0 == out1 and out0.is_dir()  # the same path on every rank
        (out0 / "model").write_text("x")
    assert (final / "model").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft"]
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as out:
            raise RuntimeError("boom")
    assert not out.exists() and (final / "model").exists()


def test_atomic_dir_single_writer_uses_its_own_name(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29511")
    with atomic_dir(tmp_path / "ckpt", every_rank=False) as out:
        assert out.name == f".ckpt.tmp-{os.getpid()}"
    with atomic_dir(tmp_path / "stage") as out:
        assert out.name == ".stage.tmp-29511"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "stage"]


# ------------------------------------------------------------------------ the chain on 2 CPU processes (gloo)
DDP = ["device=cpu-ddp", "device.num_processes=2", "device.threads=1"]
# a few hundred training rows: each process tokenizes all of them, and 10 steps need no more than that
ROWS = "data.max_rows=256"
# held-out rows: 74 sequences of SFT (both answers), not a multiple of 2 processes × 16, so the eval gathers a
# padded last batch
HELD_OUT = "data.max_eval_rows=37"
# the chain's PPO run, checkpointed at every update: test_two_process_ppo_counts_outputs_and_resume resumes it
PPO = ["ppo.total_episodes=128", "ppo.num_mini_batches=1", "ppo.sample_every=1", "ppo.save_every=1", HELD_OUT]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    run = root / "runs" / "tiny"
    rc, out, err = rlhf(root, "sft", *DDP, ROWS, HELD_OUT, "sft.max_steps=10", "sft.eval_steps=5", "sft.logging_steps=5")
    assert rc == 0, err[-3000:]
    assert "accelerate launch" in out + err and "--num_processes 2" in out + err  # through the launcher
    rc, out, err = rlhf(root, "reward", *DDP, ROWS, HELD_OUT, "reward.max_steps=10", "reward.eval_steps=5")
    assert rc == 0, err[-3000:]
    # rank 0 prints the result line, rank 1's stdout is silenced
    assert sum(line.startswith("reward: held-out accuracy") for line in out.splitlines()) == 1
    rc, out, err = rlhf(root, "ppo", *DDP, *PPO)
    assert rc == 0, err[-3000:]
    return root, run


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_two_process_sft_and_reward_outputs(chain):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root, run = chain
    sft = read(run / "sft" / "metrics.json")
    assert sft["steps"] == 10
    model = AutoModelForCausalLM.from_pretrained(run / "sft")
    assert sum(p.numel() for p in model.parameters()) > 0
    rw = read(run / "reward" / "metrics.json")
    assert rw["steps"] == 10 and rw["eval_accuracy"] is not None
    stats = read(run / "reward" / "score_stats.json")
    assert stats["n"] == 2 * 256 and stats["std"] > 0  # both answers of every training pair (data.max_rows)
    AutoModelForSequenceClassification.from_pretrained(run / "reward", num_labels=1)
    # no temporary or half-renamed directories left by either rank
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_two_process_eval_loss_matches_one_process(chain):
    """Before training the model is the same, so the evaluation (sharded over 2 ranks, gathered) must agree
    with a 1-process run on the same base."""
    root, run = chain
    one = root / "one"
    rc, _, err = one_process(root, "sft", f"run_dir={one}", f"model.tiny.dir={run / 'base'}", "device.threads=1",
                      "sft.max_steps=1", "sft.eval_steps=100", "data.max_rows=64", HELD_OUT)
    assert rc == 0, err[-3000:]
    a = read(run / "sft" / "metrics.json")["eval_loss_start"]
    b = read(one / "sft" / "metrics.json")["eval_loss_start"]
    assert a == pytest.approx(b, abs=2e-3)


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_two_process_ppo_counts_outputs_and_resume(chain):
    from peft import AutoPeftModelForCausalLM

    root, run = chain
    m = read(run / "ppo" / "metrics.json")
    # 2 processes × 32 episodes per update: 2 updates cover the 128 episodes, as 4 updates do on one process
    assert m["total_episodes"] == 128 and m["world_size"] == 2 and m["updates"] == 2
    for key in ("objective/kl", "objective/scores", "loss/policy_avg", "val/num_eos_tokens"):
        assert key in m and m[key] == m[key]  # present and not NaN
    assert (run / "ppo" / "checkpoints" / "checkpoint-2" / "trainer_state.json").is_file()
    assert list((run / "ppo" / "tensorboard").iterdir())
    with contextlib.chdir(run / "ppo"):  # the base is recorded relative to the adapter
        AutoPeftModelForCausalLM.from_pretrained(".")
    # an interrupted 2-process run (the chain's, killed after checkpoint 1) resumes on 2 processes and ends as the
    # whole run
    out = run / "ppo-resumed"
    whole = read(run / "ppo" / "metrics.json")
    partial = run / ".ppo-resumed.partial"
    shutil.copytree(run / "ppo", partial)
    shutil.rmtree(partial / "checkpoints" / "checkpoint-2")
    (partial / "metrics.json").unlink()
    rc, out_, err = rlhf(root, "ppo", *DDP, *PPO, f"ppo.output_dir={out}", "ppo.resume=true")
    assert rc == 0, err[-3000:]
    assert "resumed from" in out_ + err and "checkpoint-1" in out_ + err
    m = read(out / "metrics.json")
    assert m["total_episodes"] == whole["total_episodes"] == 128 and m["updates"] == 2
    st = read(out / "checkpoints" / "checkpoint-2" / "trainer_state.json")
    assert len(st["prompts_consumed"]) == 2 and len(st["rng"]) == 2  # one entry per rank
    assert not list(out.rglob("*.pt"))  # nothing pickled
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_a_failing_started_process_ends_the_run_with_its_one_line_error(chain):
    root, run = chain
    missing = root / "no-such-policy"
    rc, out, err = rlhf(root, "ppo", *DDP, f"ppo.policy_dir={missing}", f"ppo.output_dir={run / 'ppo-failed'}")
    assert rc == 2, err[-3000:]  # the started processes' exit code (a configuration error), not the launcher's 1
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and str(missing) in errors[0], err[-3000:]  # both ranks failed alike: said once
    assert not errors[0].split(": error: ", 1)[1].startswith("rank"), errors  # by every process: no rank named
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert "failed (exitcode" not in err, err[-3000:]  # torch's agent does not report it again
    assert not (run / "ppo-failed").exists()


@pytest.mark.dist
@pytest.mark.slow
@LONG_TEST
def test_two_process_fsdp_sft_saves_full_weights(chain):
    """FSDP2 through accelerate and trl (gloo on the CPU): the sharded weights are gathered into one plain
    model directory that loads like the DDP one."""
    from safetensors.torch import load_file

    root, run = chain
    out = root / "fsdp-sft"
    rc, _, err = rlhf(root, "sft", "device=fsdp", "device.accelerator=cpu", "device.threads=1",
                      "device.num_processes=2", "sft.max_steps=4", "sft.eval_steps=100", ROWS, HELD_OUT,
                      f"sft.output_dir={out}")
    assert rc == 0, err[-3000:]
    assert read(out / "metrics.json")["steps"] == 4
    full, ddp = load_file(str(out / "model.safetensors")), load_file(str(run / "sft" / "model.safetensors"))
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in ddp.items()}


# ------------------------------------------------------------------------ no process outlives a killed run
def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _workers(parent: psutil.Process) -> list[psutil.Process]:
    """The processes a launch started to run the stage: they carry the launcher's LOCAL_RANK."""
    found = []
    for c in parent.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "LOCAL_RANK" in c.environ() and "rlhf_cli.cli" in c.cmdline():
                found.append(c)
    return found


@pytest.mark.dist
@pytest.mark.timeout(2 * SAFETY_S)
def test_killing_rlhf_ends_every_process_of_the_run(tmp_path):
    """SIGKILL of the `rlhf` process (what a subprocess timeout does) leaves neither `accelerate launch` nor
    its workers behind, one of them waiting in a collective for a peer that is gone."""
    base = tmp_path / "base"
    log = tmp_path / "rlhf.log"
    args = ["sft", *DDP, f"model.tiny.dir={base}", "sft.max_steps=100000", "sft.eval_steps=100000",
            "sft.logging_steps=100000"]
    with log.open("w") as out, rlhf_process(tmp_path, *args, stdout=out, stderr=subprocess.STDOUT) as p:
        parent = psutil.Process(p.pid)
        deadline = time.monotonic() + SAFETY_S
        # both workers exist and are inside the stage (the tiny base model is built there)
        while len(_workers(parent)) < 2 or not (base / "config.json").exists():
            assert p.poll() is None, f"the run ended early (exit {p.returncode}): {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no 2 running workers after {SAFETY_S} s"
            time.sleep(0.2)
        tree = parent.children(recursive=True)  # accelerate launch and its workers
        assert len(_workers(parent)) == 2 and len(tree) >= 3, [c.cmdline() for c in tree]
        p.kill()
        p.wait()
        deadline = time.monotonic() + 120  # a safety net, not a speed requirement
        while time.monotonic() < deadline and not all(_gone(c) for c in tree):
            time.sleep(0.1)
        left = [c for c in tree if not _gone(c)] + [c for c in _tagged(p.tag) if not _gone(c)]
        assert not left, [(c.pid, " ".join(c.cmdline())[:200]) for c in left if not _gone(c)]
