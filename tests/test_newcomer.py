"""What a newcomer trips over (issue 42's papercuts), through the real command where it is user-facing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_errors import GOOD_ROW, assert_one_line_error

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


# ------------------------------------------------------------------- data files checked before imports
HEAVY = ("torch", "transformers", "trl", "peft", "datasets", "accelerate")


def _loaded_after(args: list[str], cwd) -> tuple[list[str], str]:
    """The heavy libraries `rlhf ARGS` had imported when it exited, and its stderr."""
    probe = ("import contextlib, io, sys\nfrom rlhf_cli import cli\nerr = io.StringIO()\n"
             f"with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):\n    cli.main({args!r})\n"
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\nprint(err.getvalue(), end='')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, cwd=cwd,
                         check=False)
    assert out.returncode == 0, out.stderr
    loaded, _, err = out.stdout.partition("\n")
    return json.loads(loaded.replace("'", '"')), err  # a list of module names, as Python printed it


@pytest.mark.parametrize(("command", "path", "content", "needle"), [
    ("sft", "/nonexistent/pairs.jsonl", None, "data file /nonexistent/pairs.jsonl does not exist"),
    ("reward", "bad.jsonl", "not json\n", "bad.jsonl:1: malformed JSON"),
    ("ppo", "odd.jsonl", '{"q": 1}\n', "odd.jsonl: line 1 has keys ['q'], which match no known format"),
])
def test_bad_data_file_is_reported_before_the_heavy_imports(run_cli, tmp_path, command, path, content, needle):
    if content is not None:
        (tmp_path / path).write_text(content)
    args = [command, "data=file", f"data.train_path={path}"]
    assert_one_line_error(run_cli(*args), command, needle)
    loaded, err = _loaded_after(args, tmp_path)
    assert loaded == [] and needle in err, (loaded, err)


def test_bad_eval_file_is_reported_before_the_heavy_imports(tmp_path):
    (tmp_path / "pairs.jsonl").write_text(json.dumps(GOOD_ROW) + "\n")
    (tmp_path / "eval.jsonl").write_bytes(b'{"question": "\xff"}\n')
    loaded, err = _loaded_after(["sft", "data=file", "data.train_path=pairs.jsonl", "data.eval_path=eval.jsonl"],
                                tmp_path)
    assert loaded == [] and "eval.jsonl: not UTF-8 (line 1)" in err, (loaded, err)


def test_unreadable_data_file_is_one_line(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from rlhf_cli import data
    from rlhf_cli.errors import RlhfError

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(GOOD_ROW) + "\n")
    cfg = OmegaConf.create({"train_path": str(path), "eval_path": None, "format": "auto", "system_prompt": None})
    data.check_files(cfg)  # a good file passes

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(path), "read_bytes", denied)
    with pytest.raises(RlhfError, match=r"pairs.jsonl cannot be read \(Permission denied\); check its permissions"):
        data.check_files(cfg)
    cfg.train_path = "org/some-dataset"  # a hub name: left to the stage, which imports `datasets` for it
    data.check_files(cfg)


# ------------------------------------------------------------------------------------ recipes copy
def test_recipes_copy_never_writes_into_the_shipped_folder(run_cli):
    """Run from rlhf's own checkout, ./recipes is the shipped folder: the copy is refused (a test and `make dist`
    would pick a personal recipe up)."""
    from rlhf_cli.config import RECIPES_DIR

    shipped = sorted(p.name for p in RECIPES_DIR.iterdir())
    target = RECIPES_DIR / "my-newcomer-copy.yaml"
    try:
        line = assert_one_line_error(run_cli("recipes", "copy", "tiny", "my-newcomer-copy", cwd=RECIPES_DIR.parent),
                                     "recipes", f"{RECIPES_DIR} is the folder of rlhf's shipped recipes",
                                     "RLHF_RECIPES")
        assert not target.exists(), line
        assert_one_line_error(run_cli("recipes", "copy", "tiny", str(target)), "recipes", "shipped recipes")
        assert sorted(p.name for p in RECIPES_DIR.iterdir()) == shipped
    finally:
        if target.exists():  # the refusal failed: leave the shipped folder as it was
            target.unlink()


@pytest.mark.parametrize("dangling", [True, False])
def test_recipes_copy_never_writes_through_a_symlink(run_cli, tmp_path, dangling):
    elsewhere = tmp_path / "elsewhere" / "target.yaml"
    elsewhere.parent.mkdir()
    if not dangling:
        elsewhere.write_text("mine: 1\n")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "my-tiny.yaml").symlink_to(elsewhere)
    assert_one_line_error(run_cli("recipes", "copy", "tiny", "my-tiny"), "recipes",
                          f"recipes/my-tiny.yaml is a symlink (to {elsewhere})")
    assert (elsewhere.read_text() == "mine: 1\n") if not dangling else not elsewhere.exists()
    rc, _, err = run_cli("recipes", "copy", "tiny", "my-own")  # a plain new name is still written
    assert rc == 0 and (tmp_path / "recipes" / "my-own.yaml").is_file(), err


def test_copy_made_a_link_after_the_check_is_still_not_followed(tmp_path, monkeypatch):
    """The write itself refuses a link (O_EXCL), so one made between the check and the write is not followed."""
    from rlhf_cli import config
    from rlhf_cli.errors import RlhfError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").mkdir()
    elsewhere = tmp_path / "elsewhere.yaml"
    monkeypatch.setattr(config, "_check_copy_target",
                        lambda target, name: Path(target).symlink_to(elsewhere))
    with pytest.raises(RlhfError, match=r"recipes/late.yaml exists \(or is a link\)"):
        config.copy_recipe("tiny", "late")
    assert not elsewhere.exists()


# ------------------------------------------------------------------------------------------------- chat
def test_chat_quits_on_exit_says_reset_and_shows_its_load_time(run_cli, base):
    rc, out, err = run_cli("chat", f"chat.model_dir={base}", "chat.max_new_tokens=4",
                           stdin="hello\n/reset\nagain\nQuit\nnever answered\n")
    assert rc == 0, err
    assert out.count("\n") == 2  # hello, again; nothing after quit
    assert err.count(f"loaded {base} in ") == 1 and " s\n" in err, err
    assert "history cleared" in err


@pytest.mark.parametrize("word", ["exit", "quit", "/exit", "/quit", " EXIT "])
def test_chat_quit_words(word, base, tok, monkeypatch, capsys):
    import io

    import torch
    from omegaconf import OmegaConf

    from rlhf_cli.models import load_causal_lm
    from rlhf_cli.stages import chat

    model = load_causal_lm(base, torch.float32).eval()
    for name, value in (("setup_torch", lambda cfg: None), ("load_policy", lambda *a, **k: model),
                        ("load_tokenizer", lambda *a, **k: tok),
                        ("resolve_precision", lambda cfg: (torch.float32, None))):
        monkeypatch.setattr(chat, name, value)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"hello\n{word}\nnever answered\n"))
    cfg = OmegaConf.create({"chat": {"model_dir": str(base), "prompt": None, "system_prompt": None,
                                     "max_new_tokens": 2, "do_sample": False, "temperature": 1.0, "top_k": 0,
                                     "top_p": 1.0},
                            "ppo": {"policy_dir": "/nonexistent"}, "model": {"enable_thinking": False},
                            "device": {"accelerator": "cpu"}})
    chat.run(cfg)
    assert capsys.readouterr().out.count("\n") == 1  # one reply (hello); the chat ended at the word


def test_chat_refuses_a_huge_paste_whatever_max_new_tokens(run_cli, base):
    """max_new_tokens beyond the model's positions used to skip the length check, and a long paste ran for
    minutes; now the prompt keeps at least half the positions and the rest is the answer's."""
    rc, out, err = run_cli("chat", f"chat.model_dir={base}", "chat.max_new_tokens=100000",
                           stdin="hello " * 50_000 + "\n", timeout=300)
    assert_one_line_error((rc, out, err), "chat", "the message is", "at most 256 before a 256-token answer",
                          "chat.max_new_tokens=100000")


def test_chat_answer_budget_by_hand(base, tok):
    """The answer gets min(max_new_tokens, positions - prompt) tokens; a prompt may fill half the positions."""
    import torch
    from omegaconf import OmegaConf

    from rlhf_cli.errors import RlhfError
    from rlhf_cli.models import load_causal_lm
    from rlhf_cli.stages import chat

    model = load_causal_lm(base, torch.float32).eval()
    positions = model.config.max_position_embeddings
    c = OmegaConf.create({"max_new_tokens": 10 * positions, "do_sample": False, "temperature": 1.0, "top_k": 0,
                          "top_p": 1.0})
    seen = {}
    real = model.generate
    model.generate = lambda **kw: seen.update(kw) or real(**kw)
    chat.answer(model, tok, [{"role": "user", "content": "hello"}], c)
    n = seen["input_ids"].shape[1]
    assert seen["generation_config"].max_new_tokens == positions - n
    with pytest.raises(RlhfError, match=rf"at most {positions - positions // 2} before a {positions // 2}-token"):
        chat.answer(model, tok, [{"role": "user", "content": "hello " * positions}], c)


def test_sigterm_ends_chat_at_once(base, tmp_path):
    """A chat waiting for its next line ends on SIGTERM with exit 143 and one line (a real process: signals)."""
    import signal
    import time

    from clitools import RLHF, cli_env

    exe = [str(RLHF)] if RLHF.exists() else [sys.executable, "-m", "rlhf_cli.cli"]
    proc = subprocess.Popen([*exe, "chat", f"chat.model_dir={base}", "chat.max_new_tokens=4"], cwd=tmp_path,
                            env=cli_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stderr.readline().startswith("loaded ")
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip()  # the first answer: the chat is waiting for the next line now
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        line = proc.stderr.readline()
        said = time.monotonic() - sent
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert rc == 143
    assert line == "rlhf chat: error: terminated (SIGTERM); completed outputs are intact\n"
    assert said < 5, said  # the line at once (the interpreter's own teardown of torch follows it)
    assert not proc.stderr.read().strip()


# ------------------------------------------------------------------------ no logs/ from runs that did nothing
def test_doctor_and_a_refused_run_leave_no_run_directory(run_cli, tmp_path):
    rc, _, err = run_cli("doctor", "recipe=qwen3-0.6b", "doctor.timeout_s=5")
    assert rc == 0, err
    assert_one_line_error(run_cli("sft", "sft.learning_rate=nan"), "sft", "sft.learning_rate=nan")
    assert_one_line_error(run_cli("ppo", "ppo.advantage=grpo"), "ppo", "ppo.samples_per_prompt=1")  # the stage's check
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_refused_run_keeps_the_log_directories_that_were_there(run_cli, tmp_path):
    earlier = tmp_path / "runs" / "tiny" / "logs" / "ppo" / "cli.log"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("an earlier run's log\n")
    assert_one_line_error(run_cli("sft", "sft.learning_rate=nan"), "sft", "sft.learning_rate=nan")
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny" / "logs").iterdir()) == ["ppo"]
    assert earlier.read_text() == "an earlier run's log\n"


def test_remove_unused_by_hand(tmp_path):
    from omegaconf import OmegaConf

    from rlhf_cli import run_logs

    (tmp_path / "runs").mkdir()
    logs = tmp_path / "runs" / "x" / "logs" / "sft"
    hook = run_logs.FreshLogs()
    hook.on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(logs)}}}))
    (logs / ".hydra").mkdir(parents=True)
    (logs / ".hydra" / "config.yaml").write_text("a: 1\n")
    (logs / "cli.log").write_text("")
    (tmp_path / "runs" / "x" / "sft").mkdir()  # the stage wrote beside the logs
    run_logs.remove_unused(only_if_silent=True)
    assert not (tmp_path / "runs" / "x" / "logs").exists() and (tmp_path / "runs" / "x" / "sft").is_dir()

    hook.on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(logs)}}}))
    logs.mkdir(parents=True)
    (logs / "cli.log").write_text("step 1\n")
    run_logs.remove_unused(only_if_silent=True)  # something was logged: kept
    assert (logs / "cli.log").is_file()
    run_logs.remove_unused()  # nothing noted any more: a second call removes nothing
    assert (logs / "cli.log").is_file()


# ------------------------------------------------------------------ help: devices, make's recipes, resolved show
def test_help_lists_every_device_with_one_line(run_cli):
    rc, out, err = run_cli("--help")
    assert rc == 0, err
    lines = out.splitlines()
    for name in sorted(p.stem for p in (CONF_DIR / "device").glob("*.yaml")):
        row = [ln for ln in lines if ln.startswith((f"  {name} ", f"  {name}\t"))]
        assert len(row) == 1 and len(row[0].split(None, 1)) == 2, (name, row)
    assert "  cuda     One GPU" in out and "  ddp      Data parallel over GPUs" in out


def test_group_summaries_by_hand(tmp_path):
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "a.yaml").write_text("# @package device\n# Fast path: details here. More.\nname: a\n")
    (tmp_path / "device" / "b.yaml").write_text("# One GPU (v1.5). Then more.\nname: b\n")
    (tmp_path / "device" / "c.yaml").write_text("name: c\n")
    assert hints.group_summaries(tmp_path, "device") == [("a", "Fast path"), ("b", "One GPU (v1.5)"), ("c", "")]


def test_make_help_lists_every_recipe_from_the_folder(tmp_path):
    import shutil

    from rlhf_cli.config import CONFIG_ROOT

    if shutil.which("make") is None:
        pytest.skip("no make")
    shutil.copy(CONFIG_ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "recipes").mkdir()
    for name in ("tiny", "zz-new-one", "a-first"):
        (tmp_path / "recipes" / f"{name}.yaml").write_text("recipe: x\n")
    out = subprocess.run(["make", "-s", "help"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "recipes (RECIPE=NAME" in ln)
    assert line.endswith(": a-first tiny zz-new-one"), line
    shipped = subprocess.run(["make", "-s", "help"], cwd=CONFIG_ROOT, capture_output=True, text=True, timeout=60,
                             check=False)
    line = next(ln for ln in shipped.stdout.splitlines() if "recipes (RECIPE=NAME" in ln)
    assert line.split(": ", 1)[1].split() == sorted(p.stem for p in (CONFIG_ROOT / "recipes").glob("*.yaml"))


def test_recipes_show_resolves_interpolations(run_cli, tmp_path):
    rc, out, err = run_cli("recipes", "show", "tiny")
    assert rc == 0, err
    assert "${" not in out
    assert "\nrun_dir: runs/tiny\n" in out and "  output_dir: runs/tiny/sft\n" in out
    assert "  policy_dir: runs/tiny/sft\n" in out  # ppo.policy_dir: ${sft.output_dir}


def test_resolved_keeps_what_cannot_be_resolved():
    from omegaconf import OmegaConf

    from rlhf_cli.recipes import resolved

    cfg = OmegaConf.create({"a": "${oc.env:RLHF_TEST_SURELY_UNSET}", "c": 1, "d": {"e": "${c}/x", "l": ["${c}", 2]}})
    assert resolved(cfg) == {"a": "${oc.env:RLHF_TEST_SURELY_UNSET}", "c": 1, "d": {"e": "1/x", "l": [1, 2]}}


# ---------------------------------------------------------------------------------- ppo.save_total_limit
def test_ppo_keeps_the_newest_checkpoints_and_resumes_from_them(base, tok, tmp_path):
    from test_trainer import build, ppo_cfg

    from rlhf_cli.ppo import checkpoint
    from rlhf_cli.resume import latest

    class Stop(Exception):
        pass

    def stop_at_5(update, metrics):
        if update == 5:
            raise Stop  # as a kill after update 4's checkpoint

    p = ppo_cfg(total_episodes=48, save_every=1, save_total_limit=2)  # 6 updates of 8 episodes, a save after each
    a = build(base, tok, p, work=tmp_path / "a")
    (tmp_path / "a" / "best").mkdir(parents=True)
    (tmp_path / "a" / "best" / "best.json").write_text("{}")
    a.hooks.on_update = stop_at_5
    with pytest.raises(Stop):
        a.train()
    ckpts = tmp_path / "a" / "checkpoints"
    assert sorted(x.name for x in ckpts.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert (tmp_path / "a" / "best" / "best.json").read_text() == "{}"  # best/ untouched
    checkpoint.verify_checksums(ckpts / "checkpoint-4")

    # the run resumes from the newest kept and prunes as it goes on
    b = build(base, tok, p, work=tmp_path / "a", seed=5)
    b.resume(latest(ckpts))
    assert b.progress.update == 4
    b.train()
    assert b.progress.update == 6
    assert sorted(x.name for x in ckpts.iterdir()) == ["checkpoint-5", "checkpoint-6"]


def test_prune_by_hand(tmp_path):
    from rlhf_cli.ppo.checkpoint import prune

    for n in (1, 2, 10, 3):
        (tmp_path / f"checkpoint-{n}").mkdir()
    (tmp_path / "checkpoint-x").mkdir()  # not a checkpoint of ours: left alone
    (tmp_path / ".checkpoint-0.removing").mkdir()  # a removal a kill cut off: finished now
    assert prune(tmp_path, None) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-10", "checkpoint-2",
                                                          "checkpoint-3", "checkpoint-x"]
    assert [p.name for p in prune(tmp_path, 2)] == ["checkpoint-1", "checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-3", "checkpoint-x"]
    prune(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-x"]


def test_save_total_limit_is_checked(run_cli):
    assert_one_line_error(run_cli("ppo", "ppo.save_total_limit=0"), "ppo",
                          "ppo.save_total_limit=0 is out of range; use a whole number ≥ 1, or null")


# ----------------------------------------------------------------------------------------- PPO's last line
def test_ppo_ends_with_its_wall_time_and_a_summary(run_cli, base, tmp_path):
    import re

    rc, out, err = run_cli("ppo", f"ppo.policy_dir={base}", "ppo.reward=[rlhf_cli.demo:polite_reward]",
                           "ppo.value_init=sft", "ppo.total_episodes=32", "ppo.num_mini_batches=1",
                           "ppo.response_length=4", "device.threads=1")
    assert rc == 0, err[-3000:]
    last = [ln for ln in out.splitlines() if ln.strip()][-1]
    assert re.search(r"ppo: 1 update, 32 episodes in \d+\.\d s; last update: score [+-]\d+\.\d\d, kl -?\d+\.\d\d, "
                     r"ground truth \d\.\d\d(, held-out ground truth \d\.\d\d)?; wrote runs/tiny/ppo$", last), last


def test_final_line_by_hand():
    from rlhf_cli.stages._console import duration, final_line

    m = {"objective/scores": 1.234, "objective/kl": 0.456, "objective/ground_truth_rate": 0.97}
    assert final_line(3, 96, 83.04, m, "runs/tiny/ppo") == (
        "ppo: 3 updates, 96 episodes in 1 min 23 s; last update: score +1.23, kl 0.46, ground truth 0.97; "
        "wrote runs/tiny/ppo")
    assert final_line(1, 8, 2.0, {"objective/scores": -0.5}, "o") == \
        "ppo: 1 update, 8 episodes in 2.0 s; last update: score -0.50; wrote o"
    assert [duration(s) for s in (0.04, 59.94, 60, 3599.4, 7620)] == ["0.0 s", "59.9 s", "1 min 00 s",
                                                                        "59 min 59 s", "2 h 07 min"]
