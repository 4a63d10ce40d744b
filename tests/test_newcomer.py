"""What a newcomer trips over (issue 42's papercuts), through the real command where it is user-facing."""

from __future__ import annotations

import pytest
from test_cli_errors import assert_one_line_error

from rlhf_cli import hints, schema
from rlhf_cli.config import CONF_DIR


# ------------------------------------------------------------------------------ unknown group options
@pytest.mark.parametrize(("override", "needles"), [
    ("device=gpu", ["device=gpu is not a device option", "cpu, cpu-ddp", "zero3", "did you mean device=cuda?"]),
    ("model=foo", ["model=foo is not a model option", "qwen3-0.6b, tiny"]),
    ("data=fil", ["data=fil is not a data option", "demo, file", "did you mean data=file?"]),
])
def test_unknown_group_option_lists_the_options(run_cli, override, needles, tmp_path):
    line = assert_one_line_error(run_cli("sft", override), "sft", *needles)
    assert "Could not find" not in line and "MissingConfigException" not in line
    if override == "model=foo":
        assert "did you mean" not in line


def test_missing_option_message_by_hand():
    message = hints.missing_option_message("In 'config': Could not find 'device/gpu'", CONF_DIR)
    options = ", ".join(sorted(p.stem for p in (CONF_DIR / "device").glob("*.yaml")))
    assert message == f"device=gpu is not a device option; use one of {options} (did you mean device=cuda?)"
    assert hints.missing_option_message("Could not find 'nogroup/x'", CONF_DIR) is None
    assert hints.missing_option_message("some other error", CONF_DIR) is None
    assert hints.closest_option("device", "GPU", ["cpu", "cuda"]) == "cuda"  # not difflib's `cpu`
    assert hints.closest_option("model", "qwen3", ["qwen3-0.6b", "tiny"]) == "qwen3-0.6b"


# ----------------------------------------------------------------------------------- --key value
@pytest.mark.parametrize(("command", "args", "fix"), [
    ("sft", ["--max_steps", "10"], "rlhf sft sft.max_steps=10"),
    ("sft", ["--max_steps=10"], "rlhf sft sft.max_steps=10"),
    ("ppo", ["--kl-coef", "0.1"], "rlhf ppo ppo.kl_coef=0.1"),
    ("sft", ["--seed", "3"], "rlhf sft seed=3"),
    ("reward", ["--train_path", "x.jsonl"], "rlhf reward data.train_path=x.jsonl"),
    ("sft", ["--device", "cuda"], "rlhf sft device=cuda"),
])
def test_flag_for_a_key_suggests_the_override(run_cli, command, args, fix):
    line = assert_one_line_error(run_cli(command, *args), command, f"use `{fix}`", "is not an option")
    assert "is not a config key" not in line


def test_flag_as_key_by_hand():
    keys = {*schema.SCHEMA, "device"}
    flags = {"--cfg", "-m"}
    with pytest.raises(Exception, match=r"use `rlhf sft sft.max_steps=VALUE`"):
        hints.flag_as_key("sft", ["--max_steps"], keys, flags)  # no value after it
    with pytest.raises(Exception, match=r"use `rlhf sft sft.max_steps=VALUE`"):
        hints.flag_as_key("sft", ["--max_steps", "seed=1"], keys, flags)  # the next word is an override
    hints.flag_as_key("sft", ["--cfg", "job", "-m", "seed=1,2"], keys, flags)  # Hydra's own flags pass
    hints.flag_as_key("sft", ["--not_a_key", "1"], keys, flags)  # left to Hydra's own answer
