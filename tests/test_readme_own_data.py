"""The README's "Using your own data" commands, run as written (issue 42): every line of the section's bash block,
in bash, in an empty directory holding the files those lines name (a 200-row file of preference pairs with an
`answer` field, a held-out file) and the section's checks.py, its python block as it stands. A README changed to a
command that does not work fails here.

`make` is the checkout's Makefile on this interpreter's environment (`-o` keeps it from installing anything), and
the shipped `tiny` recipe is hidden by a short one through $RLHF_RECIPES, a knob the README does not need: as
written, the two `make chain` lines train the SFT floor of 500 steps and 64 PPO updates each (about 15 minutes on
2 cores), which is no test; here each stage runs a few steps and the whole section takes a few minutes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_cli.config import PACKAGE_DIR

ROOT = PACKAGE_DIR.parent
SHORT_TINY = """# @package _global_
# the shipped tiny recipe with a few steps per stage (tests/test_readme_own_data.py)
defaults:
  - tiny
  - _self_
sft: {max_steps: 10, eval_steps: 10}
reward: {max_steps: 10, eval_steps: 10}
ppo: {total_episodes: 64, eval_every: 0}
eval: {num_prompts: 16}
"""


def own_data_section(readme: str) -> tuple[list[str], str]:
    """(the command lines of the section's first bash block, its first python block)."""
    section = readme.split("\n## Using your own data\n", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    python = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert bash and python, "the own-data section lost its bash or python block"
    lines = [ln for ln in bash.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return lines, python.group(1)


def rows(n: int, seed: int) -> list[dict]:
    items = ["apples", "bread", "milk", "rice", "tea", "eggs", "soap", "socks", "maps", "kites"]
    out = []
    for i in range(n):
        item = items[(i + seed) % len(items)]
        out.append({"question": f"Where can I find the {item} number {i}?",
                    "chosen": f"Happy to help! The {item} are in aisle {i % 9 + 1}!",
                    "rejected": f"Fine. The {item} are in aisle {i % 9 + 1}.", "answer": item})
    return out


def test_section_names_the_files_and_the_checker_it_uses():
    lines, checks = own_data_section((ROOT / "README.md").read_text(encoding="utf-8"))
    text = "\n".join(lines)
    assert any(ln.startswith("make chain ") for ln in lines) and any(ln.startswith("rlhf ") for ln in lines)
    assert "data.ground_truth=checks.py:" in text and "checks.py" in checks
    assert re.findall(r"data\.train_path=(\S+)", text)


@pytest.mark.slow
@pytest.mark.cli
def test_own_data_section_runs_as_written(tmp_path):
    readme = ROOT / "README.md"
    if not (readme.is_file() and (ROOT / "Makefile").is_file()):
        pytest.skip("no README.md / Makefile: rlhf is installed, not a checkout")
    lines, checks = own_data_section(readme.read_text(encoding="utf-8"))
    text = "\n".join(lines)
    paths = {key: {m.strip('"') for m in re.findall(rf"data\.{key}=(\S+)", text)} for key in ("train_path", "eval_path")}
    for key, n in (("train_path", 200), ("eval_path", 16)):
        for name in paths[key]:
            (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows(n, len(name))), encoding="utf-8")
    (tmp_path / "checks.py").write_text(checks, encoding="utf-8")
    recipes = tmp_path / "short-recipes"
    recipes.mkdir()
    (recipes / "tiny.yaml").write_text(SHORT_TINY, encoding="utf-8")
    venv = Path(sys.prefix)
    script = "\n".join([
        "set -e",
        f'make() {{ command make -f "{ROOT / "Makefile"}" -o "{venv / ".installed"}" VENV="{venv}" "$@"; }}',
        *lines])
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "RLHF_RECIPES": str(recipes),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1200, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (train,) = paths["train_path"]
    run = tmp_path / "runs" / f"tiny-{Path(train).stem}"  # the README: runs/<recipe>-<file stem>, not runs/tiny
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [run.name]
    assert all((run / d / "metrics.json").is_file() for d in ("sft", "reward", "ppo"))
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["ground_truth"] == "checks.py:is_correct"  # the last line's checker, from the python block
    assert all(0 <= p["ground_truth_rate"] <= 1 for p in report["policies"].values())
    assert report["num_prompts"] == 16  # data.eval_path's 16 rows, held out
