"""Checkpoints and resume of the trl stages. Through the real CLI on the tiny recipe (slow): `kill -9` of
`rlhf sft` (and of `rlhf reward`) at about half way, then `<stage>.resume=true`, ends with the same model as an
uninterrupted run; SIGTERM ends a stage with one line naming what continues it; what is refused on resume. In
process: a resume reads the checkpoint's .pt/.pth files with weights_only=True only, and refuses a pickle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from clitools import EVAL_ROWS, RLHF, cli_env, rlhf

STEPS, EVERY = 20, 5
# 20 steps, a checkpoint every 5, evaluations only at the start and at the end; 400 training rows, one epoch of
# batches of 16 (every run tokenizes all its rows: the whole demo file would be 3,000)
SMALL = ["device.threads=1", f"sft.max_steps={STEPS}", f"sft.save_steps={EVERY}", f"sft.eval_steps={STEPS}",
         f"reward.max_steps={STEPS}", f"reward.save_steps={EVERY}", f"reward.eval_steps={STEPS}", "data.max_rows=400", EVAL_ROWS]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one-line error on stderr (and no traceback)."""
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ": error:" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def start(cwd: Path, *args: str) -> subprocess.Popen:
    """`rlhf` in its own process group (so a kill reaches everything it started)."""
    return subprocess.Popen([str(RLHF), *args], cwd=cwd, env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_checkpoint(proc: subprocess.Popen, partial: Path, step: int, timeout: float = 900) -> Path:
    """Poll until a complete checkpoint at `step` or later is in `partial`; the run must still be going."""
    from rlhf_cli.stages._common import latest_checkpoint

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ckpt = latest_checkpoint(partial)
        if ckpt is not None and int(ckpt.name.split("-")[1]) >= step:
            return ckpt
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before checkpoint-{step}: "
                        f"{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no checkpoint-{step} in {partial} after {timeout} s")


def weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def assert_same_model(a: Path, b: Path) -> None:
    """Every tensor of b/model.safetensors equals a's exactly (same machine, same seed, one thread)."""
    import torch

    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    worst = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), f"largest difference {worst:g}"


slow = pytest.mark.slow


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """Uninterrupted sft and reward runs: the reference, and the base model and SFT model the others start from."""
    cwd = tmp_path_factory.mktemp("whole")
    ok(rlhf(cwd, "sft", *SMALL))
    ok(rlhf(cwd, "reward", *SMALL))
    return cwd


def pinned(whole: Path) -> list[str]:
    """The reference run's base model and SFT model, so that every run below starts from the same files."""
    runs = whole / "runs" / "tiny"
    return [f"model.tiny.dir={runs / 'base'}", f"reward.init_from={runs / 'sft'}"]


def kill_at_half_and_resume(whole: Path, cwd: Path, stage: str) -> tuple[Path, subprocess.CompletedProcess]:
    out = cwd / "runs" / "tiny" / stage
    partial = out.parent / f".{stage}.partial"
    proc = start(cwd, stage, *SMALL, *pinned(whole))
    ckpt = wait_for_checkpoint(proc, partial, STEPS // 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert int(ckpt.name.split("-")[1]) < STEPS and not out.exists()  # killed before the end: nothing published
    assert not list(ckpt.glob("*.bin"))  # training_args.bin (a pickle) is not kept
    resumed = ok(rlhf(cwd, stage, *SMALL, *pinned(whole), f"{stage}.resume=true"))
    return out, resumed


@slow
@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_kill_at_half_then_resume_ends_with_the_uninterrupted_model(whole, tmp_path, stage):
    out, resumed = kill_at_half_and_resume(whole, tmp_path, stage)
    assert f"{stage}: resuming from" in resumed.stdout + resumed.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    reference = json.loads((whole / "runs" / "tiny" / stage / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and metrics["resumed_from"] is not None and 0 < metrics["resumed_from"] < STEPS
    assert_same_model(whole / "runs" / "tiny" / stage, out)
    key = "eval_loss_end" if stage == "sft" else "eval_accuracy"
    assert metrics[key] == reference[key]
    if stage == "sft":
        assert metrics["eval_loss_start"] == reference["eval_loss_start"]  # kept from before the kill
    else:
        assert metrics["score_mean"] == reference["score_mean"]
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))  # both parts' events, in the output
    assert not (out.parent / f".{stage}.partial").exists()  # published: the checkpoints are gone


@slow
def test_sigterm_prints_one_line_naming_the_checkpoint_and_exits_143(whole, tmp_path):
    out = tmp_path / "runs" / "tiny" / "sft"
    proc = start(tmp_path, "sft", *SMALL, *pinned(whole))
    ckpt = wait_for_checkpoint(proc, out.parent / ".sft.partial", EVERY)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    line = [ln for ln in err.splitlines() if ": error:" in ln]
    assert len(line) == 1 and "terminated (SIGTERM); sft.resume=true continues from checkpoint-" in line[0], err[-2000:]
    assert int(line[0].rsplit("checkpoint-", 1)[1].split()[0]) >= int(ckpt.name.split("-")[1])
    assert not out.exists() and not list(out.parent.glob(".sft.tmp-*"))  # the half-built output is removed

    # the interrupted run is never deleted silently: a plain rerun is refused, naming both ways on
    line = error_line(rlhf(tmp_path, "sft", *SMALL, *pinned(whole)))
    assert "interrupted run" in line and "sft.resume=true" in line and "sft.fresh=true" in line
    # a changed key that shapes the run is refused on resume, naming it
    line = error_line(rlhf(tmp_path, "sft", *SMALL, *pinned(whole), "sft.resume=true", "sft.learning_rate=0.5"))
    assert "sft.learning_rate was 0.001" in line and "is 0.5 now" in line
    assert (out.parent / ".sft.partial").is_dir() and not out.exists()


@slow
def test_sigterm_before_the_first_checkpoint_leaves_nothing(whole, tmp_path):
    out = tmp_path / "runs" / "tiny" / "reward"
    proc = start(tmp_path, "reward", *SMALL, *pinned(whole), "reward.save_steps=0")
    deadline = time.monotonic() + 600
    while not list((out.parent / ".reward.partial").rglob("events.out.tfevents.*")):  # training has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("rlhf reward: error: terminated (SIGTERM); no checkpoint yet "
                                                   "(reward.save_steps=0)"), err[-2000:]
    assert not out.exists() and not [p.name for p in out.parent.iterdir() if p.name.startswith(".reward.")]


@slow
def test_resume_refusals(whole, tmp_path):
    line = error_line(rlhf(whole, "sft", *SMALL, "sft.resume=true"))  # finished: nothing to continue
    assert "finished run" in line and "drop sft.resume=true" in line
    line = error_line(rlhf(tmp_path, "reward", *SMALL, *pinned(whole), "reward.resume=true"))
    assert "no checkpoint to resume" in line
    line = error_line(rlhf(tmp_path, "sft", *SMALL, "sft.resume=true", "sft.fresh=true"))
    assert "give one of them" in line


# ------------------------------------------------------------------------------------------------ in process
class NotATensor:
    """Stands for any class a pickle could name (torch.load would import and build it)."""


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    from rlhf_cli.tiny import build_tiny_base

    return build_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


def sft_run(run_dir: Path, tiny_base: Path, *overrides: str):
    """(Checkpoints, trainer) of a 4-step SFT on 64 rows with a checkpoint every 2 steps."""
    from rlhf_cli.config import compose
    from rlhf_cli.hardware import setup_torch
    from rlhf_cli.resume import run_shape
    from rlhf_cli.settings import of
    from rlhf_cli.stages import sft
    from rlhf_cli.stages._common import Checkpoints

    cfg = compose("sft", [f"run_dir={run_dir}", f"model.tiny.dir={tiny_base}", "device.threads=1",
                          "data.max_rows=64", EVAL_ROWS, "sft.max_steps=4", "sft.save_steps=2", "sft.eval_steps=4", *overrides])
    setup_torch(of(cfg))
    ckpt = Checkpoints.start(of(cfg), "sft", run_shape(cfg, "sft"))
    return ckpt, sft.build_trainer(of(cfg), ckpt.work)[0]


def test_resume_reads_checkpoint_files_with_weights_only_and_refuses_a_pickle(tmp_path, tiny_base, monkeypatch):
    import torch

    from rlhf_cli.errors import RlhfError

    ckpt, trainer = sft_run(tmp_path, tiny_base)
    ckpt.train(trainer)
    work = ckpt.work
    assert sorted(p.name for p in work.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert not list(work.rglob("training_args.bin"))
    (work / "checkpoint-4" / "trainer_state.json").unlink()  # as if killed while writing it: not complete

    calls = []
    load = torch.load

    def spy(f, *args, **kwargs):
        calls.append((Path(f).name, kwargs.get("weights_only"), os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")))
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    ckpt, trainer = sft_run(tmp_path, tiny_base, "sft.resume=true")
    assert ckpt.resume_from == work / "checkpoint-2"
    assert ckpt.train(trainer).global_step == 4
    assert sorted(name for name, _, _ in calls) == ["optimizer.pt", "rng_state.pth", "scheduler.pt"]
    assert all(wo is True and forced == "1" for _, wo, forced in calls), calls
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # only for the resume

    # a checkpoint file that needs pickle (an object of some class) is refused in one line naming the checkpoint
    rng = work / "checkpoint-4" / "rng_state.pth"
    torch.save({"python": NotATensor()}, rng)
    ckpt, trainer = sft_run(tmp_path, tiny_base, "sft.resume=true")
    with pytest.raises(RlhfError, match=r"checkpoint-4 holds pickled objects, which rlhf does not load"):
        ckpt.train(trainer)


@slow
def test_a_reward_resume_onto_a_retrained_sft_names_its_identity(whole, tmp_path):
    """The reward run started from an SFT model that was retrained since (same path, other weights): the resume
    is one line naming reward.init_from's identity, and the interrupted run is left as it was."""
    import hashlib
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    init = tmp_path / "sft-model"
    shutil.copytree(whole / "runs" / "tiny" / "sft", init)
    args = [*SMALL, f"model.tiny.dir={whole / 'runs' / 'tiny' / 'base'}", f"reward.init_from={init}"]
    partial = tmp_path / "runs" / "tiny" / ".reward.partial"
    proc = start(tmp_path, "reward", *args)
    wait_for_checkpoint(proc, partial, EVERY)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    tensors = load_file(str(init / "model.safetensors"))
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in tensors.items()},
              str(init / "model.safetensors"), metadata={"format": "pt"})
    assert not torch.equal(next(iter(tensors.values())), next(iter(load_file(str(init / "model.safetensors")).values())))

    def tree() -> dict:
        return {str(f.relative_to(partial)): hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(partial.rglob("*")) if f.is_file()}

    before = tree()
    line = error_line(rlhf(tmp_path, "reward", *args, "reward.resume=true"))
    assert "reward.init_from identity was" in line and "reward.fresh=true" in line, line
    assert tree() == before


@slow
def test_an_sft_resume_after_its_data_file_was_rewritten_names_it(tmp_path):
    """The data file rewritten in place (one row more) between the kill and the resume: one line naming
    data.train_path's content, and the interrupted run is left as it was."""
    import hashlib
    import shutil

    import rlhf_cli

    data = tmp_path / "pairs.jsonl"
    shutil.copy(Path(rlhf_cli.__file__).parent / "demo" / "data" / "polite_train.jsonl", data)
    args = [*SMALL, "data.train_path=pairs.jsonl", "run_dir=runs/tiny"]
    partial = tmp_path / "runs" / "tiny" / ".sft.partial"
    proc = start(tmp_path, "sft", *args)
    wait_for_checkpoint(proc, partial, EVERY)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    first = data.read_text(encoding="utf-8").splitlines()[0]
    with data.open("a", encoding="utf-8") as fh:
        fh.write(first + "\n")

    def tree() -> dict:
        return {str(f.relative_to(partial)): hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(partial.rglob("*")) if f.is_file()}

    before = tree()
    line = error_line(rlhf(tmp_path, "sft", *args, "sft.resume=true"))
    assert line.startswith("rlhf sft: error: sft.resume=true: data.train_path sha256 was "), line
    assert line.endswith("resume with the same value, or start over with sft.fresh=true"), line
    assert tree() == before
