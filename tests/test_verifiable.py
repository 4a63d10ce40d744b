"""Verifiable tasks: the unbiased pass@k estimator by hand, pass@1 / pass@k / mean@k and the truncation rate
over k samples per prompt (`eval.samples_per_prompt`) in `rlhf eval`'s report and in PPO's `eval/*`, and the
shipped tiny-math task (data, checker, rule reward) through the real CLI."""

from __future__ import annotations

import contextlib
import json
import math
from types import SimpleNamespace

import pytest
import torch
from clitools import EVAL_ROWS

from rlhf_cli.demo import arithmetic
from rlhf_cli.ppo import evaluation
from rlhf_cli.ppo.evaluation import Evaluator, metric_names, pass_at_k
from rlhf_cli.ppo.experience import Sampling
from rlhf_cli.ppo.rewards import GroundTruth


# ------------------------------------------------------------------------------------------- the estimator
def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is c/n
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0  # k = n: any sample passes
    assert pass_at_k(5, 0, 2) == 0.0  # c = 0
    assert pass_at_k(5, 4, 2) == 1.0 and pass_at_k(5, 5, 5) == 1.0  # n - c < k: every draw of k holds a pass
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    # large n: no binomial is formed (C(2000, 1000) overflows a float)
    assert pass_at_k(2000, 1000, 1000) == pytest.approx(1.0) and pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)
    for bad in ((5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def test_summarise_groups_k_samples_per_prompt():
    """Two prompts × 4 samples: one pass in the first group, three (0.6 counts) in the second."""
    s = {"texts": ["x"] * 8, "rm_score": [None] * 8, "kl": [0.0] * 8, "length": [3] * 8,
         "eos": [True, True, False, True, True, True, True, False], "empty": [False] * 8,
         "ground_truth": [1, 0, 0, 0, 1, 1, 0, 0.6]}
    row = evaluation.summarise(s, 4)
    assert row["pass_at_1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert row["pass_at_k"] == pytest.approx(1.0)
    assert row["mean_at_k"] == pytest.approx((0.25 + 2.6 / 4) / 2) == pytest.approx(row["ground_truth_rate"])
    assert row["truncation_rate"] == pytest.approx(2 / 8) and row["eos_rate"] == pytest.approx(6 / 8)
    two = evaluation.summarise(s, 2)  # four prompts of two: [1,0] [0,0] [1,1] [0,0.6]
    assert two["pass_at_k"] == pytest.approx(3 / 4) and two["pass_at_1"] == pytest.approx((0.5 + 0 + 1 + 0.5) / 4)
    with pytest.raises(ValueError, match="not a whole number of groups of 3"):
        evaluation.summarise(s, 3)
    no_gt = evaluation.summarise({**s, "ground_truth": None}, 4)
    assert no_gt["truncation_rate"] == pytest.approx(0.25) and "pass_at_1" not in no_gt


def test_rm_gt_disagreement_in_a_report_is_ppos_by_the_reward_stages_mean():
    """Four responses, the checker passing the first two, the reward stage's mean score 0: disagreeing are the
    passing one scored below 0 and the failing one scored above it (2 of 4); a policy whose responses all pass and
    all score above the line disagrees on none (the old line, the mean score of passing responses, put half of
    them below it)."""
    s = {"texts": ["x"] * 4, "rm_score": [2.0, -1.0, 0.5, -3.0], "kl": [0.0] * 4, "length": [3] * 4,
         "eos": [True] * 4, "empty": [False] * 4, "ground_truth": [1, 1, 0, 0]}
    assert evaluation.summarise(s, 1, rm_line=0.0)["rm_gt_disagreement"] == pytest.approx(2 / 4)
    all_pass = {**s, "rm_score": [3.0, 2.5, 4.0, 3.5], "ground_truth": [1, 1, 1, 1]}
    assert evaluation.summarise(all_pass, 1, rm_line=0.0)["rm_gt_disagreement"] == 0.0
    # without the reward stage's line: the responses' own mean score (-0.375): 2.0 and 0.5 above, -1.0, -3.0 below
    assert evaluation.summarise(s, 1)["rm_gt_disagreement"] == pytest.approx(2 / 4)


def test_report_with_one_response_per_prompt_shows_pass_at_1_once():
    from rlhf_cli.stages.eval import markdown

    row = {"rm_score_mean": 1.0, "ground_truth_rate": 0.5, "pass_at_1": 0.5, "pass_at_k": 0.5, "mean_at_k": 0.5}
    report = {"num_prompts": 2, "samples_per_prompt": 1, "response_cap": 8, "policies": {"sft": row},
              "win_rate": {}, "samples": {}}
    assert markdown(report).count("| pass@1 |") == 1 and "| mean@1 |" not in markdown(report)
    four = markdown({**report, "samples_per_prompt": 4})
    assert "| pass@1 |" in four and "| pass@4 |" in four and "| mean@4 |" in four


def test_metric_names_pass_at_k_only_with_a_checker():
    assert not {"eval/pass_at_1", "eval/pass_at_k", "eval/mean_at_k"} & set(metric_names(True, False))
    assert {"eval/pass_at_1", "eval/pass_at_k", "eval/mean_at_k"} <= set(metric_names(False, True))


def test_the_evaluator_samples_k_responses_per_prompt(base, tok):
    """`ppo.eval_every` with eval.samples_per_prompt=3: each held-out prompt is checked three times in a row (with
    its row), and eval/* holds pass@1, pass@k, mean@k and the truncation rate as `summarise` gives them."""
    from rlhf_cli.models import load_causal_lm

    seen = []
    gt = GroundTruth("seen", lambda text, prompt, answer: seen.append((prompt, answer)) or len(text) > 4,
                     frozenset({"prompt", "answer"}))
    s = Sampling(max_new_tokens=5, temperature=1.0, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                 stop_ids=(tok.eos_token_id,), forward_batch_size=4, vocab_size=len(tok))
    prompts = ["1+2=", "3+4=", "5+6="]
    ev = Evaluator(prompts, s, seed=1, rows=[{"answer": "3"}, {"answer": "7"}, {"answer": "11"}], ground_truth=gt,
                   samples_per_prompt=3)
    policy = load_causal_lm(base, torch.float32).eval()
    trainer = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"), unwrapped=policy, ref=None, reward=None,
                              tok=tok, autocast=contextlib.nullcontext)
    m = ev(trainer)
    assert seen == [(p, a) for p, a in zip(prompts, ["3", "7", "11"]) for _ in range(3)]
    assert set(m) == set(metric_names(reward_model=False, ground_truth=True))
    assert 0.0 <= m["eval/pass_at_1"] <= m["eval/pass_at_k"] <= 1.0
    assert m["eval/mean_at_k"] == pytest.approx(m["eval/ground_truth_rate"])
    assert m["eval/truncation_rate"] == pytest.approx(1 - m["eval/eos_rate"])


# ------------------------------------------------------------------------------------------- tiny-math
def test_tiny_math_data_is_reproducible_and_held_out():
    train, test = arithmetic.generate()
    assert (train, test) == arithmetic.generate()  # the same seed, the same rows
    shipped = [[json.loads(x) for x in f.read_text().splitlines()]
               for f in (arithmetic.TRAIN_FILE, arithmetic.TEST_FILE)]
    assert shipped == [train, test]  # the files are what the generator writes
    pair = lambda r: frozenset(int(x) for x in r["question"].rstrip("=").split("+"))  # noqa: E731
    assert not {pair(r) for r in train} & {pair(r) for r in test}
    for r in train + test:
        a, b = (int(x) for x in r["question"].rstrip("=").split("+"))
        assert r["chosen"] == r["answer"] == str(a + b) and r["rejected"] != r["answer"]
    assert len(test) == arithmetic.TEST_PAIRS


def test_exact_match_checker_and_reward():
    assert arithmetic.is_correct(" 82\n", "82") and not arithmetic.is_correct("82 ", "28")
    assert not arithmetic.is_correct("820", "82") and not arithmetic.is_correct("", "0")
    assert arithmetic.exact_match_reward(["p", "q", "r"], ["82", "8", "7"], answer=["82", "82", "7"]) == [1.0, 0.0,
                                                                                                         1.0]


@pytest.mark.slow
def test_rlhf_eval_reports_pass_at_k_and_the_truncation_rate(run_cli, tmp_path):
    """A short tiny-math SFT, then `rlhf eval eval.samples_per_prompt=3`: report.json and report.md carry pass@1,
    pass@3, mean@3, the truncation rate and the cap; pass@k recomputed from responses.jsonl agrees."""
    rc, _, err = run_cli("sft", "recipe=tiny-math", "device.threads=1", "sft.max_steps=20", "sft.eval_steps=20",
                         "data.max_rows=320", EVAL_ROWS)  # the 20 steps of 16 (every run tokenizes all its rows)
    assert rc == 0, err[-3000:]
    rc, out, err = run_cli("eval", "recipe=tiny-math", "device.threads=1", "eval.policies.ppo=null",
                           "eval.reward_dir=null", "eval.num_prompts=8", "eval.samples_per_prompt=3",
                           "eval.response_length=2")
    assert rc == 0, err[-3000:]
    ev = tmp_path / "runs/tiny-math/eval"
    r = json.loads((ev / "report.json").read_text())
    assert (r["num_prompts"], r["samples_per_prompt"], r["response_cap"]) == (8, 3, 2)
    row = r["policies"]["sft"]
    rows = [json.loads(x) for x in (ev / "responses.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and all(rows[i]["prompt"] == rows[i - i % 3]["prompt"] for i in range(24))
    passed = [sum(x["ground_truth"] >= 0.5 for x in rows[i: i + 3]) for i in range(0, 24, 3)]
    assert row["pass_at_k"] == pytest.approx(sum(c > 0 for c in passed) / 8)
    assert row["pass_at_1"] == pytest.approx(sum(passed) / 24) == pytest.approx(row["mean_at_k"])
    # a cap of 2 tokens cuts every sum of two digits before its stop token
    assert row["truncation_rate"] >= 0.5 and row["truncation_rate"] == pytest.approx(1 - row["eos_rate"])
    md = (ev / "report.md").read_text()
    for label in ("| pass@1 |", "| pass@3 |", "| mean@3 |", "| truncation_rate |", "at most 2 tokens each"):
        assert label in md, label
    assert "pass@1" in out and "pass@3" in out and "(cap 2)" in out
