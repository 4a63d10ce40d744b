"""The shipped demo preference data and its rule-based politeness checker."""

from __future__ import annotations

import json

import pytest

from rlhf_cli import demo
from rlhf_cli.demo import (
    DATA_DIR,
    EN_POLITE_MARKERS,
    EN_RUDE_MARKERS,
    SYSTEM_PROMPT,
    TEST_FILE,
    TRAIN_FILE,
    ZH_POLITE_MARKERS,
    ZH_RUDE_MARKERS,
    has_polite_marker,
    has_rude_marker,
    is_polite,
)
from rlhf_cli.demo import make_data as md

KEYS = ("question", "chosen", "rejected")
POLITE_PHRASES = md.EN_POLITE_OPENERS + md.EN_POLITE_CLOSERS + md.ZH_POLITE_OPENERS + md.ZH_POLITE_CLOSERS
RUDE_PHRASES = md.EN_RUDE_OPENERS + md.EN_RUDE_CLOSERS + md.ZH_RUDE_OPENERS + md.ZH_RUDE_CLOSERS
POLITE_CLOSERS = md.EN_POLITE_CLOSERS + md.ZH_POLITE_CLOSERS


def _load(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def splits():
    return _load(TRAIN_FILE), _load(TEST_FILE)


def _is_zh(text: str) -> bool:
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


def test_paths_and_constants():
    assert TRAIN_FILE.parent == DATA_DIR and TEST_FILE.parent == DATA_DIR
    assert TRAIN_FILE.is_file() and TEST_FILE.is_file()
    assert SYSTEM_PROMPT is None
    # small enough to commit
    assert TRAIN_FILE.stat().st_size < 3_000_000 and TEST_FILE.stat().st_size < 500_000


def test_sizes_keys_and_languages(splits):
    train, test = splits
    assert len(train) == 3000 and len(test) == 300
    for rows in (train, test):
        for row in rows:
            assert tuple(row) == KEYS
            assert all(isinstance(row[k], str) and row[k] for k in KEYS)
            assert row["chosen"] != row["rejected"]
        n_zh = sum(_is_zh(r["question"]) for r in rows)
        assert n_zh == len(rows) // 2


def test_test_questions_held_out(splits):
    train, test = splits
    train_q = {r["question"] for r in train}
    assert not train_q & {r["question"] for r in test}
    # held out by topic, so test answers are not seen in training either
    train_answers = {r["chosen"] for r in train}
    assert not train_answers & {r["chosen"] for r in test}


def test_topic_and_phrase_variety():
    assert len(md.EN_TOPICS) >= 60 and len(md.ZH_TOPICS) >= 60
    assert len({t for t, _ in md.EN_TOPICS}) == len(md.EN_TOPICS)
    assert len({t for t, _ in md.ZH_TOPICS}) == len(md.ZH_TOPICS)
    for group in (md.EN_QUESTION_TEMPLATES, md.ZH_QUESTION_TEMPLATES, md.EN_POLITE_OPENERS,
                  md.EN_RUDE_OPENERS, md.ZH_POLITE_OPENERS, md.ZH_RUDE_OPENERS, md.EN_POLITE_CLOSERS,
                  md.EN_RUDE_CLOSERS, md.ZH_POLITE_CLOSERS, md.ZH_RUDE_CLOSERS):
        assert len(group) >= 4


def _unhelpful(row) -> bool:
    """Rejected for lack of content, not tone: the polite answer's opener + closing without its body."""
    return row["rejected"] not in row["chosen"] and not has_rude_marker(row["rejected"]) \
        and len(row["rejected"]) < len(row["chosen"])


def test_is_polite_on_all_data(splits):
    for rows in splits:
        bad_chosen = [r["chosen"] for r in rows if not is_polite(r["chosen"])]
        bad_rejected = [r["rejected"] for r in rows if is_polite(r["rejected"]) and not _unhelpful(r)]
        assert not bad_chosen, bad_chosen[:3]
        assert not bad_rejected, bad_rejected[:3]


def test_unhelpful_negatives_are_polite_but_empty(splits):
    for rows in splits:
        unhelpful = [r for r in rows if is_polite(r["rejected"])]
        assert 0.02 <= len(unhelpful) / len(rows) <= 0.1
        assert all(_unhelpful(r) for r in unhelpful)


def test_hard_negatives_present(splits):
    for rows in splits:
        hard = [r for r in rows if r["rejected"].endswith(POLITE_CLOSERS) and not is_polite(r["rejected"])]
        share = len(hard) / len(rows)
        assert 0.3 <= share <= 0.6, share
        # a hard negative is rude (rude opener) although its ending is polite
        assert all(has_rude_marker(r["rejected"]) and has_polite_marker(r["rejected"]) for r in hard)
        # both languages have hard negatives
        assert any(_is_zh(r["rejected"]) for r in hard) and any(not _is_zh(r["rejected"]) for r in hard)


def test_markers_are_disjoint():
    for polite in EN_POLITE_MARKERS + ZH_POLITE_MARKERS:
        for rude in EN_RUDE_MARKERS + ZH_RUDE_MARKERS:
            assert polite.lower() not in rude.lower() and rude.lower() not in polite.lower()
    for phrase in POLITE_PHRASES:
        assert has_polite_marker(phrase) and not has_rude_marker(phrase), phrase
        assert is_polite(phrase)
    for phrase in RUDE_PHRASES:
        assert has_rude_marker(phrase) and not has_polite_marker(phrase), phrase
        assert not is_polite(phrase)


def test_bodies_and_questions_are_neutral():
    for task, body in md.EN_TOPICS + md.ZH_TOPICS:
        for text in (task, body):
            assert not has_polite_marker(text) and not has_rude_marker(text), text
    for template in md.EN_QUESTION_TEMPLATES + md.ZH_QUESTION_TEMPLATES:
        assert not has_polite_marker(template) and not has_rude_marker(template), template


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", False),
        ("Dress in layers.", False),
        ("Thank you for asking! Dress in layers. Hope this helps.", True),
        ("THANK YOU! dress in layers.", True),
        ("Ugh. Dress in layers. Hope this helps.", False),
        ("Happy to help! Dress in layers. Go away.", False),
        ("Thanksgiving is in November.", False),
        ("Pull it through, that is enough.", False),  # "ugh" inside words is not rude
        ("That is tough, but good luck!", True),
        ("感谢你的提问！多喝水。希望对你有帮助。", True),
        ("这都不会？多喝水。希望对你有帮助。", False),
        ("很高兴为你解答！多喝水。别再烦我了。", False),
        ("多喝水。", False),
        ("Good luck! 别问了。", False),
    ],
)
def test_is_polite_examples(text, expected):
    assert is_polite(text) is expected


def test_generator_deterministic(splits):
    a = md.generate(n_train=200, n_test=40, seed=3)
    b = md.generate(n_train=200, n_test=40, seed=3)
    c = md.generate(n_train=200, n_test=40, seed=4)
    assert a == b
    assert a != c
    assert len(a[0]) == 200 and len(a[1]) == 40
    train, test = md.generate()
    assert (train, test) == splits


def test_write_jsonl_roundtrip(tmp_path):
    train, test = md.generate(n_train=10, n_test=4, seed=1)
    md.main(["--n-train", "10", "--n-test", "4", "--seed", "1",
             "--train-file", str(tmp_path / "tr.jsonl"), "--test-file", str(tmp_path / "te.jsonl")])
    assert _load(tmp_path / "tr.jsonl") == train
    assert _load(tmp_path / "te.jsonl") == test
    assert "\\u" not in (tmp_path / "tr.jsonl").read_text(encoding="utf-8")  # Chinese stays readable


def test_package_exports():
    for name in ("DATA_DIR", "TRAIN_FILE", "TEST_FILE", "SYSTEM_PROMPT", "is_polite"):
        assert hasattr(demo, name)
