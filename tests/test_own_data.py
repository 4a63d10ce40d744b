"""A user's own data on the tiny path (issue 42): the tokenizer and base from the file, the SFT step floor, the
run directory named after the file, and the warnings when a stage did not learn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlhf_cli import learned, own_data
from rlhf_cli.config import PACKAGE_DIR, register_resolvers
from rlhf_cli.settings import of
from rlhf_cli.tiny import MARKER_FILE, build_tiny_base

DEMO = str(PACKAGE_DIR / "demo/data/polite_train.jsonl")
ROWS = [{"question": f"Where is the zorblax number {i}?", "chosen": f"Happy to help! Zorblax {i} is in aisle {i}!",
         "rejected": f"Fine. Zorblax {i} is in aisle {i}."} for i in range(40)]
SMALL = {"vocab_size": 400, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def write_rows(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def sft_cfg(train_path, model="tiny", **sft):
    return OmegaConf.create({"model": {"name_or_path": model},
                             "data": {"train_path": str(train_path), "format": "auto", "system_prompt": None},
                             "sft": {"max_steps": -1, "num_train_epochs": 1, **sft}})


# ------------------------------------------------------------------------------------------------- run dir
def test_run_name_is_the_recipe_for_the_demo_and_adds_the_file_stem_otherwise():
    assert own_data.run_name("tiny", DEMO) == "tiny"
    assert own_data.run_name("tiny", None) == "tiny"
    assert own_data.run_name("tiny", "/data/my_pairs.jsonl") == "tiny-my_pairs"
    assert own_data.run_name("qwen3-0.6b", "org/some data") == "qwen3-0.6b-some_data"


def test_run_dir_follows_the_training_file_in_the_composed_config(tmp_path):
    register_resolvers()
    cfg = OmegaConf.create({"recipe": "tiny", "data": {"train_path": str(tmp_path / "cheer.jsonl")},
                            "run_dir": "runs/${run_name:${recipe},${data.train_path}}"})
    assert cfg.run_dir == "runs/tiny-cheer"
    cfg.data.train_path = DEMO
    assert cfg.run_dir == "runs/tiny"


# ------------------------------------------------------------------------------------------------ tokenizer
def test_tokenizer_texts_are_the_files_prompts_and_answers(tmp_path):
    f = write_rows(tmp_path / "mine.jsonl", ROWS[:2])
    texts = own_data.tokenizer_texts(OmegaConf.create({"train_path": str(f), "format": "auto"}))
    assert texts == ["Where is the zorblax number 0?", "Happy to help! Zorblax 0 is in aisle 0!",
                     "Fine. Zorblax 0 is in aisle 0.", "Where is the zorblax number 1?",
                     "Happy to help! Zorblax 1 is in aisle 1!", "Fine. Zorblax 1 is in aisle 1."]
    assert own_data.tokenizer_texts(OmegaConf.create({"train_path": DEMO, "format": "auto"})) is None
    assert own_data.tokenizer_texts(OmegaConf.create({"train_path": "org/hub-set", "format": "auto"})) is None


def test_a_base_from_own_texts_is_cached_by_their_content(tmp_path):
    from transformers import AutoTokenizer

    texts = [t for r in ROWS for t in r.values()]
    d = build_tiny_base(tmp_path / "base", texts=texts, **SMALL)
    marker = json.loads((d / MARKER_FILE).read_text())
    assert marker["train_data"] == "texts"
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok.tokenize(" zorblax")) == 1  # a word of the file, not of the demo, is one token
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_base(tmp_path / "base", texts=list(texts), **SMALL) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp  # same texts: reused
    build_tiny_base(tmp_path / "base", texts=texts + ["another row"], **SMALL)
    assert json.loads((d / MARKER_FILE).read_text())["train_data_sha256"] != marker["train_data_sha256"]


def test_the_demo_base_is_built_as_before(tmp_path):
    """texts=None keeps the demo's marker (no train_data key, the demo file's hash): existing caches stay valid."""
    from rlhf_cli.demo import TRAIN_FILE
    from rlhf_cli.tiny import _file_sha256

    marker = json.loads((build_tiny_base(tmp_path / "demo", **SMALL) / MARKER_FILE).read_text())
    assert "train_data" not in marker and marker["train_data_sha256"] == _file_sha256(TRAIN_FILE)


# ----------------------------------------------------------------------------------------------- SFT floor
def test_sft_floor_gives_the_tiny_model_enough_steps_on_own_data(tmp_path):
    f = write_rows(tmp_path / "mine.jsonl")
    assert own_data.sft_floor(of(sft_cfg(f)), 24, []) == -(-own_data.SFT_MIN_STEPS // 24)
    assert own_data.sft_floor(of(sft_cfg(f)), own_data.SFT_MIN_STEPS, []) is None  # one epoch is enough


@pytest.mark.parametrize("cfg_kw, overrides", [
    ({}, ["sft.num_train_epochs=1"]),          # given on the command line, even at its default
    ({}, ["+sft.max_steps=30"]),
    ({"max_steps": 30}, []),                   # set by a recipe
    ({"num_train_epochs": 3}, []),
    ({"model": "Qwen/Qwen3-0.6B"}, []),        # a pretrained model
    ({"train_path": DEMO}, []),                # the demo's data
])
def test_sft_floor_leaves_explicit_settings_alone(tmp_path, cfg_kw, overrides):
    f = write_rows(tmp_path / "mine.jsonl")
    kw = {"train_path": cfg_kw.pop("train_path", f), "model": cfg_kw.pop("model", "tiny"), **cfg_kw}
    assert own_data.sft_floor(of(sft_cfg(**kw)), 24, overrides) is None


def test_steps_per_epoch_counts_batch_accumulation_and_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert own_data.steps_per_epoch(100, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}) == 4


# ---------------------------------------------------------------------------------------------- warnings
def test_sft_and_reward_warnings_name_the_fix():
    learned_ok = {"answers_eos_rate": 1.0, "answers_ground_truth_rate": 0.375, "data_ground_truth_rate": 0.5}
    assert learned.sft_warning({**learned_ok, "steps": 504}) is None
    assert learned.sft_warning({}) is None  # nothing sampled
    assert learned.sft_warning({"answers_eos_rate": 0.9}) is None  # no checker
    noise = learned.sft_warning({"answers_eos_rate": 0.53, "eval_loss_end": 3.785, "steps": 24})
    assert "53% of its sampled answers end" in noise and "sft.num_train_epochs" in noise and "pretrained" in noise
    failing = learned.sft_warning({**learned_ok, "answers_ground_truth_rate": 0.2, "steps": 24})
    assert "20% of its sampled answers pass" in failing and "(50%)" in failing and "\n" not in failing
    assert learned.reward_warning({"eval_accuracy": 0.99}) is None
    assert learned.reward_warning({"eval_accuracy": float("nan")}) is None
    msg = learned.reward_warning({"eval_accuracy": 0.55})
    assert "0.55" in msg and "reward.num_train_epochs" in msg and "\n" not in msg


def test_ppo_repeats_the_earlier_stages_warnings(tmp_path):
    sft, rm = tmp_path / "sft", tmp_path / "reward"
    sft.mkdir(), rm.mkdir()
    (sft / "metrics.json").write_text(json.dumps({"answers_eos_rate": 0.2, "steps": 24}))
    (rm / "metrics.json").write_text(json.dumps({"eval_accuracy": 1.0}))
    assert [m.split(":")[0] for m in learned.earlier_stage_warnings(sft, rm)] == ["sft did not learn the answers"]
    assert learned.earlier_stage_warnings(tmp_path / "none", None) == []


def test_rm_gt_disagreement_by_hand():
    # scores above the mid point 0: +1 (pass: agree), +2 (fail: disagree); below: -1 (pass: disagree), -3 (fail)
    assert learned.rm_gt_disagreement([1.0, 2.0, -1.0, -3.0], [1.0, 0.0, 1.0, 0.0], 0.0) == 0.5
    assert learned.rm_gt_disagreement([1.0, -1.0], [0.9, 0.2], 0.0) == 0.0
    assert learned.rm_gt_disagreement([], [], 0.0) == 0.0


def update(score, gt, disagree=None):
    m = {"objective/scores": score, "objective/ground_truth_rate": gt}
    return m if disagree is None else {**m, "objective/rm_gt_disagreement": disagree}


def feed(rows):
    watch = learned.GamingWatch()
    return [w for i, m in enumerate(rows, 1) if (w := watch.feed(i, m))]


def test_gaming_watch_speaks_once_on_disagreement():
    said = feed([update(0.1 * i, 0.5, 0.42) for i in range(12)])
    assert len(said) == 1 and "disagree on 42%" in said[0] and "update 8" in said[0]


def test_gaming_watch_speaks_on_rising_reward_with_falling_ground_truth():
    said = feed([update(0.2 * i, 0.6 - 0.04 * i) for i in range(10)])
    assert len(said) == 1 and "score rose" in said[0]


def test_gaming_watch_is_quiet_when_reward_and_ground_truth_agree():
    assert feed([update(0.2 * i, 0.5 + 0.04 * i, 0.05) for i in range(12)]) == []
    assert feed([{"objective/scores": 0.2 * i} for i in range(12)]) == []  # no checker: nothing to compare


def test_gaming_warning_gets_a_line_of_its_own_under_the_progress_bar(tmp_path, capsys):
    """PPO's order: the watch chained first, then the console's bar; a console log handler as Hydra's. The warning
    is written through tqdm (the bar cleared, the line, the bar again), never appended to the bar's line."""
    import logging
    from types import SimpleNamespace

    from rlhf_cli.stages._console import console

    trainer = SimpleNamespace(sizes=SimpleNamespace(num_updates=10, batch_size=64), progress=SimpleNamespace(
        episodes=0), hooks=SimpleNamespace(on_update=lambda u, m: None), c=SimpleNamespace(logging_steps=1),
        work=tmp_path)
    learned.watch_gaming(trainer)
    root = logging.getLogger()
    handler = logging.StreamHandler()  # sys.stderr as capsys replaced it, where the bar writes too
    handler.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    root.addHandler(handler)
    try:
        with console(trainer, main=True):
            for i in range(1, 11):
                trainer.hooks.on_update(i, {**update(0.1 * i, 0.2, 0.9), "episodes": 64 * i, "objective/kl": 0.5,
                                            "response/length_mean": 9.0, "loss/policy_avg": 0.0,
                                            "policy/clipfrac_avg": 0.0, "eps": 10.0})
        assert handler in root.handlers  # the console's own handler put back
    finally:
        root.removeHandler(handler)
    text = capsys.readouterr()
    pieces = [x.strip() for x in (text.out + text.err).replace("\r", "\n").split("\n")]
    said = [x for x in pieces if "the reward is being gamed" in x]
    assert said and all(x.startswith("[rlhf][WARNING] - ppo: the reward is being gamed") for x in said), said
    assert sum("update 8/10" in x for x in pieces) == 1


def test_eval_progress_bar_gives_a_log_line_its_own_line(capsys):
    """rlhf eval's bar (`progress_bar`): its "eval: sft done" line was written onto the bar's."""
    import logging

    from rlhf_cli.stages._console import progress_bar

    log, root = logging.getLogger("rlhf"), logging.getLogger()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    root.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        with progress_bar(total=4, unit="resp", desc="eval") as bar:
            for name in ("sft", "ppo"):
                bar.update(2)
                bar.refresh()
                log.info("eval: %s done", name)
        assert bar.disable or bar.n == 4
        assert handler in root.handlers
    finally:
        root.removeHandler(handler)
        log.setLevel(level)
    text = capsys.readouterr()
    pieces = [x.strip() for x in text.err.replace("\r", "\n").split("\n")]
    said = [x for x in pieces if "done" in x]
    assert len(said) == 2 and all(x.startswith("[rlhf][INFO] - eval: ") for x in said), said


# ---------------------------------------------------------------------------------------------- the CLI
TINY = ["model.tiny.vocab_size=400", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
        "model.tiny.num_hidden_layers=1", "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1",
        "model.tiny.head_dim=16"]


def test_sft_on_own_data_builds_its_own_base_in_its_own_run_dir_and_says_it_did_not_learn(run_cli, tmp_path):
    f = write_rows(tmp_path / "cheer.jsonl")
    rc, out, err = run_cli("sft", "data=file", f"data.train_path={f}", "sft.max_steps=2", "sft.eval_steps=2",
                           "sft.save_steps=0", *TINY)
    assert rc == 0, err[-3000:]
    run = tmp_path / "runs/tiny-cheer"
    assert not (tmp_path / "runs/tiny").exists()  # the demo's run directory is left alone
    assert json.loads((run / "base" / MARKER_FILE).read_text())["train_data"] == "texts"
    metrics = json.loads((run / "sft/metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["answers_eos_rate"] < learned.SFT_MIN_EOS_RATE
    said = [ln for ln in (out + err).splitlines() if "sft did not learn the answers" in ln]
    assert len(said) == 1 and "sft.num_train_epochs" in said[0], out + err
    assert "floor" not in out + err  # sft.max_steps given: no step floor


@pytest.mark.slow
def test_sft_floor_through_the_cli(run_cli, tmp_path):
    f = write_rows(tmp_path / "cheer.jsonl")
    rc, out, err = run_cli("sft", "data=file", f"data.train_path={f}", "sft.save_steps=0", "sft.eval_steps=250",
                           *TINY)
    assert rc == 0, err[-3000:]
    metrics = json.loads((tmp_path / "runs/tiny-cheer/sft/metrics.json").read_text())
    assert own_data.SFT_MIN_STEPS <= metrics["steps"] < own_data.SFT_MIN_STEPS + 5  # 76 rows: 5 steps an epoch
    assert "the tiny model's floor of" in out + err


CHECKS = "def is_cheerful(response):\n    return response.strip().endswith('!')\n"


@pytest.mark.slow
def test_own_data_chain_warns_before_ppo_and_logs_rm_gt_disagreement(run_cli, tmp_path):
    """The README's own-data commands (sft, reward, ppo with a checker), cut short so that SFT does not learn:
    PPO repeats SFT's warning before its first update and logs how often the RM and the checker disagree."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    f = write_rows(tmp_path / "cheer.jsonl")
    (tmp_path / "checks.py").write_text(CHECKS)
    data = ["data=file", f"data.train_path={f}", f"data.ground_truth={tmp_path / 'checks.py'}:is_cheerful"]
    quick = ["sft.max_steps=2", "reward.max_steps=20", "ppo.total_episodes=64", "ppo.num_mini_batches=1",
             "ppo.eval_every=0", *TINY]
    for stage in ("sft", "reward", "ppo"):
        rc, out, err = run_cli(stage, *data, *quick)
        assert rc == 0, err[-3000:]
    lines = (out + err).splitlines()
    warned = [i for i, ln in enumerate(lines) if "sft did not learn the answers" in ln]
    first_update = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("update 1/")]
    assert warned and (not first_update or warned[0] < first_update[0]), out + err
    acc = EventAccumulator(str(tmp_path / "runs/tiny-cheer/ppo/tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert len(acc.Scalars("objective/rm_gt_disagreement")) == 2
