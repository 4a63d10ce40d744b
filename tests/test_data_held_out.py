"""Held-out rows are held out (issue 41): an eval file that is the train file (same path or same bytes) is
refused in one line, `data.eval_ratio=0` holds no row out, and a command that measures on held-out rows says in
one line that there are none. Through the real command; a refused command leaves the directory as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import rlhf_cli
from rlhf_cli.data import load_examples

DEMO = Path(rlhf_cli.__file__).parent / "demo" / "data" / "polite_train.jsonl"


def tree(directory: Path) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def one_line(run_cli, cwd: Path, *args: str) -> str:
    before = tree(cwd)
    rc, out, err = run_cli(*args, "device.threads=1", cwd=cwd)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc != 0 and "Traceback" not in out + err and len(lines) == 1, err[-3000:]
    assert tree(cwd) == before  # nothing written (no run directory, no logs)
    return lines[0]


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_an_eval_file_that_is_the_train_file_is_refused(run_cli, tmp_path, stage):
    train = tmp_path / "train.jsonl"
    shutil.copy(DEMO, train)
    line = one_line(run_cli, tmp_path, stage, f"data.train_path={train}", f"data.eval_path={train}")
    assert line == (f"rlhf {stage}: error: data.eval_path={train} holds the same rows as data.train_path={train}, so "
                    "held-out metrics would be measured on training rows; give another eval file, or "
                    "data.eval_path=null to hold data.eval_ratio of the train file out")
    copy = tmp_path / "copy.jsonl"  # the same bytes under another name
    shutil.copy(DEMO, copy)
    line = one_line(run_cli, tmp_path, stage, f"data.train_path={train}", f"data.eval_path={copy}")
    assert line.startswith(f"rlhf {stage}: error: data.eval_path={copy} holds the same rows as data.train_path=")


@pytest.mark.parametrize("args, use", [
    (["sft"], "rlhf sft measures its eval loss on them"),
    (["dpo"], "rlhf dpo measures its eval loss and accuracy on them"),
    (["ppo", "ppo.eval_every=2"], "ppo.eval_every evaluates on them (ppo.eval_every=0 turns that off)"),
])
def test_eval_ratio_zero_where_the_command_needs_held_out_rows(run_cli, tmp_path, args, use):
    line = one_line(run_cli, tmp_path, *args, "data.eval_path=null", "data.eval_ratio=0")
    assert line == (f"rlhf {args[0]}: error: data.eval_ratio=0 holds no rows out, and {use}: give data.eval_path, "
                    "or data.eval_ratio above 0")


def test_eval_ratio_zero_holds_no_row_out(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"question": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = OmegaConf.create({"train_path": str(path), "eval_path": None, "split": "train", "format": "auto",
                            "system_prompt": None, "max_rows": None, "eval_ratio": 0.0, "split_seed": 0})
    train, evals = load_examples(cfg)
    assert evals == [] and len(train) == 10
    train, evals = load_examples(OmegaConf.merge(cfg, {"eval_ratio": 0.01}))  # any ratio above 0: at least one
    assert len(evals) == 1 and len(train) == 9
