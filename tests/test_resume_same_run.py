"""A resume continues the same run or names the difference (issue 41), through the real command on the tiny
recipe: a PPO run stopped after its first checkpoint (its reward function fails at the second update) is resumed
with changed settings, a rewritten data file, another seed or another recipe; each difference is one line naming
the key and both values, and the interrupted run is left byte for byte as it was. `ppo.resume=force` continues
with the new values, the KL coefficient included."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from clitools import EVAL_ROWS, rlhf

import rlhf_cli

REWARD = '''
from pathlib import Path


def score(prompts, responses, **kw):
    if Path("FAIL").exists() and Path("SCORED").exists():
        raise ValueError("stopped for the test")
    Path("SCORED").touch()
    return [float(len(r) % 7) / 7 for r in responses]
'''


def ppo_args(reward: Path) -> list[str]:
    """A short PPO run on ./data.jsonl (a copy of the demo data) with the test's reward function."""
    return ["device.threads=1", "ppo.total_episodes=64", "ppo.num_mini_batches=1", "ppo.save_every=1",
            "ppo.eval_every=0", f"ppo.reward=[{reward}:score]", "data.train_path=data.jsonl", "run_dir=runs/tiny"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """(a working directory holding runs/tiny/sft and an interrupted PPO run with checkpoint-1, the PPO args)."""
    root = tmp_path_factory.mktemp("stopped")
    reward = root / "reward_fn.py"
    reward.write_text(REWARD, encoding="utf-8")
    cwd = root / "work"
    cwd.mkdir()
    proc = rlhf(cwd, "sft", "device.threads=1", "sft.max_steps=2", "sft.eval_steps=2", "data.max_rows=64", EVAL_ROWS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copy(Path(rlhf_cli.__file__).parent / "demo" / "data" / "polite_train.jsonl", cwd / "data.jsonl")
    (cwd / "FAIL").touch()
    proc = rlhf(cwd, "ppo", *ppo_args(reward))
    assert proc.returncode != 0 and "stopped for the test" in proc.stderr, proc.stderr[-3000:]
    (cwd / "FAIL").unlink()
    assert (cwd / "runs" / "tiny" / ".ppo.partial" / "checkpoints" / "checkpoint-1").is_dir()
    return cwd, ppo_args(reward)


@pytest.fixture
def run(stopped, tmp_path):
    """A copy of the stopped run's working directory (each test resumes its own)."""
    cwd, args = stopped
    shutil.copytree(cwd, tmp_path / "work", symlinks=True)
    return tmp_path / "work", args


def digest(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory` but the run logs (each command writes its own)."""
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file() and "logs" not in f.relative_to(directory).parts}


def refused(run_cli, cwd: Path, *args: str) -> str:
    """The one error line of a refused `rlhf ppo` in `cwd`, after checking that it changed nothing on disk."""
    before = digest(cwd / "runs")
    rc, _, err = run_cli("ppo", *args, cwd=cwd)
    assert rc != 0 and "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("rlhf ppo: error: ") and sum("error:" in ln for ln in lines) == 1, err[-3000:]
    assert digest(cwd / "runs") == before
    return lines[-1]


CKPT = "runs/tiny/.ppo.partial/checkpoints/checkpoint-1"


def test_a_changed_sampling_or_loss_key_is_named_with_both_values(run_cli, run):
    cwd, args = run
    line = refused(run_cli, cwd, *args, "ppo.resume=true", "ppo.temperature=0.5", "ppo.cliprange=0.3",
                   "ppo.gamma=0.9")
    assert line == (f"rlhf ppo: error: ppo.resume: ppo.cliprange was 0.2 when checkpoint {CKPT} was written and is "
                    "0.3 now (also changed: ppo.gamma 1.0 -> 0.9, ppo.temperature 0.7 -> 0.5); set ppo.cliprange=0.2 "
                    "to resume the run as it was, or ppo.resume=force to continue it with the new values")


def test_a_changed_seed_and_a_rewritten_data_file_are_named(run_cli, run):
    cwd, args = run
    line = refused(run_cli, cwd, *args, "ppo.resume=true", "seed=3")
    assert line.startswith(f"rlhf ppo: error: ppo.resume: seed was 0 when checkpoint {CKPT} was written and is 3 now")
    data = cwd / "data.jsonl"
    with data.open("a", encoding="utf-8") as fh:  # the data file rewritten in place: one row more
        fh.write(data.read_text(encoding="utf-8").splitlines()[0] + "\n")
    line = refused(run_cli, cwd, *args, "ppo.resume=true")
    assert line.startswith("rlhf ppo: error: ppo.resume: data.train_path sha256 was "), line
    assert line.endswith("or ppo.resume=force to continue it with the new values"), line
    rc, out, err = run_cli("ppo", *args, "ppo.resume=force", cwd=cwd, timeout=600)
    assert rc == 0, err[-3000:]
    assert "ppo.resume=force: data.train_path sha256 was" in out + err


def test_another_recipe_names_the_key_the_user_changed(run_cli, run):
    cwd, args = run
    line = refused(run_cli, cwd, *args, "ppo.resume=true", "recipe=tiny-grpo")
    assert line.startswith(f"rlhf ppo: error: ppo.resume: ppo.advantage was gae when checkpoint {CKPT} was written "
                           "and is grpo now, which changes ppo.value_lora"), line
    assert line.endswith("set ppo.advantage=gae to resume, or drop ppo.resume to start a new run")


def test_force_continues_with_the_new_kl_coef(run_cli, run):
    cwd, args = run
    saved = json.loads((cwd / CKPT / "trainer_state.json").read_text())["kl_ctl"]["value"]
    assert saved != 0.2
    rc, out, err = run_cli("ppo", *args, "ppo.resume=force", "ppo.kl_coef=0.2", cwd=cwd, timeout=600)
    assert rc == 0, err[-3000:]
    assert "the KL controller restarts at kl_coef=0.2" in out + err
    metrics = json.loads((cwd / "runs" / "tiny" / "ppo" / "metrics.json").read_text())
    assert metrics["kl_coef"] == 0.2, metrics


def test_a_retrained_sft_model_is_named_on_resume(run_cli, run):
    cwd, args = run
    rc, _, err = run_cli("sft", "device.threads=1", "sft.max_steps=3", "sft.eval_steps=3", "data.max_rows=64", EVAL_ROWS,
                         "run_dir=runs/tiny", cwd=cwd)
    assert rc == 0, err[-3000:]
    line = refused(run_cli, cwd, *args, "ppo.resume=true")
    assert line.startswith("rlhf ppo: error: ppo.resume: ppo.policy_dir identity was "), line
    assert line.endswith("or ppo.resume=force to continue it with the new values"), line
