"""bench/gpu_check.sh, the one prepared call of a lent GPU machine: its header states a call the tool accepts, and
on the CPU (GPU_CHECK_DEVICE=cpu, the tiny demo model) a failing GPU test ends nothing: the chain runs after it,
every file comes back in the output folder, and the exit code says that a step failed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from clitools import cli_env

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.sh"
STAGES = ("sft", "reward", "ppo", "dpo", "eval", "export", "chat")
BACK = {"versions.txt", "pytest.log", "real_check.json", "stages.log", "summary.txt"}  # one GPU: no multi-gpu.log


def header_call() -> tuple[str, list[str], int, int]:
    """(command, carry, timeout_s) as the header states them, and the script's own default budget."""
    text = SCRIPT.read_text(encoding="utf-8")

    def field(name: str) -> str:
        return re.search(rf"^#\s+{name}:\s+(.+?)\s*$", text, re.MULTILINE).group(1)

    budget = re.search(r"^BUDGET=\$\{GPU_CHECK_BUDGET:-(\d+)\}", text, re.MULTILINE).group(1)
    return field("command"), json.loads(field("carry")), int(field("timeout_s")), int(budget)


def test_header_states_a_call_the_tool_takes():
    command, carry, timeout_s, budget = header_call()
    assert len(command) <= 2000 and command.startswith("bash bench/gpu_check.sh") and '"$OUT"' in command
    assert carry == [".whl"]
    assert "/.whl/" in (REPO / "bench" / "gpu_wheels.sh").read_text(encoding="utf-8")  # carry takes ignored paths
    assert 0 < timeout_s <= 600
    assert budget + 30 <= timeout_s  # every step ends in time for the copies before the call is cut off


@pytest.mark.slow
def test_a_failing_gpu_test_still_runs_the_chain_and_brings_back_every_file(tmp_path):
    env = cli_env(GPU_CHECK_DEVICE="cpu", PY=sys.executable, GPU_CHECK_TESTS="tests/data/gpu_check_fails.py",
                  GPU_CHECK_RUN_DIR=str(tmp_path / "run"))
    for name in ("GPU_CHECK_BUDGET", "GPU_CHECK_TEST_LIMIT"):
        env.pop(name, None)
    # started elsewhere, with a relative output folder: the script finds its checkout, the folder is the caller's
    proc = subprocess.run(["bash", str(SCRIPT), "out"], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          check=False, timeout=900)
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode != 0, log
    out = tmp_path / "out"
    files = sorted(out.iterdir())
    assert {f.name for f in files} == BACK and all(f.is_file() and not f.is_symlink() for f in files), log
    assert len(files) <= 8

    pytest_log = (out / "pytest.log").read_text(encoding="utf-8")
    assert "test_fails_on_purpose" in pytest_log and "1 failed, 1 passed, 1 deselected" in pytest_log

    result = json.loads((out / "real_check.json").read_text(encoding="utf-8"))
    assert [s["stage"] for s in result["stages"]] == list(STAGES)
    assert all(s["rc"] == 0 for s in result["stages"]), result["stages"]
    assert result["tiny"] and result["device"] == "cpu" and "partial" not in result

    stages = (out / "stages.log").read_text(encoding="utf-8")
    for stage in STAGES:
        assert f"===== stage {stage}: " in stages
    assert "(not run)" not in stages

    versions = (out / "versions.txt").read_text(encoding="utf-8")
    for name in ("python ", "torch ", "transformers ", "trl ", "peft ", "accelerate ", "hydra-core "):
        assert f"\n{name}" in "\n" + versions, name
    assert "GPU count: 0" in versions

    summary = (out / "summary.txt").read_text(encoding="utf-8")
    rc = dict(re.findall(r"^(\S+)\s+exit (\S+)", summary, re.MULTILINE))
    assert rc["versions"] == "0" and rc["pytest"] == "1" and rc["chain"] == "0" and rc["multi-gpu"] == "-", summary
    assert "result: FAILED (pytest)" in summary
    assert summary.strip() in proc.stdout  # printed too: the call's output tail carries it
    assert not (REPO / "out").exists()
