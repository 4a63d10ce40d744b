"""User errors through the real `rlhf` command: non-zero exit, one line on stderr, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf_cli.config import COMMANDS, recipe_names

GOOD_ROW = {"question": "How do I sleep better?", "chosen": "A fixed bedtime.", "rejected": "No idea."}


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """The embedded tiny base model, built once; stages reuse it (`model.tiny.dir`, `reward.init_from`)."""
    from rlhf_cli.tiny import build_tiny_base

    return build_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


def assert_one_line_error(result, command: str, *needles: str) -> str:
    rc, out, err = result
    assert rc != 0, (out, err)
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    prefix = f"rlhf {command}: error: " if command else "rlhf: error: "
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert errors[0].startswith(prefix), err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


# ------------------------------------------------------------------------------------------- fast paths
HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "accelerate")


def test_help_lists_commands_and_recipes_quickly(run_cli):
    """Quickly: `rlhf --help` loads none of the ML libraries (each takes seconds to import), a check that holds
    however busy the machine is."""
    probe = ("import contextlib, io, sys\nsys.argv = ['rlhf', '--help']\nfrom rlhf_cli import cli\n"
             "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    cli.main()\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", (loaded.stdout, loaded.stderr)
    rc, out, err = run_cli("--help")
    assert rc == 0, err
    assert out.startswith("usage: rlhf <command>")
    for command in COMMANDS:
        assert f"\n  {command} " in out, command
    recipes_line = next(line for line in out.splitlines() if line.startswith("recipes"))
    for recipe in recipe_names():
        assert recipe in recipes_line
    assert run_cli()[:2] == (0, out)  # no arguments: the same help


def test_cfg_job_prints_the_composed_config(run_cli, tmp_path):
    rc, out, err = run_cli("sft", "--cfg", "job", "sft.learning_rate=0.5", "recipe=qwen3-0.6b")
    assert rc == 0, err
    assert "command: sft" in out
    assert "recipe: qwen3-0.6b" in out
    assert "name_or_path: Qwen/Qwen3-0.6B" in out
    assert "learning_rate: 0.5" in out
    assert not (tmp_path / "runs").exists()  # printing the config runs nothing


def test_unknown_command(run_cli):
    line = assert_one_line_error(run_cli("train"), "", "unknown command 'train'")
    for command in COMMANDS:
        assert command in line


def test_unknown_recipe(run_cli):
    line = assert_one_line_error(run_cli("sft", "recipe=nope"), "sft", "unknown recipe 'nope'")
    for recipe in recipe_names():
        assert recipe in line


def test_unknown_config_key(run_cli):
    rc, out, err = run_cli("sft", "sft.no_such_key=1")
    assert rc != 0
    assert "no_such_key" in err
    assert "Traceback" not in out + err


# -------------------------------------------------------------------------------------------- data errors
def test_malformed_json_line(run_cli, tmp_path, tiny_base):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps(GOOD_ROW) + "\n{\"question\": \"q\",\n")
    assert_one_line_error(run_cli("sft", f"model.tiny.dir={tiny_base}", "data.train_path=bad.jsonl"),
                          "sft", "bad.jsonl:3: malformed JSON")


def test_missing_required_keys(run_cli, tmp_path, tiny_base):
    (tmp_path / "pairs.jsonl").write_text(json.dumps(GOOD_ROW) + "\n" + json.dumps({"question": "q"}) + "\n")
    assert_one_line_error(
        run_cli("reward", f"reward.init_from={tiny_base}", "data.train_path=pairs.jsonl",
                "data.eval_path=null"),
        "reward", "pairs.jsonl: line 2 is missing required key(s) chosen, rejected")


def test_empty_dataset_file(run_cli, tmp_path, tiny_base):
    (tmp_path / "empty.jsonl").write_text("")
    assert_one_line_error(run_cli("sft", f"model.tiny.dir={tiny_base}", "data.train_path=empty.jsonl"),
                          "sft", "empty.jsonl: the dataset is empty")


def test_nonexistent_data_file(run_cli, tiny_base):
    assert_one_line_error(run_cli("sft", f"model.tiny.dir={tiny_base}", "data.train_path=nope/pairs.jsonl"),
                          "sft", "nope/pairs.jsonl does not exist")


# ------------------------------------------------------------------------------------ models and inputs
def test_model_path_does_not_exist(run_cli):
    assert_one_line_error(run_cli("sft", "model.name_or_path=/nonexistent/model"),
                          "sft", "/nonexistent/model does not exist")


def test_reward_without_sft_output(run_cli, tmp_path):
    assert_one_line_error(run_cli("reward"), "reward", "runs/tiny/sft", "rlhf sft")
    assert not (tmp_path / "runs" / "tiny" / "reward").exists()


def test_chat_without_sft_output(run_cli):
    assert_one_line_error(run_cli("chat", "prompt=你好, world"), "chat", "rlhf sft")


def test_failed_run_keeps_earlier_output(run_cli, tmp_path, tiny_base):
    reward_dir = tmp_path / "runs" / "tiny" / "reward"
    reward_dir.mkdir(parents=True)
    (reward_dir / "marker.txt").write_text("good output")
    (reward_dir / ".rlhf-output").write_text("{}")  # an earlier output of rlhf's own
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert_one_line_error(run_cli("reward", f"reward.init_from={tiny_base}", "data.train_path=bad.jsonl"),
                          "reward", "bad.jsonl:1: malformed JSON")
    assert (reward_dir / "marker.txt").read_text() == "good output"
    assert sorted(p.name for p in reward_dir.iterdir()) == [".rlhf-output", "marker.txt"]
    assert not list(reward_dir.parent.glob(".reward.tmp-*"))


# ------------------------------------------------------------------------ before and around Hydra's machinery
@pytest.mark.parametrize("args, needles", [
    (["+foo=bar"], ["foo is not a config key; `rlhf sft --cfg job` prints the keys"]),
    (["sed=1"], ["sed is not a config key; did you mean seed?"]),
    (["seed=99999999999999999999"], ["seed=99999999999999999999 is out of range", "[0, 4294967295]"]),
    (["run_dir=${oc.env:RLHF_TEST_UNSET_VARIABLE}"],
     ["environment variable RLHF_TEST_UNSET_VARIABLE is not set (used by hydra.run.dir)"]),
])
def test_top_level_typos_ranges_and_interpolations(run_cli, args, needles):
    assert_one_line_error(run_cli("sft", *args), "sft", *needles)


def test_a_new_entry_in_a_dict_value_names_the_plus_form(run_cli, tmp_path):
    """`eval.policies={sft: ..., mine: ...}` gives the dict a key it does not have: one line naming the `+` form
    that adds it."""
    assert_one_line_error(run_cli("eval", f"eval.policies={{sft: {tmp_path}, mine: {tmp_path}}}"), "eval",
                          "eval.policies.mine is not a key of eval.policies", "+eval.policies.mine=VALUE")


def test_a_run_dir_that_is_a_file(run_cli, tmp_path):
    (tmp_path / "taken").write_text("mine\n")
    assert_one_line_error(run_cli("sft", f"run_dir={tmp_path / 'taken'}"), "sft",
                          f"cannot write the run's directory {tmp_path / 'taken'}", "choose a run_dir")
    assert (tmp_path / "taken").read_text() == "mine\n"


def test_a_response_longer_than_the_policy_s_positions(run_cli, tiny_base, tmp_path):
    limit = json.loads((tiny_base / "config.json").read_text())["max_position_embeddings"]
    line = assert_one_line_error(run_cli("ppo", f"ppo.policy_dir={tiny_base}", f"run_dir={tmp_path}",
                                         f"ppo.response_length={limit * 10}",
                                         "ppo.reward=[rlhf_cli.demo:polite_reward]"),
                                 "ppo", f"ppo.response_length={limit * 10} + data.max_prompt_length=",
                                 f"more than the {limit} the policy has", "lower ppo.response_length")
    assert not (tmp_path / "ppo").exists(), line


def test_a_recipe_that_is_not_utf8(run_cli, tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "latin.yaml").write_bytes(b"defaults:\n  - tiny\n  - _self_\nrecipe: latin\n# caf\xe9\n")
    rc, out, err = run_cli("recipes")
    assert rc == 0 and "latin" in out and "not UTF-8" in out, err  # the listing still works
    assert_one_line_error(run_cli("sft", "recipe=latin"), "sft", "latin.yaml is not UTF-8 (byte 0xe9 on line 5)",
                          "save it as UTF-8")


def test_recipes_show_whole_descriptions(run_cli):
    rc, out, err = run_cli("recipes")
    assert rc == 0, err
    text = " ".join(out.split())
    assert "tiny-rule: the tiny chain rewarded by a rule instead of a reward model" in text
    assert "the value model starts from the SFT policy." in text  # the description's last sentence, not cut


def test_a_recipe_s_required_data_is_asked_for_before_any_download(run_cli, tmp_path):
    """qwen3-0.6b names a hub model and no data: the missing file is the first (and quick) error, not a
    download attempt."""
    result = run_cli("sft", "recipe=qwen3-0.6b", "device=cpu", f"run_dir={tmp_path}")
    assert_one_line_error(result, "sft", "data.train_path is not set: recipe qwen3-0.6b trains on your preference "
                          "file", "data.train_path=pairs.jsonl")
    assert "modelscope" not in result[2].lower()  # no hub was asked
