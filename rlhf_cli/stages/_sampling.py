"""What `rlhf ppo` and `rlhf eval` share: the prompts they render from the data, and how responses are sampled
(stop tokens, temperature, vocabulary limit) — so eval measures the policy as PPO trained it."""

from __future__ import annotations

from rlhf_cli import data as D
from rlhf_cli.errors import RlhfError
from rlhf_cli.ppo.evaluation import Evaluator, mean
from rlhf_cli.ppo.experience import Sampling


def prompts(run, tok, split: str, limit: int | None = None) -> tuple[list[str], list]:
    """(rendered prompts, examples) of the train or eval split, over-long prompts dropped; `run`: the run's
    settings (rlhf_cli.settings.of, or the composed config)."""
    d = run.data
    train, evals = D.load_examples(d, need_rejected=False, need_answers=False)
    examples = train if split == "train" else evals
    if split == "eval" and not examples:
        why = "data.eval_ratio=0 holds no rows out" if not d.eval_path and not float(d.eval_ratio) else \
            "the eval split is empty"
        need = ("ppo.eval_every evaluates on them (ppo.eval_every=0 turns that off)" if run.command == "ppo"
                else f"rlhf {run.command} measures on them")
        raise RlhfError(f"no held-out prompts ({why}), and {need}: give data.eval_path, or data.eval_ratio above 0")
    source = str(d.train_path) if split == "train" else "eval split"
    thinking, templ = bool(run.model.enable_thinking), bool(d.chat_template)
    examples = D.filter_long_prompts(examples, tok, int(d.max_prompt_length), source, thinking, templ)
    examples = examples[:limit] if limit is not None else examples
    return [D.prompt_text(tok, ex.prompt, thinking, templ) for ex in examples], examples


def rows(examples) -> list[dict]:
    """The extra fields of each example's data row (what a reward function or ground-truth checker may ask for
    by name, e.g. a reference answer); {} for data without any."""
    return [dict(getattr(ex, "extra", None) or {}) for ex in examples]


def ground_truth(data, examples=()):
    """`data.ground_truth` of `data` (the run's `data.*` settings) loaded (`rlhf_cli.ppo.rewards.GroundTruth`), or
    None when the data has none."""
    from rlhf_cli.ppo.rewards import GroundTruth

    return GroundTruth.load(data.get("ground_truth"), {k for r in rows(examples) for k in r})


def stop_ids(ppo, tok) -> tuple[int, ...]:
    """`ppo.stop_token` of `ppo` (the run's `ppo.*` settings): eos (plus `ppo.stop_token_ids`) ends a response;
    null: fixed-length responses."""
    if ppo.stop_token == "eos":  # the schema allows eos or null
        return (int(tok.eos_token_id), *(int(i) for i in ppo.stop_token_ids))
    return ()


def sampling(run, tok, vocab_size: int, recompute: bool, evaluation: bool = False,
             score_batch_size: int | None = None, engine: str = "generate") -> Sampling:
    """PPO's sampling settings (`ppo.*` of `run`, the run's settings); with evaluation=True the length,
    temperature, top-k/p, greedy flag and batch come from `eval.*` while the stop tokens stay PPO's.
    score_batch_size: rows per scoring forward (PPO: its micro-batch, what a forward of the update holds); engine:
    the sampling engine (`rlhf_cli.accel.FastPaths.sampler`)."""
    p = run.eval if evaluation else run.ppo
    return Sampling(max_new_tokens=int(p.response_length), temperature=float(p.temperature),
                    pad_id=int(tok.pad_token_id), eos_id=int(tok.eos_token_id), stop_ids=stop_ids(run.ppo, tok),
                    top_k=int(p.top_k), top_p=float(p.top_p), greedy=bool(p.get("greedy", False)),
                    forward_batch_size=int(p.batch_size if evaluation else p.rollout_forward_batch_size),
                    vocab_size=vocab_size, recompute_logprobs=recompute, score_batch_size=score_batch_size,
                    engine=engine)


def score_batch_size(run, micro_batch: int, vocab_size: int) -> int | None:
    """Rows per scoring forward in PPO: its micro-batch (rows grouped by prompt length, each group's shared padding
    skipped) where a forward over the whole rollout chunk would hold over SCORE_GROUPS_FROM_BYTES of fp32 logits;
    otherwise None, one forward per chunk (for small logits the extra forwards cost more than the padding saves).
    `run`: the run's settings (rlhf_cli.settings.of, or the composed config)."""
    from rlhf_cli.accel.limits import SCORE_GROUPS_FROM_BYTES

    p = run.ppo
    logits = int(p.rollout_forward_batch_size) * int(p.response_length) * int(vocab_size) * 4
    return int(micro_batch) if logits > SCORE_GROUPS_FROM_BYTES else None


def recompute_logprobs(setting: str, compute_dtype) -> bool:
    """`ppo.recompute_logprobs`: auto recomputes when compute is not fp32 (the incremental sampling forward and
    the full training forward disagree there); in fp32 they agree to ~1e-6 and the sampling pass is reused."""
    setting = str(setting).lower()
    if setting == "auto":
        return compute_dtype is not None
    return setting == "true"


ANSWER_PROMPTS = 32  # held-out prompts SFT answers for its check (rlhf_cli.learned.sft_warning)


def answer_check(model, tok, run, n: int = ANSWER_PROMPTS) -> dict:
    """Sample one answer to each of the first `n` held-out prompts (training prompts after them where there are
    fewer) with the eval settings (`eval.*`; seeded, the caller's random stream left as it was): the share that
    end with the stop token and, with a checker (`data.ground_truth`), the share that pass it and the share of
    the data's own answers to those prompts that do. `run`: the run's settings (rlhf_cli.settings.of, or the
    composed config)."""
    import torch

    try:
        asked, examples = prompts(run, tok, "eval", limit=n)
    except RlhfError:  # no held-out split
        asked, examples = [], []
    if len(asked) < n:  # a small eval split (5% of a few hundred rows): training prompts make up the number
        more = prompts(run, tok, "train", limit=n - len(asked))
        asked, examples = asked + more[0], examples + more[1]
    e, texts, ends, side = run.eval, [], [], tok.padding_side
    model.eval()
    tok.padding_side = "left"  # the answers start where every prompt ends
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(int(run.seed))
        for i in range(0, len(asked), int(e.batch_size)):
            enc = tok(asked[i:i + int(e.batch_size)], return_tensors="pt", padding=True,
                      add_special_tokens=False).to(model.device)
            out = model.generate(**enc, max_new_tokens=int(e.response_length), do_sample=not bool(e.greedy),
                                 temperature=float(e.temperature), top_k=int(e.top_k) or None, top_p=float(e.top_p),
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            for row in out[:, enc["input_ids"].shape[1]:].tolist():
                ends.append(tok.eos_token_id in row)
                texts.append(tok.decode(row[:row.index(tok.eos_token_id)] if ends[-1] else row,
                                        skip_special_tokens=True))
    tok.padding_side = side
    gt, fields = ground_truth(run.data, examples), rows(examples)
    if gt is None:
        return {"answers_eos_rate": sum(ends) / len(ends)}
    # what SFT imitated: the same prompts' data answers (both, where it also trains on the rejected ones)
    refs = [(ex.chosen, p, r) for ex, p, r in zip(examples, asked, fields)]
    if run.data.sft_on_rejected:
        refs += [(ex.rejected, p, r) for ex, p, r in zip(examples, asked, fields) if ex.rejected]
    return {"answers_eos_rate": sum(ends) / len(ends),
            "answers_ground_truth_rate": mean(gt(texts, asked, fields)),
            "data_ground_truth_rate": mean(gt(*(list(x) for x in zip(*refs))))}


def held_out(run, tok, eval_every: int):
    """(prompts, examples) for ppo.eval_every, the held-out prompts that also give ppo.keep_best its metric;
    None when it is 0. `run`: the run's settings (rlhf_cli.settings.of)."""
    if not eval_every:
        return None
    held_out = prompts(run, tok, "eval", limit=int(run.eval.num_prompts))
    if not held_out[0]:
        raise RlhfError(f"ppo.eval_every={eval_every}: every held-out prompt is longer than "
                        f"data.max_prompt_length={run.data.max_prompt_length}; raise it, give other held-out "
                        "data (data.eval_path), or set ppo.eval_every=0")
    return held_out


def evaluator(typed, tok, vocab: int, recompute: bool, engine, held_out) -> Evaluator | None:
    """The held-out evaluation of `ppo.eval_every` (None without held-out prompts): sampled with the eval
    settings."""
    if held_out is None:
        return None
    return Evaluator(
        held_out[0], sampling(typed, tok, vocab, recompute, evaluation=True, engine=engine),
        int(typed.seed), rows(held_out[1]), ground_truth(typed.data, held_out[1]),
        int(typed.eval.samples_per_prompt))
