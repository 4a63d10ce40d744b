"""The stage table (rlhf_cli/stage_table.py): each row has its module, config group and keys, and every list that
names commands is the table's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from rlhf_cli import choices, io, launch, memory, multirun, schema, stage_table
from rlhf_cli.config import compose
from rlhf_cli.stage_table import STAGES

PKG = Path(stage_table.__file__).parent
REPO = PKG.parent


@pytest.mark.parametrize("s", STAGES, ids=lambda s: s.name)
def test_each_row_has_its_module_group_and_keys(s):
    module = PKG / "stages" / f"{s.name}.py"
    assert module.is_file(), module
    functions = {n.name for n in ast.parse(module.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert "run" in functions, f"{module} has no run(cfg)"
    defaults = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())["defaults"]
    cfg = compose(s.name, [])
    if s.name != "export":  # export's two keys sit in conf/config.yaml
        assert (REPO / "conf" / "stage" / f"{s.name}.yaml").is_file()
        assert {f"stage@{s.name}": s.name} in defaults
    assert s.name in cfg, f"no config group {s.name}"
    for key in filter(None, (s.output_key, s.save_key, f"{s.name}.resume" if s.resume else None)):
        assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", key
    assert s.summary and "\n" not in s.summary
    if s.trains:
        assert s.headline and s.resume and s.output, s.name  # a trained model is published, resumable, compared
        assert s.name in memory.PLANNERS and s.name in memory.RUNTIME_OVERHEAD_MIB["cpu"]
    assert set(s.legacy_dirs) <= {s.name, "merged", "export"}


def test_every_command_list_is_the_tables():
    names = tuple(s.name for s in STAGES)
    assert choices.COMMANDS == names and stage_table.COMMANDS == names
    trains = tuple(s.name for s in STAGES if s.trains)
    assert choices.TRAIN_STAGES == launch.TRAIN_COMMANDS == trains == tuple(memory.PLANNERS)
    assert io.STAGE_KINDS == tuple(s.name for s in STAGES if s.output)
    assert multirun.OUTPUT_KEYS == {s.name: f"{s.name}.output_dir" for s in STAGES if s.output}
    assert schema.NEEDS_DATA == tuple(s.name for s in STAGES if s.needs_data)
    assert set(names) <= set(schema.GROUPS)
    assert stage_table.POLICIES == ("ppo", "dpo", "sft")  # chat's fallback: the newest trained policy first


def test_help_lists_every_command_from_the_table():
    out = subprocess.run([sys.executable, "-m", "rlhf_cli.cli", "--help"], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    for s in STAGES:
        assert f"  {s.name:<8} {s.summary}" in out


def test_a_new_row_reaches_every_list(tmp_path):
    """A throwaway stage, declared as a row before the package is imported, is a command, a training stage, a
    marked output, a sweep's output key and headline, a data reader and resumable: no other list to edit."""
    code = """
import dataclasses
from rlhf_cli import stage_table as t
row = t.Stage("kto", "KTO on unpaired feedback", trains=True, needs_data=True, output=True, headline="eval_loss",
              resume="trainer", policy=2)
t.STAGES = (*t.STAGES, row)
for name, value in dict(BY_NAME={s.name: s for s in t.STAGES}, COMMANDS=tuple(s.name for s in t.STAGES),
                        TRAIN_STAGES=tuple(s.name for s in t.STAGES if s.trains),
                        NEEDS_DATA=tuple(s.name for s in t.STAGES if s.needs_data),
                        OUTPUT_STAGES=tuple(s.name for s in t.STAGES if s.output),
                        RESUMABLE=tuple(s.name for s in t.STAGES if s.resume)).items():
    setattr(t, name, value)
from rlhf_cli import choices, io, launch, multirun, schema
assert "kto" in choices.COMMANDS and "kto" in choices.TRAIN_STAGES and "kto" in launch.TRAIN_COMMANDS
assert "kto" in io.STAGE_KINDS and io._LEGACY_NAMES["kto"] == ()
assert multirun.OUTPUT_KEYS["kto"] == "kto.output_dir" and "kto" in schema.NEEDS_DATA and "kto" in schema.GROUPS
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_new_training_stage_is_five_files(tmp_path):
    """A throwaway stage added to a copy of the package: its row in the table, its module, its config group, its
    line in config.yaml's defaults and its keys (rlhf_cli/keys.py); nothing else. It then runs, is launched over
    processes, checks its keys and has its --help page (a memory plan for `rlhf doctor` would be a sixth file,
    its planner in rlhf_cli/memory.py)."""
    import shutil

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("rlhf_cli", "conf", "recipes"):
        shutil.copytree(REPO / part, tmp_path / part, ignore=ignore)
    edits = {
        "rlhf_cli/stage_table.py": ('    Stage("doctor",', ('    Stage("hello", "greets (a throwaway stage)", '
                                    'trains=True, needs_data=True, output=True, resume="trainer"),\n    Stage("doctor",')),
        "conf/config.yaml": ("  - stage@push: push\n", "  - stage@push: push\n  - stage@hello: hello\n"),
        "rlhf_cli/keys.py": ('    # ---- conf/stage/doctor.yaml', ('    **_trainer_keys("hello"),\n'
                               '    "hello.name": text(help="who is greeted"),\n    # ---- conf/stage/doctor.yaml')),
    }
    for path, (old, new) in edits.items():
        text = (tmp_path / path).read_text()
        assert text.count(old) == 1, (path, old)
        (tmp_path / path).write_text(text.replace(old, new))
    group = (REPO / "conf/stage/sft.yaml").read_text().split("\nlora:")[0].replace("/sft", "/hello")
    (tmp_path / "conf/stage/hello.yaml").write_text(group + "\nname: world\n")
    (tmp_path / "rlhf_cli/stages/hello.py").write_text(
        '"""`rlhf hello`."""\n\n\ndef run(cfg) -> None:\n    print(f"hello, {cfg.hello.name}")\n')
    changed = [*edits, "conf/stage/hello.yaml", "rlhf_cli/stages/hello.py"]
    assert len(changed) == 5

    def rlhf(*args):
        env = {"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
        return subprocess.run([sys.executable, "-m", "rlhf_cli.cli", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600, env=env)

    ran = rlhf("hello", "hello.name=you")
    assert ran.returncode == 0 and ran.stdout.strip().endswith("hello, you"), ran.stderr
    launched = rlhf("hello", "device=cpu-ddp", "dry_run=true")
    assert launched.returncode == 0 and "--num_processes 2" in launched.stdout, launched.stderr
    assert launched.stdout.strip().endswith("-m rlhf_cli.cli hello device=cpu-ddp"), launched.stdout
    typo = rlhf("hello", "hello.save_step=3")
    assert typo.returncode == 2 and "did you mean hello.save_steps?" in typo.stderr, typo.stderr
    page = rlhf("hello", "--help")
    assert page.returncode == 0 and "\n  hello.name = world\n      who is greeted" in page.stdout, page.stdout
    listed = rlhf("--help")
    assert "\n  hello    greets (a throwaway stage)" in listed.stdout, listed.stdout
