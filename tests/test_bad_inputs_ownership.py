"""Outputs owned by the stage that wrote them, one run per directory, and interrupted work never deleted
silently, through the real `rlhf` command (the bad-input table of tests/test_bad_inputs.py, continued). Each case
ends with a non-zero exit and a single error line that names the folder, what it holds and what to do, without a
traceback, and leaves the earlier outputs byte-identical (their trees are hashed before and after).

The cases of the table need no trained model: the earlier outputs are folders marked as their stage marks them
(`rlhf_cli.io.atomic_dir(path, kind)`), and every stage checks its output directory before it loads a model.
The slow tests train the tiny recipe for two steps (sft, reward) and run PPO for a few updates against that:
two concurrent runs into one directory, and a rerun after an interrupted run.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from clitools import EVAL_ROWS, RLHF, cli_env, rlhf

from rlhf_cli.io import OUTPUT_MARKER, atomic_dir

RUN = Path("runs/tiny")  # the tiny recipe's run_dir, below the test's working directory


@dataclass(frozen=True)
class Case:
    args: str     # what follows `rlhf`, split as a shell would
    needle: str   # text the one error line contains
    rc: int = 2   # RlhfError's exit status


CASES = [
    # another stage's output, which is also an input of the command
    Case("eval eval.output_dir=runs/tiny/ppo",
         "runs/tiny/ppo is an input of `rlhf eval` (it holds the ppo stage's output, written "),
    Case("reward reward.output_dir=runs/tiny/sft",
         "runs/tiny/sft is an input of `rlhf reward` (it holds the sft stage's output, written "),
    Case("export export.output_dir=runs/tiny/sft", "runs/tiny/sft is an input of `rlhf export`"),
    Case("eval eval.output_dir=runs/tiny", "runs/tiny contains runs/tiny/sft, an input of `rlhf eval`"),
    # another stage's output that the command does not read
    Case("sft sft.output_dir=runs/tiny/eval",
         "runs/tiny/eval holds the eval stage's output, written 2"),
    Case("export export.output_dir=runs/tiny/reward", "`rlhf export` replaces only its own output"),
    # checkpoints, and folders inside an output (the user's own, or PPO's)
    Case("export export.output_dir=runs/tiny/ppo/checkpoints",
         "runs/tiny/ppo/checkpoints is inside runs/tiny/ppo, which holds the ppo stage's output"),
    Case("reward reward.output_dir=runs/tiny/.ppo.partial/checkpoints",
         "runs/tiny/.ppo.partial/checkpoints holds PPO checkpoints (checkpoint-1), which rlhf never replaces"),
    Case("sft sft.output_dir=runs/tiny/.ppo.partial/checkpoints/checkpoint-1", "holds a PPO checkpoint"),
    Case("sft sft.output_dir=runs/tiny/reward/notes",
         "runs/tiny/reward/notes is inside runs/tiny/reward, which holds the reward stage's output, written 2"),
    Case("eval eval.output_dir=runs/tiny/reward/notes/eval",
         "an output never goes inside another one: choose another eval.output_dir outside it"),
    Case("eval eval.output_dir=runs/tiny/sft/eval", "runs/tiny/sft/eval is inside runs/tiny/sft"),
    # a marker of an earlier version (no kind): only the stage's own default directory
    Case("eval eval.output_dir=runs/tiny/old_sft",
         "runs/tiny/old_sft holds an rlhf output of an earlier version whose marker names no stage"),
]


# --------------------------------------------------------------------------------------------------- helpers
def tree(root: Path) -> dict[str, str | None]:
    """Every path under `root` with the sha256 of its bytes (None for a directory); Hydra's logs/ (written before
    the stage runs) left out."""
    def hydra_logs(rel: Path) -> bool:
        return rel.parts[:1] == ("logs",) or rel.parts[:3] == (*RUN.parts, "logs")

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*")) if not hydra_logs(p.relative_to(root))}


def one_error_line(proc: subprocess.CompletedProcess, command: str, rc: int = 2) -> str:
    """The run failed with exit `rc` and a single `rlhf <command>: error: ...` line as its last, no traceback."""
    assert proc.returncode == rc, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    assert errors[0].startswith(f"rlhf {command}: error: "), errors[0]
    return errors[0]


def mark(path: Path, kind: str, files: dict[str, str]) -> Path:
    """A folder as the `kind` stage leaves it: marked, with `files`."""
    with atomic_dir(path, kind) as out:
        for name, text in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_text(text)
    return path


def earlier_outputs(cwd: Path) -> None:
    """runs/tiny as a finished chain leaves it (sft, reward, ppo with a checkpoint, eval), plus an interrupted
    PPO run, a user's folder inside the reward output, and an output of a version before kinds."""
    run = cwd / RUN
    mark(run / "sft", "sft", {"config.json": "{}", "model.safetensors": "sft weights"})
    mark(run / "reward", "reward", {"config.json": "{}", "score_stats.json": '{"std": 1}'})
    mark(run / "ppo", "ppo", {"adapter_config.json": "{}", "adapter_model.safetensors": "adapter",
                              "checkpoints/checkpoint-1/trainer_state.json": "{}"})
    mark(run / "eval", "eval", {"report.json": "{}"})
    mark(run / ".ppo.partial" / "checkpoints" / "checkpoint-1", "checkpoint", {"trainer_state.json": "{}"})
    (run / "reward" / "notes").mkdir()
    (run / "reward" / "notes" / "mine.txt").write_text("my own notes")
    (run / "old_sft").mkdir()
    (run / "old_sft" / "model.safetensors").write_text("old weights")
    (run / "old_sft" / OUTPUT_MARKER).write_text(json.dumps({"written_by": "rlhf", "time": "2024-05-01"}))


# ------------------------------------------------------------------------------- the table: no model needed
@pytest.mark.parametrize("case", CASES, ids=[c.args for c in CASES])
def test_an_output_that_is_not_the_stage_own_is_refused(case, tmp_path):
    earlier_outputs(tmp_path)
    before = tree(tmp_path)
    argv = shlex.split(case.args)
    line = one_error_line(rlhf(tmp_path, *argv, "device.threads=1"), argv[0], case.rc)
    assert case.needle in line, (case.needle, line)
    assert tree(tmp_path) == before  # every earlier output byte-identical; no lock, tmp or new folder left


def test_cases_cover_every_command_that_writes():
    assert {c.args.split()[0] for c in CASES} == {"sft", "reward", "eval", "export"}  # ppo: the slow tests
    assert len({c.args for c in CASES}) == len(CASES)


# --------------------------------------------------------------------- PPO against a two-step sft and reward
# the tiny recipe evaluates after the last update: on 32 held-out prompts (EVAL_ROWS), not 256
SMALL_PPO = ["device.threads=1", "ppo.total_episodes=64", "ppo.num_mini_batches=1", "ppo.save_every=1", EVAL_ROWS]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A working directory with runs/tiny/sft and runs/tiny/reward, trained for two steps each (on 64 rows: two
    batches of 16 need no more)."""
    cwd = tmp_path_factory.mktemp("own")
    for stage in ("sft", "reward"):
        proc = rlhf(cwd, stage, "device.threads=1", f"{stage}.max_steps=2", f"{stage}.eval_steps=2", EVAL_ROWS,
                    "data.max_rows=64")
        assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


def inputs_of(cwd: Path) -> dict:
    return {name: tree(cwd / RUN / name) for name in ("sft", "reward")}


def planted_interrupted_run(cwd: Path, name: str) -> Path:
    """`.<name>.partial` as a killed PPO run leaves it: checkpoint-7 and TensorBoard events."""
    partial = cwd / RUN / f".{name}.partial"
    mark(partial / "checkpoints" / "checkpoint-7", "checkpoint", {"trainer_state.json": '{"update": 7}',
                                                                 "adapter_model.safetensors": "weights"})
    (partial / "tensorboard").mkdir()
    (partial / "tensorboard" / "events.out.tfevents.1").write_bytes(b"\x00events")
    return partial


# the first run's reward function: it scores once ./GO exists, so the first run is still going while the second
# tries, however slow the machine (a safety net of 10 minutes ends it with an error instead of hanging)
HELD = '''
import time
from pathlib import Path


def score(prompts, responses, **kw):
    deadline = time.monotonic() + 600
    while not Path("GO").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("no GO file after 10 minutes")
        time.sleep(0.05)
    return [0.0 for _ in responses]
'''


@pytest.mark.slow
def test_a_second_concurrent_run_exits_at_once_naming_the_first(chain):
    out, lock = chain / RUN / "ppo-two", chain / RUN / ".ppo-two.lock"
    before = inputs_of(chain)
    (chain / "held.py").write_text(HELD, encoding="utf-8")
    with open(chain / "first.log", "w") as log:  # a file, not a pipe: the progress bar would fill a pipe
        first = subprocess.Popen([str(RLHF), "ppo", *SMALL_PPO, "ppo.save_every=0", "ppo.reward=[held.py:score]",
                                  f"ppo.output_dir={RUN}/ppo-two"], cwd=chain, env=cli_env(), stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (lock.exists() and lock.read_text().strip()):
            assert first.poll() is None, (chain / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run never took its lock"
            time.sleep(0.2)
        assert json.loads(lock.read_text())["pid"] == first.pid
        second = rlhf(chain, "ppo", *SMALL_PPO, f"ppo.output_dir={RUN}/ppo-two")
        assert first.poll() is None  # the second did not wait for the first
        line = one_error_line(second, "ppo")
        assert f"{RUN}/ppo-two is in use by another run: pid {first.pid} on {socket.gethostname()}, `rlhf ppo " \
               in line and "ppo.reward=[held.py:score]" in line and ", since 20" in line, line
        assert not list((chain / RUN).glob(".ppo-two.tmp-*")) and not out.exists()
        (chain / "GO").touch()
        assert first.wait(timeout=1500) == 0, (chain / "first.log").read_text()[-3000:]
    finally:
        (chain / "GO").touch()
        if first.poll() is None:
            first.kill()
            first.wait()
    # the output is the first run's alone, and nothing of the second's is left
    metrics = json.loads((out / "metrics.json").read_text())
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert metrics["total_episodes"] == 64 and marker["pid"] == first.pid and marker["kind"] == "ppo"
    assert not lock.exists() and not (chain / RUN / ".ppo-two.partial").exists()
    assert inputs_of(chain) == before


@pytest.mark.slow
def test_a_rerun_after_an_interrupted_run_is_refused(chain):
    partial = planted_interrupted_run(chain, "ppo-three")
    before = tree(chain / RUN)
    line = one_error_line(rlhf(chain, "ppo", *SMALL_PPO, f"ppo.output_dir={RUN}/ppo-three"), "ppo")
    assert line.endswith(f"{RUN}/.ppo-three.partial holds an interrupted run (checkpoint-7); continue it with "
                         "ppo.resume=true, or start over with ppo.fresh=true"), line
    line = one_error_line(rlhf(chain, "ppo", *SMALL_PPO, f"ppo.output_dir={RUN}/ppo-three", "ppo.resume=true",
                               "ppo.fresh=true"), "ppo")
    assert "ppo.resume=true continues the interrupted run and ppo.fresh=true deletes it; give one of them" in line
    assert tree(chain / RUN) == before and partial.is_dir()  # its checkpoints and events, lock file none


@pytest.mark.slow
def test_fresh_starts_over(chain):
    planted_interrupted_run(chain, "ppo-four")
    before = inputs_of(chain)
    proc = rlhf(chain, "ppo", *SMALL_PPO, f"ppo.output_dir={RUN}/ppo-four", "ppo.fresh=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr  # the log's lines go to stdout
    assert "ppo.fresh=true: deleting the interrupted run in" in said and "(up to checkpoint-7)" in said, said[-3000:]
    out = chain / RUN / "ppo-four"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert [p.name for p in (out / "tensorboard").iterdir()] != ["events.out.tfevents.1"]
    assert json.loads((out / "metrics.json").read_text())["total_episodes"] == 64
    assert not (chain / RUN / ".ppo-four.partial").exists() and not (chain / RUN / ".ppo-four.lock").exists()
    assert inputs_of(chain) == before
