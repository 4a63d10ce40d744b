"""Every config key is defined once: its value in conf/ (values only), its type, range and help in
`rlhf_cli.schema.SCHEMA`; `rlhf <command> --help` shows each key the command reads with both."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rlhf_cli.config import COMMANDS, CONF_DIR, compose
from rlhf_cli.schema import SCHEMA

CONF_FILES = sorted(CONF_DIR.rglob("*.yaml"))


def test_every_key_has_its_help():
    """A few words at least: the help is what `--help` prints, the YAML no longer says it."""
    thin = [k for k, rule in SCHEMA.items() if len(rule.help.split()) < 2]
    assert not thin, thin


@pytest.mark.parametrize("path", CONF_FILES, ids=lambda p: str(p.relative_to(CONF_DIR)))
def test_config_groups_hold_values_only(path):
    """A file may open with a comment saying what the group option is (`rlhf --help` lists the devices by it);
    below it, keys and values only: a key's meaning lives in the schema, not in a comment beside it. Hydra's own
    section of config.yaml is not the project's keys and keeps its notes."""
    lines = path.read_text().splitlines()
    body = lines[next((i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")), len(lines)):]
    own = body[:next((i for i, line in enumerate(body) if line.startswith("hydra:")), len(body))]
    commented = [line for line in own if re.search(r"(^|\s)#", line)]
    assert not commented, commented


def test_help_of_a_command_shows_each_key_with_its_value_and_help(run_cli):
    rc, out, err = run_cli("ppo", "--help")
    assert rc == 0, err
    assert out.startswith("usage: rlhf ppo ")
    for key, rule in SCHEMA.items():
        if key.startswith(("ppo.", "model.", "data.", "device.", "logging.")):
            assert f"\n  {key} = " in out, key
    block = out.split("\n  ppo.kl_coef = ", 1)[1].split("\n  ppo.", 1)[0]
    assert block.startswith(f"{compose('ppo').ppo.kl_coef}\n"), block  # the tiny recipe's value, not the group's
    assert SCHEMA["ppo.kl_coef"].help.split(":")[0] in " ".join(block.split())
    assert "[a number ≥ 0]" in " ".join(block.split())  # the range, from the rule the config check uses
    assert "\n  sft." not in out  # another command's keys are not this one's


def test_help_shows_the_values_after_the_recipe_and_the_overrides(run_cli):
    rc, out, err = run_cli("sft", "recipe=qwen3-0.6b", "sft.learning_rate=3e-5", "--help")
    assert rc == 0, err
    assert "\n  model.name_or_path = Qwen/Qwen3-0.6B\n" in out
    assert "\n  sft.learning_rate = 3.0e-05\n" in out or "\n  sft.learning_rate = 3e-05\n" in out, out
    assert "\n  run_dir = runs/qwen3-0.6b\n" in out


def test_help_with_a_bad_override_is_the_one_line_error(run_cli):
    rc, out, err = run_cli("sft", "sft.max_step=2", "--help")
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("rlhf sft: error: ") and "sft.max_steps" in err


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "export"])
def test_every_command_has_a_help_page(run_cli, command):
    rc, out, err = run_cli(command, "--help")
    assert rc == 0, err
    assert "\n  run_dir = " in out and "\n  model.name_or_path = " in out


def test_help_of_a_command_loads_no_ml_library():
    probe = ("import contextlib, io, sys\nsys.argv = ['rlhf', 'ppo', '--help']\nfrom rlhf_cli import cli\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    cli.main()\n"
             "print(sorted(m for m in ('torch', 'transformers', 'trl', 'peft', 'datasets') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", (loaded.stdout, loaded.stderr)
