"""Checked checkpoints for the trl stages (issue 41): an sft checkpoint gets checksums when it is written, and a
resume checks every file before the trainer loads any: flipped bytes, a weights file holding other tensors
(transformers would load it non-strictly and go on from the base weights) and a truncated optimizer.pt are each
one line naming the file and what to do, and leave the interrupted run as it was. A garbage best.json of a PPO
run is one line naming it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from test_resume_sft_reward import SMALL, start, wait_for_checkpoint

from rlhf_cli.errors import RlhfError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A working directory with an sft run killed (kill -9) after a checkpoint: (cwd, its checkpoint)."""
    cwd = tmp_path_factory.mktemp("killed")
    partial = cwd / "runs" / "tiny" / ".sft.partial"
    proc = start(cwd, "sft", *SMALL)
    ckpt = wait_for_checkpoint(proc, partial, 5)
    while not (ckpt / "checksums.json").is_file() and proc.poll() is None:  # written just after trainer_state.json
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    return cwd, ckpt.relative_to(cwd)


@pytest.fixture
def run(killed, tmp_path):
    cwd, ckpt = killed
    shutil.copytree(cwd, tmp_path / "work", symlinks=True)
    return tmp_path / "work", tmp_path / "work" / ckpt


def tree(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file() and "logs" not in f.relative_to(directory).parts}


def refused(run_cli, cwd: Path) -> str:
    """The one error line of a refused resume, which leaves the interrupted run's files as they were (the killed
    process's lock and half-assembled output are cleared, as by any later run)."""
    partial = cwd / "runs" / "tiny" / ".sft.partial"
    before = tree(partial)
    rc, out, err = run_cli("sft", *SMALL, "sft.resume=true", cwd=cwd)
    lines = [ln for ln in err.splitlines() if ": error:" in ln]
    assert rc != 0 and "Traceback" not in out + err and len(lines) == 1, err[-3000:]
    assert tree(partial) == before
    return lines[0]


def test_the_checkpoint_has_checksums_of_its_files(killed):
    cwd, ckpt = killed
    listed = json.loads((cwd / ckpt / "checksums.json").read_text())["sha256"]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(listed)


def test_flipped_bytes_are_named(run_cli, run):
    cwd, ckpt = run
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert refused(run_cli, cwd) == (f"rlhf sft: error: checkpoint {ckpt.relative_to(cwd)} is damaged "
                                     "(model.safetensors checksum mismatch); delete it to resume from the previous "
                                     "one")


def test_a_garbage_trainer_state_is_named_not_passed_over(run_cli, run):
    """A complete checkpoint (its checksums written) whose trainer_state.json was damaged afterwards is named, not
    skipped for an earlier one without a word."""
    cwd, ckpt = run
    (ckpt / "trainer_state.json").write_text("{garbage", encoding="utf-8")
    assert refused(run_cli, cwd) == (f"rlhf sft: error: checkpoint {ckpt.relative_to(cwd)} is damaged "
                                     "(trainer_state.json checksum mismatch); delete it to resume from the previous "
                                     "one")


def test_a_weights_file_with_other_tensors_is_refused_before_it_loads(run_cli, run):
    import torch
    from safetensors.torch import save_file

    from rlhf_cli.ppo.checkpoint import write_checksums

    cwd, ckpt = run
    save_file({"something.else": torch.zeros(3)}, str(ckpt / "model.safetensors"))
    write_checksums(ckpt)  # consistent checksums: only the key check can tell
    line = refused(run_cli, cwd)
    assert line.startswith(f"rlhf sft: error: checkpoint file {ckpt.relative_to(cwd)}/model.safetensors does not "
                           "match this run (missing: "), line
    assert "not expected: something.else" in line and line.endswith("to resume from an earlier checkpoint")


def test_a_truncated_optimizer_file_is_named(run_cli, run):
    cwd, ckpt = run
    optimizer = ckpt / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    line = refused(run_cli, cwd)
    assert line.startswith(f"rlhf sft: error: sft.resume=true: checkpoint file {ckpt.relative_to(cwd)}/optimizer.pt "
                           "is unreadable ("), line
    assert line.endswith(f"delete {ckpt.relative_to(cwd)} to resume from an earlier checkpoint, or start over with "
                         "sft.fresh=true")


def test_a_garbage_best_json_is_named(tmp_path):
    from rlhf_cli.ppo.evaluation import read_best

    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(RlhfError) as e:
        read_best(tmp_path / "best")
    assert str(e.value) == (f"{tmp_path / 'best' / 'best.json'} is unreadable (JSONDecodeError); delete "
                            f"{tmp_path / 'best'} (the best update so far is then chosen again from here on), or start "
                            "over with ppo.fresh=true")
