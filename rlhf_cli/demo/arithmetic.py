"""The shipped verifiable task of recipe `tiny-math`: two-number additions with one exact answer.

Each row, in the seed format plus the reference answer::

    {"question": "37+45=", "chosen": "82", "rejected": "72", "answer": "82"}

`chosen` is the sum (what SFT learns), `rejected` a near miss (a reward model can be trained on the pairs, so
`make chain` runs every stage), and `answer` is what the checker reads: :func:`is_correct` is the ground truth
(`data.ground_truth`) and :func:`exact_match_reward` the rule reward (`ppo.reward`), both an exact match of the
stripped response. The held-out split holds number pairs that never appear in the training split (in either
order). Regenerate the files with ``python -m rlhf_cli.demo.arithmetic``: the same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
TRAIN_FILE = DATA_DIR / "math_train.jsonl"
TEST_FILE = DATA_DIR / "math_test.jsonl"
MAX_OPERAND = 49     # operands 0..MAX_OPERAND: sums of at most two digits, one token per digit in the tiny tokenizer
TEST_PAIRS = 200     # held-out unordered number pairs
SEED = 0


def is_correct(response: str, answer: str) -> bool:
    """Ground truth: the response is exactly the answer (surrounding whitespace ignored)."""
    return response.strip() == str(answer).strip()


def exact_match_reward(prompts: list[str], responses: list[str], answer: list[str]) -> list[float]:
    """1.0 for a response that is exactly the row's `answer`, else 0.0 (`ppo.reward` entry)."""
    return [1.0 if is_correct(r, a) else 0.0 for r, a in zip(responses, answer)]


def near_miss(a: int, b: int, rng: random.Random) -> str:
    """A wrong sum a careless adder writes: off by one or by ten, or the carry dropped."""
    right = a + b
    carry_dropped = (a // 10 + b // 10) * 10 + (a % 10 + b % 10) % 10
    options = {right + 1, right - 1, right + 10, right - 10, carry_dropped} - {right}
    return str(rng.choice(sorted(x for x in options if x >= 0)))


def row(a: int, b: int, rng: random.Random) -> dict:
    answer = str(a + b)
    return {"question": f"{a}+{b}=", "chosen": answer, "rejected": near_miss(a, b, rng), "answer": answer}


def generate(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): every ordered pair of operands once, the held-out unordered pairs apart."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(a, MAX_OPERAND + 1)]
    held = set(rng.sample(pairs, TEST_PAIRS))
    ordered = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    train = [(a, b) for a, b in ordered if (min(a, b), max(a, b)) not in held]
    test = [p if rng.random() < 0.5 else p[::-1] for p in sorted(held)]
    rng.shuffle(train)
    rng.shuffle(test)
    return [row(a, b, rng) for a, b in train], [row(a, b, rng) for a, b in test]


def write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="write the tiny-math data files")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", type=Path, default=DATA_DIR)
    args = ap.parse_args(argv)
    train, test = generate(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, args.out / TRAIN_FILE.name)
    write_jsonl(test, args.out / TEST_FILE.name)
    print(f"{len(train)} train rows -> {args.out / TRAIN_FILE.name}, "
          f"{len(test)} held-out -> {args.out / TEST_FILE.name}")


if __name__ == "__main__":
    main()
