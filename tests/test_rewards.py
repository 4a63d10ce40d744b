"""Reward functions (`ppo.reward`) and ground-truth checkers (`data.ground_truth`): loading by `module:function`
or file path, what a function is given, the checks on what it returns (each bad case one error line naming the
function), the shipped examples, and `rlhf eval` reporting a checker's rate and disagreement on data that is not
the demo's."""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from rlhf_cli.errors import RlhfError
from rlhf_cli.ppo.experience import Experience
from rlhf_cli.ppo.rewards import (
    GroundTruth,
    RewardFunction,
    load_function,
    reward_inputs,
    source_names,
    weighted_sum,
)

torch.set_num_threads(1)

PROMPTS = ["p0", "p1", "p2"]
RESPONSES = ["Thanks! Rinse it.", "ugh, figure it out yourself", ""]


def rules_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rules.py"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------- loading
def test_module_and_file_references_load(tmp_path):
    from rlhf_cli import demo

    assert load_function("rlhf_cli.demo:polite_reward", "ppo.reward") is demo.polite_reward
    path = rules_file(tmp_path, """
        def score(prompts, responses):
            return [float(len(r)) for r in responses]
    """)
    fn = RewardFunction.load(f"{path}:score")
    assert fn.name == "score" and fn(PROMPTS, RESPONSES) == [17.0, 27.0, 0.0]


@pytest.mark.parametrize("spec, needle", [
    ("polite_reward", "'polite_reward' is not a function reference; use module:function or /path/file.py:function"),
    ("rlhf_cli.nosuch:f", "no module 'rlhf_cli.nosuch'"),
    ("rlhf_cli.demo:nosuch", "rlhf_cli.demo has no 'nosuch'"),
    ("rlhf_cli.demo:TRAIN_FILE", "TRAIN_FILE is a PosixPath, not a function"),
    ("/no/such/rules.py:score", "file /no/such/rules.py does not exist"),
])
def test_bad_references_name_the_key_and_the_reference(spec, needle):
    with pytest.raises(RlhfError) as e:
        RewardFunction.load(spec)
    msg = str(e.value)
    assert msg.startswith("ppo.reward: ") and needle in msg and "\n" not in msg, msg


def test_a_file_that_fails_to_import_is_named(tmp_path):
    path = rules_file(tmp_path, "def score(prompts, responses)\n    return []\n")
    with pytest.raises(RlhfError, match=rf"importing {path} failed \(SyntaxError"):
        RewardFunction.load(f"{path}:score")


def test_parameters_nobody_supplies_are_refused_when_loading(tmp_path):
    path = rules_file(tmp_path, """
        def needs_answer(prompts, responses, answer):
            return [0.0] * len(responses)
        def one_arg(responses):
            return []
    """)
    with pytest.raises(RlhfError, match="needs answer, which rlhf does not supply; it can ask for prompt_ids, "
                                        "response_ids, truncated"):
        RewardFunction.load(f"{path}:needs_answer")
    assert RewardFunction.load(f"{path}:needs_answer", extra_fields={"answer"}).wanted == {"answer"}
    with pytest.raises(RlhfError, match=r"takes 1 positional argument\(s\); it is called as fn\(prompts, responses"):
        RewardFunction.load(f"{path}:one_arg")


# ------------------------------------------------------------------------------------------ what is passed
def test_a_function_gets_only_what_it_declares_or_everything_with_kwargs(tmp_path):
    path = rules_file(tmp_path, """
        seen = {}
        def ids_only(prompts, responses, response_ids):
            seen["ids_only"] = response_ids
            return [len(i) for i in response_ids]
        def everything(prompts, responses, **kw):
            seen["everything"] = sorted(kw)
            return [0] * len(responses)
    """)
    inputs = {"prompt_ids": [[1]] * 3, "response_ids": [[5, 6], [7], []], "truncated": [False] * 3,
              "answer": ["a", "b", "c"]}
    ids_only = RewardFunction.load(f"{path}:ids_only", extra_fields={"answer"})
    assert ids_only(PROMPTS, RESPONSES, **inputs) == [2.0, 1.0, 0.0]
    everything = RewardFunction.load(f"{path}:everything", extra_fields={"answer"})
    assert everything.wanted is None and everything(PROMPTS, RESPONSES, **inputs) == [0.0, 0.0, 0.0]
    import sys

    seen = sys.modules[everything.fn.__module__].seen
    assert seen == {"ids_only": [[5, 6], [7], []],
                    "everything": ["answer", "prompt_ids", "response_ids", "truncated"]}


def test_reward_inputs_strip_padding_and_carry_the_rows_fields():
    # prompts left-padded (pad 0) to 3 tokens, responses right-padded to 3; row 1 was cut at the length limit
    exp = Experience(
        input_ids=torch.tensor([[0, 11, 12, 21, 22, 2], [13, 14, 15, 23, 24, 25]]),
        attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
        position_ids=torch.zeros(2, 6, dtype=torch.long),
        response_ids=torch.tensor([[21, 22, 2], [23, 24, 25]]),
        response_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]),
        logprobs=torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3), entropy=torch.zeros(2, 3),
        has_stop=torch.tensor([True, False]), empty=torch.tensor([False, False]), texts=["a", "b"])
    short = exp.with_(response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    got = reward_inputs(short, [{"answer": "x"}, {"answer": "y", "level": 2}])
    assert got["prompt_ids"] == [[11, 12], [13, 14, 15]]
    assert got["response_ids"] == [[21, 22], [23, 24, 25]]
    assert got["truncated"] == [False, True]
    assert got["answer"] == ["x", "y"] and got["level"] == [None, 2]


# ------------------------------------------------------------------------------------------ bad functions
BAD = """
    import math
    def raises(prompts, responses):
        return [1 // 0 for _ in responses]
    def too_few(prompts, responses):
        return [1.0] * (len(responses) - 1)
    def nan(prompts, responses):
        return [0.0, math.nan, 0.0]
    def inf(prompts, responses):
        return [0.0, 0.0, -math.inf]
    def text(prompts, responses):
        return ["1.0", 0.0, 0.0]
    def none(prompts, responses):
        return None
    def tensor(prompts, responses):
        import torch
        return torch.tensor([1.0, 2.0, 3.0])
"""


@pytest.mark.parametrize("name, needle", [
    ("raises", "raised ZeroDivisionError: integer division or modulo by zero; fix it (it got 3 responses)"),
    ("too_few", "returned 2 values for 3 responses; return one float per response"),
    ("nan", "returned a non-finite value (nan) for response 1; return finite floats"),
    ("inf", "returned a non-finite value (-inf) for response 2"),
    ("text", "returned '1.0' (str) for response 0; return one float per response"),
    ("none", "returned a NoneType, not a list"),
])
def test_a_bad_function_stops_with_one_line_naming_it(tmp_path, name, needle):
    path = rules_file(tmp_path, BAD)
    fn = RewardFunction.load(f"{path}:{name}")
    with pytest.raises(RlhfError) as e:
        fn(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert msg.startswith(f"ppo.reward function {path}:{name} ") and needle in msg and "\n" not in msg, msg


def test_a_tensor_of_scores_is_accepted(tmp_path):
    assert RewardFunction.load(f"{rules_file(tmp_path, BAD)}:tensor")(PROMPTS, RESPONSES) == [1.0, 2.0, 3.0]


# ------------------------------------------------------------------------------------------ sum of sources
def test_weighted_sum_and_source_names():
    a, b = torch.tensor([1.0, -1.0]), torch.tensor([0.0, 4.0])
    torch.testing.assert_close(weighted_sum([a, b], (1.0, 0.5)), torch.tensor([1.0, 1.0]))
    assert weighted_sum([a], (1.0,)) is a  # one source of weight 1: the score itself, untouched
    torch.testing.assert_close(weighted_sum([a], (2.0,)), torch.tensor([2.0, -2.0]))
    assert source_names(("model", "rlhf_cli.demo:polite_reward", "/x/other.py:polite_reward")) == \
        ["model", "polite_reward", "polite_reward_2"]


# ------------------------------------------------------------------------------------------ shipped examples
def test_demo_reward_functions_by_hand():
    from rlhf_cli.demo import length_format_reward, polite_reward

    assert polite_reward(PROMPTS, RESPONSES) == [1.0, 0.0, 0.0]
    got = length_format_reward(PROMPTS, ["Rinse it.", "Rinse it", "Rinse it!", "  "],
                               [[1] * 5, [1] * 5, [1] * 30, []], [False, False, False, True])
    # sentence end + stopped within 24 tokens; no sentence end; sentence end but 30 tokens; empty
    assert got == [1.0, 0.5, 0.5, 0.0]
    # both load through ppo.reward with what they declare
    assert RewardFunction.load("rlhf_cli.demo:polite_reward").wanted == frozenset()
    assert RewardFunction.load("rlhf_cli.demo:length_format_reward").wanted == {"response_ids", "truncated"}


# ------------------------------------------------------------------------------------------ ground truth
def test_ground_truth_builtin_and_functions(tmp_path):
    gt = GroundTruth.load("demo_polite")
    assert gt.spec == "rlhf_cli.demo:is_polite" and gt(RESPONSES) == [1.0, 0.0, 0.0]
    assert GroundTruth.load(None) is None
    path = rules_file(tmp_path, """
        def partial(text, prompt):
            return 0.5 if prompt == "p1" else 1.0
        def out_of_range(text):
            return 2.0
        def raises(text):
            raise KeyError("answer")
        def needs_answer(text, answer):
            return answer in text
    """)
    assert GroundTruth.load(f"{path}:partial")(RESPONSES, PROMPTS) == [1.0, 0.5, 1.0]
    with pytest.raises(RlhfError, match=r"returned 2.0 for response 0; return a bool or a number in \[0, 1\]"):
        GroundTruth.load(f"{path}:out_of_range")(RESPONSES)
    with pytest.raises(RlhfError, match=r"^data.ground_truth function .*:raises raised KeyError: 'answer' on "
                                        r"response 0"):
        GroundTruth.load(f"{path}:raises")(RESPONSES)
    with pytest.raises(RlhfError, match="^data.ground_truth: .* needs answer, which rlhf does not supply"):
        GroundTruth.load(f"{path}:needs_answer")
    checker = GroundTruth.load(f"{path}:needs_answer", extra_fields={"answer"})
    assert checker(["it is 4", "5"], rows=[{"answer": "4"}, {"answer": "4"}]) == [1.0, 0.0]


def mentions_rice(text: str) -> bool:
    """The checker the eval test names by this file's path: does the answer talk about rice?"""
    return "rice" in text.lower()


def test_eval_reports_a_ground_truth_function_on_other_data(tmp_path, monkeypatch):
    """data.ground_truth=<file>:<function> on a data file that is not the demo's: `rlhf eval`'s report has the
    ground-truth rate, the RM score on failures and the RM/ground-truth disagreement for every policy."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForSequenceClassification

    from rlhf_cli.config import compose
    from rlhf_cli.stages import eval as eval_stage
    from rlhf_cli.tiny import build_tiny_base

    base = build_tiny_base(tmp_path / "base", vocab_size=600, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    rm = shutil.copytree(base, tmp_path / "rm")  # a reward model must be a sequence classifier: the base with a head
    AutoModelForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(rm)
    data = tmp_path / "cooking.jsonl"
    rows = [{"prompt": f"How long do I boil {food}?", "completion": f"Boil the {food} for {i} minutes."}
            for i, food in enumerate(["rice", "pasta", "eggs", "potatoes", "rice noodles", "beans"] * 2)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    cfg = compose("eval", ["data=file", f"data.train_path={data}", f"data.eval_path={data}",
                           f"data.ground_truth={Path(__file__).resolve()}:mentions_rice",
                           f"ppo.policy_dir={base}", f"eval.reward_dir={rm}", "~eval.policies.ppo",
                           f"eval.output_dir={tmp_path / 'eval'}", "eval.num_prompts=12", "eval.batch_size=6",
                           "eval.response_length=8", "device.threads=1"])
    OmegaConf.update(cfg, "eval.policies", {"sft": str(base), "again": str(base)}, merge=False)
    eval_stage.run(cfg)

    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["ground_truth"].endswith("test_rewards.py:mentions_rice")
    for name in ("sft", "again"):
        row = report["policies"][name]
        assert 0.0 <= row["ground_truth_rate"] <= 1.0 and 0.0 <= row["rm_gt_disagreement"] <= 1.0
        assert "rm_score_mean_on_gt_fail" in row and "rm_score_mean_on_gt_pass" in row
    lines = [json.loads(x) for x in (tmp_path / "eval" / "responses.jsonl").read_text().splitlines()]
    sft = [x for x in lines if x["policy"] == "sft"]
    assert [x["ground_truth"] for x in sft] == [float(mentions_rice(x["response"])) for x in sft]
    rate = report["policies"]["sft"]["ground_truth_rate"]
    assert math.isclose(sum(x["ground_truth"] for x in sft) / len(sft), rate)
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "| ground_truth_rate |" in md and "| rm_gt_disagreement |" in md and "mentions_rice" in md


# ------------------------------------------------------------------------------------- user code that exits
EXITS = """
    import sys
    def exits(prompts, responses):
        sys.exit(2)
    def bare_exit(prompts, responses):
        sys.exit()
    def generator_exit(prompts, responses):
        raise GeneratorExit
    def ctrl_c(prompts, responses):
        raise KeyboardInterrupt
    def lazy_exit(prompts, responses):
        yield 1.0
        sys.exit("done")
    def checker_exits(text):
        sys.exit(1)
"""


@pytest.mark.parametrize("name, needle", [
    ("exits", ("called sys.exit(2) while scoring 3 responses; return the scores instead, or remove it from "
               "ppo.reward")),
    ("bare_exit", "called sys.exit() while scoring"),
    ("generator_exit", "raised GeneratorExit while scoring"),
    ("lazy_exit", "called sys.exit('done') while scoring"),  # in the generator it returned, read by rlhf
])
def test_a_function_that_exits_is_one_line_naming_it(tmp_path, name, needle):
    path = rules_file(tmp_path, EXITS)
    with pytest.raises(RlhfError) as e:
        RewardFunction.load(f"{path}:{name}")(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert msg.startswith(f"ppo.reward function {path}:{name} ") and needle in msg and "\n" not in msg, msg


def test_ctrl_c_in_a_function_stays_ctrl_c(tmp_path):
    """KeyboardInterrupt is the user's Ctrl-C: the CLI stops with its resume hint, not a blame on the function."""
    with pytest.raises(KeyboardInterrupt):
        RewardFunction.load(f"{rules_file(tmp_path, EXITS)}:ctrl_c")(PROMPTS, RESPONSES)


def test_a_checker_that_exits_is_one_line_naming_it(tmp_path):
    with pytest.raises(RlhfError) as e:
        GroundTruth.load(f"{rules_file(tmp_path, EXITS)}:checker_exits")(RESPONSES)
    msg = str(e.value)
    assert msg.startswith("data.ground_truth function ") and ":checker_exits called sys.exit(1) on response 0 " \
        "('Thanks! Rinse it.'); return a bool or a number in [0, 1] instead, or set data.ground_truth=null" in msg


ARGPARSE_AT_IMPORT = """
    import argparse
    parser = argparse.ArgumentParser(prog="rlhf")
    parser.add_argument("--n", type=int)
    args = parser.parse_args(["ppo", "ppo.reward=[x]"])  # what `rlhf ppo ...` gives sys.argv
    def score(prompts, responses):
        return [0.0] * len(responses)
    def check(text):
        return True
"""


def test_a_module_that_exits_at_import_is_one_line_not_its_own_error(tmp_path, capsys):
    """argparse at import prints `rlhf: error: unrecognized arguments` (which reads as rlhf's own) and exits 2:
    that line is quoted in ours and not printed on its own."""
    path = rules_file(tmp_path, ARGPARSE_AT_IMPORT)
    for load, key in ((RewardFunction.load, "ppo.reward"), (GroundTruth.load, "data.ground_truth")):
        name = "score" if key == "ppo.reward" else "check"
        with pytest.raises(RlhfError) as e:
            load(f"{path}:{name}")
        msg = str(e.value)
        assert msg.startswith(f"{key}: {path}:{name}: importing {path} called sys.exit(2) after printing "
                              "'rlhf: error: unrecognized arguments: ppo ppo.reward=[x]'; the module is imported, "
                              'not run: put its command-line code under `if __name__ == "__main__":`'), msg
        assert "\n" not in msg
    assert "unrecognized arguments" not in capsys.readouterr().err


def test_a_module_by_name_that_exits_at_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "exits_at_import_mod.py").write_text("import sys\nsys.exit(3)\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RlhfError, match=r"^ppo.reward: exits_at_import_mod:score: importing exits_at_import_mod "
                                        r"called sys.exit\(3\); the module is imported, not run"):
        RewardFunction.load("exits_at_import_mod:score")


def test_what_a_module_prints_at_import_is_passed_on(tmp_path, capsys):
    path = rules_file(tmp_path, """
        import sys
        print("loading rules", file=sys.stderr)
        def score(prompts, responses):
            return [0.0] * len(responses)
    """)
    assert RewardFunction.load(f"{path}:score")(PROMPTS, RESPONSES) == [0.0, 0.0, 0.0]
    assert "loading rules" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- what may be returned
RETURNS = """
    import numpy as np
    import torch
    def as_dict(prompts, responses):
        return {i: 0.5 for i in range(len(responses))}
    def as_set(prompts, responses):
        return {0.0, 1.0, 2.0}
    def as_text(prompts, responses):
        return "101"
    def as_bytes(prompts, responses):
        return b"101"
    def long_generator(prompts, responses):
        while True:
            yield 1.0
    def short_generator(prompts, responses):
        yield 1.0
    def generator(prompts, responses):
        return (float(len(r) > 0) for r in responses)
    def matrix(prompts, responses):
        return torch.zeros(3, 2)
    def nested(prompts, responses):
        return [[1.0], [0.0], [0.0]]
    def numpy_array(prompts, responses):
        return np.array([1, 0, 2], dtype=np.int64)
    def numpy_scalars(prompts, responses):
        return [np.float32(0.5), np.float64(1.0), np.int32(2)]
    def column(prompts, responses):
        return torch.tensor([[1.0], [2.0], [3.0]])
    def bools(prompts, responses):
        return [True, False, True]
    def one_number(prompts, responses):
        return torch.tensor(4.0)
"""


@pytest.mark.parametrize("name, needle", [
    ("as_dict", ("returned a dict ({0: 0.5, 1: 0.5, 2: 0.5}), not a list; return one float per response (3), "
                 "in order")),
    ("as_set", "returned a set ({0.0, 1.0, 2.0}), not a list"),
    ("as_text", "returned a str ('101'), not a list"),
    ("as_bytes", "returned a bytes (b'101'), not a list"),
    ("long_generator", "returned more than 3 values for 3 responses"),
    ("short_generator", "returned 1 values for 3 responses"),
    ("matrix", "returned a Tensor of shape (3, 2); return one float per response (3), in order"),
    ("nested", "returned [1.0] (list) for response 0; return one float per response"),
])
def test_a_return_value_that_is_not_one_number_per_response_is_refused(tmp_path, name, needle):
    fn = RewardFunction.load(f"{rules_file(tmp_path, RETURNS)}:{name}")
    with pytest.raises(RlhfError) as e:
        fn(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert msg.startswith(f"ppo.reward function {fn.spec} ") and needle in msg and "\n" not in msg, msg


@pytest.mark.parametrize("name, want", [
    ("generator", [1.0, 1.0, 0.0]),
    ("numpy_array", [1.0, 0.0, 2.0]),
    ("numpy_scalars", [0.5, 1.0, 2.0]),
    ("column", [1.0, 2.0, 3.0]),
    ("bools", [1.0, 0.0, 1.0]),  # a pass / fail reward: 1 / 0
])
def test_sequences_arrays_and_numpy_numbers_are_accepted(tmp_path, name, want):
    got = RewardFunction.load(f"{rules_file(tmp_path, RETURNS)}:{name}")(PROMPTS, RESPONSES)
    assert got == want and all(type(x) is float for x in got)


def test_a_0d_tensor_scores_a_single_response(tmp_path):
    assert RewardFunction.load(f"{rules_file(tmp_path, RETURNS)}:one_number")(["p"], ["r"]) == [4.0]


# ------------------------------------------------------------------------------------- magnitude
HUGE = """
    def huge(prompts, responses):
        return [1.0, -1e300, 5e299]
    def edge(prompts, responses):
        return [1e4, -1e4, 0.0]
"""


def test_a_score_beyond_reward_max_abs_is_one_line_naming_the_function(tmp_path):
    from rlhf_cli.ppo.rewards import DEFAULT_MAX_ABS

    path = rules_file(tmp_path, HUGE)
    fn = RewardFunction.load(f"{path}:huge")
    assert fn.max_abs == DEFAULT_MAX_ABS == 1e4
    with pytest.raises(RlhfError) as e:
        fn(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert msg == (f"ppo.reward function {path}:huge returned -1e+300 for response 1, beyond "
                   "ppo.reward_max_abs=10000; rescale its rewards, or raise ppo.reward_max_abs (null: no limit)"), msg
    assert RewardFunction.load(f"{path}:edge")(PROMPTS, RESPONSES) == [1e4, -1e4, 0.0]  # the bound itself is fine
    assert RewardFunction.load(f"{path}:huge", max_abs=None)(PROMPTS, RESPONSES) == [1.0, -1e300, 5e299]
    with pytest.raises(RlhfError, match=r"returned 10000 for response 0, beyond ppo.reward_max_abs=100;"):
        RewardFunction.load(f"{path}:edge", max_abs=100)(PROMPTS, RESPONSES)
