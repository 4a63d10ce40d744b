"""Bad keys and values through the real `rlhf` command, one row per case: each must end with a non-zero exit
and a single error line that names the key (and the value and what is allowed), without a traceback. Config
errors fail at validation, before any model is built or any stage directory is made: about a second a row.

Adding a case is adding a row to CASES: `Case("<rlhf arguments>", "<text of the error line>")`, with
`files=(("name", "contents"),)` for input files written into the (empty) working directory first,
`{tiny_base}` in the arguments for a prebuilt tiny base model (`{rm_dir}`: a reward model's kind made from it,
`{pickled}`: it with pickle weights), and `early=False` for a failure that comes after models load.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Case:
    args: str                               # what follows `rlhf`, split as a shell would
    needle: str                             # text the one error line contains
    files: tuple[tuple[str, str | bytes], ...] = ()  # (name, contents) written into the working directory first
    rc: int = 2                             # RlhfError's exit status
    early: bool = True                      # fails before any model or stage output is made


CASES = [
    # sft: trainer sizes and rates, unknown keys in both override forms
    Case("sft sft.learning_rate=nan", "sft.learning_rate=nan is not a finite number; use a number > 0"),
    Case("sft sft.per_device_train_batch_size=0", "sft.per_device_train_batch_size=0 is out of range"),
    Case("sft sft.gradient_accumulation_steps=0", "sft.gradient_accumulation_steps=0 is out of range"),
    Case("sft sft.max_steps=0", "sft.max_steps=0 is out of range; use -1 or a whole number ≥ 1"),
    Case("sft sft.max_steps=ten", "sft.max_steps=ten is not an integer"),
    Case("sft data.max_eval_rows=0", "data.max_eval_rows=0 is out of range; use a whole number ≥ 1, or null"),
    Case("sft +sft.max_step=2", "sft.max_step is not a config key; did you mean sft.max_steps?"),
    Case("sft sft.max_step=2", "sft.max_step is not a config key; did you mean sft.max_steps?"),
    Case("sft sft.warmup_ratio=1.5", "sft.warmup_ratio=1.5 is out of range; use a number in [0, 1)"),
    Case("sft sft.lora.dropout=1.0", "sft.lora.dropout=1.0 is out of range; use a number in [0, 1)"),
    Case("sft sft.lora.r=0", "sft.lora.r=0 is out of range"),
    Case("sft sft.activation_checkpointing=maybe", "sft.activation_checkpointing=maybe is not true or false"),
    Case("sft sft.lr_scheduler_type=cosinus", "sft.lr_scheduler_type=cosinus is unknown"),
    Case("sft sft.lr_scheduler_type=warmup_stable_decay", "sft.lr_scheduler_type=warmup_stable_decay needs"),
    Case("sft seed=abc", "seed=abc is not an integer; use a whole number in [0, 4294967295]"),
    # data and model
    Case("sft data.eval_ratio=1", "data.eval_ratio=1 is out of range; use a number in [0, 1)"),
    Case("sft data.format=csv", "data.format=csv is unknown; use one of auto, seed, prompt"),
    Case("sft data.max_prompt_length=-5", "data.max_prompt_length=-5 is out of range"),
    Case("sft data.ground_truth=polite", "data.ground_truth=polite is unknown; use demo_polite or null"),
    Case("sft model.dtype=float64", "model.dtype=float64 is unknown; use one of auto"),
    Case("sft model.hub=github", "model.hub=github is unknown; use modelscope or hf"),
    Case("sft model.tiny.vocab_size=100", "model.tiny.vocab_size=100 is out of range; use a whole number ≥"),
    # device
    Case("sft device.mixed_precision=fp8", "device.mixed_precision=fp8 is unknown"),
    Case("sft device.threads=-1", "device.threads=-1 is out of range; use a whole number ≥ 0"),
    Case("sft device.num_processes=two", "device.num_processes=two is not an integer; use auto"),
    Case("sft device.zero_stage=4", "device.zero_stage=4 is out of range; use a whole number in [0, 3]"),
    Case("sft device.main_process_port=70000", "device.main_process_port=70000 is out of range"),
    Case("sft device.fsdp.version=3", "device.fsdp.version=3 is out of range"),
    Case("sft device.collective_timeout_s=0", "device.collective_timeout_s=0 is out of range"),
    # reward
    Case("reward reward.learning_rate=0", "reward.learning_rate=0 is out of range; use a number > 0"),
    Case("reward reward.center_rewards_coefficient=-1", "reward.center_rewards_coefficient=-1 is out"),
    Case("reward reward.max_length=0", "reward.max_length=0 is out of range"),
    Case("reward +reward.lora.r=4", "reward.lora.r is not a config key"),
    # ppo
    Case("ppo ppo.total_episodes=abc", "ppo.total_episodes=abc is not an integer; use a whole number ≥ 1"),
    Case("ppo ppo.num_mini_batches=0", "ppo.num_mini_batches=0 is out of range"),
    Case("ppo ppo.kl_estimator=k2", "ppo.kl_estimator=k2 is unknown; use one of k1, k3, abs, mse"),
    Case("ppo ppo.stop_token=eot", "ppo.stop_token=eot is unknown; use eos or null"),
    Case("ppo ppo.recompute_logprobs=sometimes", "ppo.recompute_logprobs=sometimes is unknown"),
    Case("ppo ppo.temperature=0", "ppo.temperature=0 is out of range; use a number > 0"),
    Case("ppo ppo.top_p=1.5", "ppo.top_p=1.5 is out of range; use a number in (0, 1]"),
    Case("ppo ppo.gamma=1.1", "ppo.gamma=1.1 is out of range; use a number in [0, 1]"),
    Case("ppo ppo.cliprange=inf", "ppo.cliprange=inf is not a finite number"),
    Case("ppo ppo.value_learning_rate=-1e-4", "ppo.value_learning_rate=-0.0001 is out of range"),
    Case("ppo ppo.first_update_kl_tolerance=0", "ppo.first_update_kl_tolerance=0 is out of range"),
    Case("ppo ppo.stop_token_ids=[1,x]", "ppo.stop_token_ids=[1, x] is not a list of token ids"),
    Case("ppo ppo.lora.target_modules=[]", "ppo.lora.target_modules=[] is not a module name"),
    Case("ppo +ppo.target_kl_value=3", "ppo.target_kl_value is now ppo.adaptive_kl_target"),
    Case("ppo +ppo.lora.dropout=0.1", "ppo.lora.dropout is not a config key any more"),
    Case("ppo ppo.advantage=grpo",
         "ppo.advantage=grpo compares the responses to one prompt, but ppo.samples_per_prompt=1"),
    Case("ppo ppo.advantage=ppo", "ppo.advantage=ppo is unknown; use one of gae, grpo, rloo, reinforce_pp"),
    Case("ppo ppo.reward=[rewardmodel]", "ppo.reward: rewardmodel is not a reward source"),
    # dpo
    Case("dpo dpo.beta=0", "dpo.beta=0 is out of range; use a number > 0"),
    Case("dpo dpo.beta=-0.1", "dpo.beta=-0.1 is out of range; use a number > 0"),
    Case("dpo dpo.loss_type=kto", "dpo.loss_type=kto is unknown; use one of sigmoid, ipo, robust, hinge"),
    Case("dpo dpo.label_smoothing=0.5", "dpo.label_smoothing=0.5 is out of range; use a number in [0, 0.5)"),
    Case("dpo dpo.policy_dir=nowhere/sft", "SFT model (dpo.policy_dir) not found at nowhere/sft: run `rlhf sft` first"),
    Case("dpo dpo.lora.target_modules=[q_proj,lm_head]", "dpo.lora.target_modules names lm_head"),
    # eval
    Case("eval eval.num_prompts=0", "eval.num_prompts=0 is out of range"),
    Case("eval eval.batch_size=abc", "eval.batch_size=abc is not an integer"),
    Case("eval eval.policies=null", "eval.policies=null is not allowed"),
    Case("eval eval.greedy=2", "eval.greedy=2 is not true or false"),
    # chat
    Case("chat chat.max_new_tokens=0", "chat.max_new_tokens=0 is out of range"),
    Case("chat chat.top_k=-1", "chat.top_k=-1 is out of range; use a whole number ≥ 0"),
    Case("chat chat.temperature=-0.7", "chat.temperature=-0.7 is out of range; use a number > 0"),
    Case("chat +chat.tempreature=1", "chat.tempreature is not a config key; did you mean chat.temperature"),
    # doctor and export
    Case("doctor doctor.stages=[sft,rlhf]", "doctor.stages: rlhf is unknown; use a list of sft"),
    Case("doctor doctor.timeout_s=0", "doctor.timeout_s=0 is out of range; use a number > 0"),
    Case("doctor doctor.memory_gib=-4", "doctor.memory_gib=-4 is out of range; use a number > 0, or null"),
    Case("export +export.dir=out", "export.dir is not a config key; export has output_dir"),
    Case("export export.output_dir=", "export.output_dir is empty"),
    Case("push push.dir=nope push.repo_id=me/x", "push.dir=nope is not a directory; give an output of rlhf sft"),
    Case("push push.dir=out push.repo_id=me/x push.dry_run=true", "push.dir=out is not a model written by rlhf",
         files=(("out/notes.txt", "not a model"),)),
    # files and faults: they fail after validation; the files given are byte-identical afterwards
    Case("sft model.tiny.dir={tiny_base} sft.output_dir=mine", "mine exists and was not written by rlhf",
         files=(("mine/notes.txt", "my own notes"),), early=False),
    Case("sft model.tiny.dir={tiny_base} data.train_path=gbk.jsonl data.eval_path=null",
         "gbk.jsonl: not UTF-8 (line 2); convert it, e.g. `iconv -f GBK -t UTF-8",
         files=(("gbk.jsonl", ('{"question": "q", "chosen": "a", "rejected": "b"}\n'
                               '{"question": "你好", "chosen": "谢谢", "rejected": "走开"}\n').encode("gbk")),)),
    Case("reward reward.init_from={tiny_base} data.train_path=pairs.jsonl data.eval_path=null",
         "pairs.jsonl: line 9 is missing required key(s) chosen, rejected",
         files=(("pairs.jsonl", '{"question": "q", "chosen": "a", "rejected": "b"}\n' * 4 + "\n\n\n\n"
                 + '{"question": "q"}\n'),)),
    Case("sft device=cuda model.tiny.dir={tiny_base}", "needs a CUDA GPU, but torch sees none", early=False),
    Case("dpo dpo.policy_dir={tiny_base} data.train_path=sft.jsonl data.eval_path=null",
         "data.train_path has no rejected answers (sft.jsonl): this stage needs preference pairs",
         files=(("sft.jsonl", '{"prompt": "q", "completion": "a"}\n' * 4),), early=False),
    Case("ppo ppo.resume=true ppo.policy_dir={tiny_base} ppo.reward=[rlhf_cli.demo:polite_reward] ppo.value_init=sft",
         "no interrupted run to resume", early=False),
    # reward functions that would end the run without a word, or train on something that is no score
    Case("ppo ppo.policy_dir={tiny_base} ppo.reward=[rules.py:score] ppo.value_init=sft",
         "rules.py called sys.exit(2) after printing",
         files=(("rules.py", "import argparse\nargparse.ArgumentParser().parse_args()\n"
                             "def score(prompts, responses):\n    return [0.0] * len(responses)\n"),), early=False),
    Case("ppo ppo.policy_dir={tiny_base} ppo.reward=[quits.py:score] ppo.value_init=sft",
         "ppo.reward function quits.py:score called sys.exit(3) while scoring",
         files=(("quits.py", "import sys\ndef score(prompts, responses):\n    sys.exit(3)\n"),), early=False),
    Case("ppo ppo.policy_dir={tiny_base} ppo.reward=[keyed.py:score] ppo.value_init=sft",
         "ppo.reward function keyed.py:score returned a dict",
         files=(("keyed.py", "def score(prompts, responses):\n    return {i: 1.0 for i in range(len(responses))}\n"),),
         early=False),
    Case("ppo ppo.policy_dir={tiny_base} ppo.reward=[huge.py:score] ppo.value_init=sft",
         "beyond ppo.reward_max_abs=10000; rescale its rewards",
         files=(("huge.py", "def score(prompts, responses):\n    return [1e300] * len(responses)\n"),), early=False),
    # top-level typos and ranges; the wrong kind of model; weights that would be unpickled
    Case("sft +foo=bar", "foo is not a config key; `rlhf sft --cfg job` prints the keys"),
    Case("sft seed=99999999999999999999", "use a whole number in [0, 4294967295]"),
    Case("ppo ppo.policy_dir={rm_dir} ppo.reward=[rlhf_cli.demo:polite_reward] ppo.value_init=sft",
         "holds a sequence classifier (a reward or value model), not a causal language model", early=False),
    Case("eval ppo.policy_dir={tiny_base} eval.policies.sft={tiny_base} eval.policies.ppo={tiny_base} "
         "eval.reward_dir={tiny_base}", "holds a causal language model (a policy), not a sequence classifier",
         early=False),
    Case("chat chat.model_dir={rm_dir} prompt=hi", "holds a sequence classifier", early=False),
    Case("reward reward.init_from={pickled}", "holds pickle weights, which rlhf never loads", early=False),
]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """The embedded tiny base model, built once, for cases that get past validation (`{tiny_base}`)."""
    from rlhf_cli.tiny import build_tiny_base

    return build_tiny_base(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="module")
def rm_dir(tiny_base, tmp_path_factory):
    """A sequence classifier (a reward model's kind) made from the tiny base (`{rm_dir}`)."""
    import torch

    from rlhf_cli.models import load_seq_cls, load_tokenizer

    out = tmp_path_factory.mktemp("rm") / "rm"
    tok = load_tokenizer(tiny_base)
    load_seq_cls(tiny_base, tok, torch.float32).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def pickled(tiny_base, tmp_path_factory):
    """The tiny base with its weights in a pickle file instead of safetensors (`{pickled}`)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("pk") / "base"
    shutil.copytree(tiny_base, out)
    for w in out.glob("*.safetensors"):
        torch.save(load_file(str(w)), out / "pytorch_model.bin")
        w.unlink()
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.args for c in CASES])
def test_bad_input_fails_with_one_line_naming_it(case, run_cli, tmp_path, request):
    for name, contents in case.files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(contents, bytes):
            (tmp_path / name).write_bytes(contents)
        else:
            (tmp_path / name).write_text(contents, encoding="utf-8")
    args = case.args
    for name in ("tiny_base", "rm_dir", "pickled"):
        if "{" + name + "}" in args:
            args = args.replace("{" + name + "}", str(request.getfixturevalue(name)))
    argv = shlex.split(args)
    rc, out, err = run_cli(*argv)

    assert rc == case.rc, (rc, out, err)
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert errors[0].startswith(f"rlhf {argv[0]}: error: "), err
    assert case.needle in errors[0], (case.needle, errors[0])
    for name, contents in case.files:  # inputs and earlier outputs are left as they were
        data = contents if isinstance(contents, bytes) else contents.encode("utf-8")
        assert (tmp_path / name).read_bytes() == data, name
    if case.early:
        assert lines == errors, err  # nothing else was printed on the way
        made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("runs/**/*"))
        assert not (tmp_path / "runs").exists(), made  # not even Hydra's log directory (rlhf_cli.run_logs)


def test_cases_cover_every_command():
    from rlhf_cli.config import COMMANDS

    assert {c.args.split()[0] for c in CASES} == set(COMMANDS)
    assert len({c.args for c in CASES}) == len(CASES)
