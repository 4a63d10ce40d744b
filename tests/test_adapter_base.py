"""Adapters know their base (issue 41): a PPO adapter records the content identity of the SFT model it was
trained on (adapter_base.json); after the SFT is retrained in the run, `rlhf export` and `rlhf chat` refuse to put
the old adapter on the new base in one line naming both, and leave the outputs as they were;
`model.adapter_base_check=false` loads it on purpose. Through the real command on the tiny-rule recipe."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from clitools import EVAL_ROWS, rlhf

from rlhf_cli.identity import identity

pytestmark = pytest.mark.slow
RUN = Path("runs") / "tiny-rule"
PPO = ["recipe=tiny-rule", "device.threads=1", "ppo.total_episodes=64", "ppo.num_mini_batches=1", "ppo.eval_every=0"]
ROWS = "data.max_rows=64"  # the SFT runs' few steps of 16 (every run tokenizes all its rows)


def ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def retrained(tmp_path_factory):
    """A run whose PPO adapter was trained on an SFT model that was then retrained: (cwd, identity then, now)."""
    cwd = tmp_path_factory.mktemp("adapter")
    ok(rlhf(cwd, "sft", "recipe=tiny-rule", "device.threads=1", "sft.max_steps=2", "sft.eval_steps=2", ROWS, EVAL_ROWS))
    ok(rlhf(cwd, "ppo", *PPO))
    then = identity(cwd / RUN / "sft")
    assert json.loads((cwd / RUN / "ppo" / "adapter_base.json").read_text())["identity"] == then
    ok(rlhf(cwd, "sft", "recipe=tiny-rule", "device.threads=1", "sft.max_steps=3", "sft.eval_steps=3", ROWS, EVAL_ROWS))
    now = identity(cwd / RUN / "sft")
    assert now != then
    return cwd, then, now


def tree(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file() and "logs" not in f.relative_to(directory).parts}


@pytest.mark.parametrize("command", [["export"], ["chat", "prompt=Hello"]])
def test_an_adapter_on_a_retrained_base_is_one_line(run_cli, retrained, command):
    cwd, then, now = retrained
    before = tree(cwd / "runs")
    rc, out, err = run_cli(*command, "recipe=tiny-rule", "device.threads=1", cwd=cwd)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc != 0 and "Traceback" not in out + err and len(lines) == 1, err[-3000:]
    assert lines[0] == (f"rlhf {command[0]}: error: the adapter at {RUN / 'ppo'} was trained on a "
                        f"base of content {then}, but {(cwd / RUN / 'sft').resolve()} now holds {now} (retrained "
                        "since?); retrain the adapter on it, point the config at the base it was trained on, or set "
                        "model.adapter_base_check=false to load it anyway"), lines[0]
    assert tree(cwd / "runs") == before


def test_eval_of_an_adapter_on_a_retrained_base_is_one_line(run_cli, retrained):
    """rlhf eval samples the SFT model first, then meets the PPO adapter: the same one line, nothing written."""
    cwd, then, now = retrained
    before = tree(cwd / "runs")
    rc, out, err = run_cli("eval", "recipe=tiny-rule", "device.threads=1", "eval.num_prompts=4", "eval.reward_dir=null",
                           cwd=cwd)
    errors = [ln for ln in err.splitlines() if ": error:" in ln]
    assert rc != 0 and "Traceback" not in out + err and len(errors) == 1, err[-3000:]
    assert errors[0].endswith(f"rlhf eval: error: the adapter at {RUN / 'ppo'} was trained on a base of content "
                              f"{then}, but {(cwd / RUN / 'sft').resolve()} now holds {now} (retrained since?); "
                              "retrain the adapter on it, point the config at the base it was trained on, or set "
                              "model.adapter_base_check=false to load it anyway"), errors[0]
    assert tree(cwd / "runs") == before


def test_the_check_can_be_turned_off_on_purpose(run_cli, retrained, tmp_path):
    cwd, _, _ = retrained
    rc, _, err = run_cli("export", "recipe=tiny-rule", "device.threads=1", "model.adapter_base_check=false",
                         f"export.output_dir={tmp_path / 'merged'}", cwd=cwd)
    assert rc == 0, err[-3000:]
    assert (tmp_path / "merged" / "config.json").is_file()
