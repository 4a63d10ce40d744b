"""Reading data in every accepted format, validation errors, tie dropping, prompt filtering, splitting."""

from __future__ import annotations

import json
import logging

import pytest
from omegaconf import OmegaConf

from rlhf_cli.data import (
    Example,
    detect_format,
    drop_ties,
    filter_long_prompts,
    load_examples,
    prompt_text,
    read_rows,
    to_examples,
)
from rlhf_cli.errors import RlhfError

USER = {"role": "user", "content": "How do I sleep better?"}
SYSTEM = {"role": "system", "content": "Be kind."}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def load(path, fmt="auto", system_prompt=None):
    return to_examples(read_rows(str(path)), fmt, str(path), system_prompt)


def data_cfg(train_path, **kw):
    base = dict(train_path=str(train_path), eval_path=None, split="train", format="auto", eval_ratio=0.25,
                split_seed=0, system_prompt=None, max_rows=None)
    return OmegaConf.create({**base, **kw})


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------------ formats
FORMAT_CASES = [
    ("seed",
     {"question": "How do I sleep better?", "chosen": "Gladly: a fixed bedtime.",
      "rejected": "Figure it out."},
     Example([USER], "Gladly: a fixed bedtime.", "Figure it out.")),
    ("prompt",
     {"prompt": "How do I sleep better?", "chosen": "A fixed bedtime.", "rejected": "Whatever."},
     Example([USER], "A fixed bedtime.", "Whatever.")),
    ("conversational explicit",
     {"prompt": [SYSTEM, USER],
      "chosen": [{"role": "assistant", "content": "A fixed bedtime."}],
      "rejected": [{"role": "assistant", "content": "Whatever."}]},
     Example([SYSTEM, USER], "A fixed bedtime.", "Whatever.")),
    ("conversational implicit",
     {"chosen": [USER, {"role": "assistant", "content": "A fixed bedtime."}],
      "rejected": [USER, {"role": "assistant", "content": "Whatever."}]},
     Example([USER], "A fixed bedtime.", "Whatever.")),
    ("messages",
     {"messages": [SYSTEM, USER, {"role": "assistant", "content": "A fixed bedtime."}]},
     Example([SYSTEM, USER], "A fixed bedtime.", None)),
    ("prompt/completion strings",
     {"prompt": "How do I sleep better?", "completion": "A fixed bedtime."},
     Example([USER], "A fixed bedtime.", None)),
    ("prompt/completion messages",
     {"prompt": [USER], "completion": [{"role": "assistant", "content": "A fixed bedtime."}]},
     Example([USER], "A fixed bedtime.", None)),
]


@pytest.mark.parametrize("name,row,expected", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_jsonl_formats(tmp_path, name, row, expected):
    path = write_jsonl(tmp_path / "d.jsonl", [row, row])
    assert load(path) == [expected, expected]


@pytest.mark.parametrize("name,row,expected", FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_json_list_and_data_key(tmp_path, name, row, expected):
    p1 = tmp_path / "list.json"
    p1.write_text(json.dumps([row]), encoding="utf-8")
    p2 = tmp_path / "wrapped.json"
    p2.write_text(json.dumps({"data": [row]}), encoding="utf-8")
    assert load(p1) == [expected]
    assert load(p2) == [expected]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"question": "q1", "chosen": "c1", "rejected": "r1"},
        {"question": "问题", "chosen": "好的", "rejected": "不"},
    ]), path)
    assert load(path) == [Example([{"role": "user", "content": "q1"}], "c1", "r1"),
                          Example([{"role": "user", "content": "问题"}], "好的", "不")]


def test_parquet_with_message_lists(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "m.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]), path)
    assert load(path) == [Example([{"role": "user", "content": "hi"}], "hello", None)]


@pytest.mark.parametrize("row,fmt", [
    ({"question": "q", "chosen": "a", "rejected": "b"}, "seed"),
    ({"prompt": "q", "chosen": "a", "rejected": "b"}, "prompt"),
    ({"chosen": [USER], "rejected": [USER]}, "conversational"),
    ({"messages": [USER]}, "messages"),
    ({"prompt": "q", "completion": "a"}, "messages"),
    ({"question": "q", "answer": "a"}, None),
])
def test_detect_format(row, fmt):
    assert detect_format(row) == fmt


def test_explicit_format_is_accepted(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    assert load(path, fmt="prompt") == [Example([{"role": "user", "content": "q"}], "a", "b")]


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"question": "q", "chosen": "a", "rejected": "b"}\n   \n', encoding="utf-8")
    assert len(load(path)) == 1


# ---------------------------------------------------------------------------------------------- system
def test_system_prompt_is_prepended(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "chosen": "a", "rejected": "b"}])
    [ex] = load(path, system_prompt="Be polite.")
    assert ex.prompt == [{"role": "system", "content": "Be polite."}, {"role": "user", "content": "q"}]


def test_system_prompt_does_not_replace_an_existing_one(tmp_path):
    row = {"messages": [SYSTEM, USER, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    [ex] = load(path, system_prompt="Other.")
    assert ex.prompt == [SYSTEM, USER]


def test_system_prompt_through_load_examples(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "chosen": "a", "rejected": "b"}
                                              for i in range(4)])
    train, evals = load_examples(data_cfg(path, system_prompt="Sys."))
    assert all(e.prompt[0] == {"role": "system", "content": "Sys."} for e in train + evals)


# ---------------------------------------------------------------------------------------------- errors
def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "chosen": "a", "rejected": "b"}\n\n{"question": "q2", "chosen": \n',
                    encoding="utf-8")
    with pytest.raises(RlhfError) as e:
        read_rows(str(path))
    assert one_line(e).startswith(f"{path}:3: malformed JSON")


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"question": "q", "chosen": "a", "rejected": "b"}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(RlhfError) as e:
        read_rows(str(path))
    assert one_line(e).startswith(f"{path}:2: expected a JSON object")


def test_malformed_json_file_names_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"question": "q",\n}\n]', encoding="utf-8")
    with pytest.raises(RlhfError) as e:
        read_rows(str(path))
    assert one_line(e).startswith(f"{path}:3: malformed JSON")


def test_json_file_that_is_not_a_list(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"question": "q"}', encoding="utf-8")
    with pytest.raises(RlhfError) as e:
        read_rows(str(path))
    assert str(path) in one_line(e)


def test_unreadable_parquet_names_file(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_text("not parquet")
    with pytest.raises(RlhfError) as e:
        read_rows(str(path))
    assert one_line(e).startswith(f"{path}: not a readable parquet file")


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n")
    with pytest.raises(RlhfError, match=r"unsupported file type '\.csv'"):
        read_rows(str(path))


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.json", "missing.parquet", "sub/dir/missing"])
def test_nonexistent_file_names_it(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(RlhfError) as e:
        read_rows(str(path))
    msg = one_line(e)
    assert str(path) in msg and "does not exist" in msg


def test_unset_train_path():
    with pytest.raises(RlhfError, match="data.train_path is not set"):
        read_rows(None)


def test_missing_key_names_row_and_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "chosen": "a", "rejected": "b"},
                                              {"question": "q2", "chosen": "a2"}])
    with pytest.raises(RlhfError) as e:
        load(path)
    msg = one_line(e)
    assert msg.startswith(f"{path}: line 2 is missing required key(s) rejected for the seed format")


def test_missing_keys_with_explicit_format(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"chosen": "a"}])
    with pytest.raises(RlhfError) as e:
        load(path, fmt="prompt")
    msg = one_line(e)
    assert str(path) in msg and "line 1" in msg and "prompt, rejected" in msg


def test_messages_format_missing_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [USER, {"role": "assistant", "content": "a"}]},
                                              {"text": "x"}])
    with pytest.raises(RlhfError) as e:
        load(path)
    assert "line 2 is missing required key(s) messages" in one_line(e)


def test_unknown_first_row_lists_expected_formats(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(RlhfError) as e:
        load(path)
    msg = one_line(e)
    assert msg.startswith(f"{path}: line 1 has keys ['answer', 'question']")
    assert "question/chosen/rejected" in msg


def test_unknown_format_name(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(RlhfError, match="data.format=csv is unknown"):
        load(path, fmt="csv")


def test_last_message_must_be_the_answer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [USER]}])
    with pytest.raises(RlhfError) as e:
        load(path)
    assert one_line(e) == f"{path}: line 1: the last message must be the assistant's answer (messages format)"


def test_non_string_answers_are_rejected(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "chosen": "a", "rejected": "b"},
                                              {"question": "q", "chosen": "a", "rejected": None}])
    with pytest.raises(RlhfError) as e:
        load(path)
    msg = one_line(e)
    assert msg == f"{path}: line 2: 'rejected' is null; give a string or a list of chat messages"
    path = write_jsonl(tmp_path / "n.jsonl", [{"question": 7, "chosen": "a", "rejected": "b"}])
    with pytest.raises(RlhfError, match=r"n.jsonl: line 1: 'question' is a int \(7\); give a string"):
        load(path)
    nested = write_jsonl(tmp_path / "m.jsonl", [{"question": "q", "chosen": ["a"], "rejected": "b"}])
    with pytest.raises(RlhfError, match="the answers must be strings"):  # a list where a string belongs
        load(nested)


def test_rows_with_empty_texts_are_counted_and_dropped(tmp_path, caplog):
    """An empty prompt is dropped everywhere; an empty answer where a stage trains on answers (sft, reward), not
    for PPO, whose prompt files may have no answers at all."""
    rows = [{"question": "q", "chosen": "a", "rejected": "b"}, {"question": " ", "chosen": "a", "rejected": "b"},
            {"question": "q3", "chosen": "", "rejected": "b"}, {"question": "q2", "chosen": "a", "rejected": "c"}]
    path = write_jsonl(tmp_path / "e.jsonl", rows)
    with caplog.at_level("WARNING", logger="rlhf"):
        exs = to_examples(read_rows(str(path)), "auto", str(path))
    assert [e.prompt[-1]["content"] for e in exs] == ["q", "q3", "q2"]
    assert f"{path}: dropped 1 of 4 rows with an empty prompt" in caplog.text
    cfg = OmegaConf.create({"train_path": str(path), "eval_path": str(path), "split": "train", "format": "auto",
                            "system_prompt": None, "max_rows": None, "eval_ratio": 0.0, "split_seed": 0})
    with caplog.at_level("WARNING", logger="rlhf"):
        train, _ = load_examples(cfg, need_rejected=True)
    assert [e.prompt[-1]["content"] for e in train] == ["q", "q2"]
    assert "dropped 1 of 3 rows with an empty answer" in caplog.text
    prompts, _ = load_examples(cfg, need_rejected=False, need_answers=False)
    assert len(prompts) == 3
    empty = write_jsonl(tmp_path / "all.jsonl", rows[1:2])
    with pytest.raises(RlhfError, match="every row has an empty prompt"):
        to_examples(read_rows(str(empty)), "auto", str(empty))


# ------------------------------------------------------------------------------ encodings and file lines
SEED_ROW = {"question": "你好吗?", "chosen": "很好,谢谢。", "rejected": "不知道。"}
SEED_EXAMPLE = Example([{"role": "user", "content": "你好吗?"}], "很好,谢谢。", "不知道。")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf8_bom_loads(tmp_path, suffix):
    path = tmp_path / f"bom{suffix}"
    body = json.dumps(SEED_ROW, ensure_ascii=False) + "\n" if suffix == ".jsonl" else json.dumps([SEED_ROW])
    path.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))
    assert load(path) == [SEED_EXAMPLE]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_gbk_file_names_file_line_and_iconv(tmp_path, suffix):
    path = tmp_path / f"gbk{suffix}"
    ascii_row = json.dumps({"question": "q", "chosen": "a", "rejected": "b"})
    path.write_bytes(f"{ascii_row}\n\n{ascii_row}\n".encode() + json.dumps(SEED_ROW, ensure_ascii=False)
                     .encode("gbk") + b"\n")
    with pytest.raises(RlhfError) as e:
        read_rows(str(path))
    assert one_line(e) == (f"{path}: not UTF-8 (line 4); convert it, e.g. "
                           f"`iconv -f GBK -t UTF-8 {path} > fixed{suffix}`")


def test_utf16_file_suggests_utf16(tmp_path):
    path = tmp_path / "notepad.jsonl"
    path.write_text(json.dumps(SEED_ROW, ensure_ascii=False) + "\n", encoding="utf-16")
    with pytest.raises(RlhfError) as e:
        read_rows(str(path))
    assert "not UTF-8 (line 1)" in one_line(e) and "iconv -f UTF-16 -t UTF-8" in one_line(e)


def test_missing_key_after_blank_lines_names_the_file_line(tmp_path):
    good = json.dumps({"question": "q", "chosen": "a", "rejected": "b"})
    bad = json.dumps({"question": "q", "chosen": "a"})
    path = tmp_path / "gaps.jsonl"
    # rows 1-4 on lines 1, 3, 4, 7; the fifth row, missing `rejected`, on line 9
    path.write_text(f"{good}\n\n{good}\n{good}\n  \n\n{good}\n\n{bad}\n", encoding="utf-8")
    with pytest.raises(RlhfError) as e:
        load(path)
    assert one_line(e).startswith(f"{path}: line 9 is missing required key(s) rejected for the seed format")


def test_row_errors_after_blank_lines_name_the_file_line(tmp_path):
    good = json.dumps({"question": "q", "chosen": "a", "rejected": "b"})
    path = tmp_path / "gaps.jsonl"
    path.write_text(f"\n\n{good}\n\n" + json.dumps({"question": "q", "chosen": "a", "rejected": None}) + "\n")
    with pytest.raises(RlhfError) as e:
        load(path)
    assert one_line(e).startswith(f"{path}: line 5: 'rejected' is null")
    path.write_text("\n\n" + json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(RlhfError) as e:
        load(path)
    assert one_line(e).startswith(f"{path}: line 3 has keys")


def test_json_list_errors_name_the_item(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([SEED_ROW, {"question": "q"}], indent=2), encoding="utf-8")
    with pytest.raises(RlhfError) as e:
        load(path)
    assert one_line(e).startswith(f"{path}: row 2 is missing required key(s) chosen, rejected")


def test_crlf_file_with_blank_lines_loads(tmp_path):
    path = tmp_path / "windows.jsonl"
    path.write_bytes(("\r\n".join(json.dumps(r, ensure_ascii=False) for r in [SEED_ROW] * 3) + "\r\n\r\n")
                     .encode("utf-8"))
    assert load(path) == [SEED_EXAMPLE] * 3
    rows = [SEED_ROW, SEED_ROW, {"question": "q"}]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows)
                     .encode("utf-8") + b"\r\n")
    with pytest.raises(RlhfError) as e:
        load(path)
    assert one_line(e).startswith(f"{path}: line 5 is missing required key(s) chosen, rejected")


def test_crlf_file_trains_through_load_examples(tmp_path):
    path = tmp_path / "windows.jsonl"
    rows = [{"question": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(4)]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(json.dumps(r) for r in rows).encode() + b"\r\n")
    train, evals = load_examples(data_cfg(path))
    assert sorted(e.prompt[0]["content"] for e in train + evals) == [f"q{i}" for i in range(4)]


def test_read_rows_is_still_a_list_of_dicts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [SEED_ROW])
    rows = read_rows(str(path))
    assert isinstance(rows, list) and rows == [SEED_ROW]
    assert load(path) == to_examples(list(rows), "auto", str(path))  # a plain list still works


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_dataset(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(RlhfError) as e:
        load(path)
    assert one_line(e) == f"{path}: the dataset is empty; give a file with at least one row"


def test_empty_json_list(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("[]")
    with pytest.raises(RlhfError, match="the dataset is empty"):
        load(path)


# ------------------------------------------------------------------------------------------------- ties
def test_drop_ties_counts(caplog):
    exs = [Example([USER], "a", "b"), Example([USER], "same", " same "), Example([USER], "c", "c")]
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        kept = drop_ties(exs, "src.jsonl")
    assert kept == [exs[0]]
    assert "src.jsonl: dropped 2 of 3 pairs" in caplog.text


def test_drop_ties_no_ties_keeps_all_quietly(caplog):
    exs = [Example([USER], "a", "b")]
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        assert drop_ties(exs, "src") == exs
    assert "dropped" not in caplog.text


def test_all_ties_raises():
    with pytest.raises(RlhfError, match="src.jsonl: every pair has chosen == rejected"):
        drop_ties([Example([USER], "a", "a"), Example([USER], "b", "b")], "src.jsonl")


def test_load_examples_drops_ties(tmp_path, caplog):
    rows = [{"question": f"q{i}", "chosen": "a", "rejected": "a" if i % 2 else "b"} for i in range(8)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    eval_path = write_jsonl(tmp_path / "e.jsonl", [{"question": "e", "chosen": "x", "rejected": "y"}])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        train, evals = load_examples(data_cfg(path, eval_path=str(eval_path)))
    assert sorted(e.prompt[0]["content"] for e in train) == ["q0", "q2", "q4", "q6"]
    assert f"{path}: dropped 4 of 8 pairs" in caplog.text
    assert len(evals) == 1


def test_load_examples_all_ties_raises(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "chosen": "a", "rejected": "a"}] * 3)
    with pytest.raises(RlhfError, match="every pair has chosen == rejected"):
        load_examples(data_cfg(path, eval_path=str(path)))


def test_ties_are_kept_when_rejected_is_not_needed(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "chosen": "a", "rejected": "a"}] * 2)
    train, evals = load_examples(data_cfg(path, eval_path=str(path)), need_rejected=False)
    assert len(train) == 2 and len(evals) == 2


def test_preference_stage_needs_rejected(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "completion": "a"}] * 3)
    with pytest.raises(RlhfError, match="data.train_path has no rejected answers"):
        load_examples(data_cfg(path))
    train, _ = load_examples(data_cfg(path), need_rejected=False)
    assert train[0].rejected is None


def test_single_row_without_eval_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "chosen": "a", "rejected": "b"}])
    train, evals = load_examples(data_cfg(path))
    assert len(train) == 1 and evals == []


# ---------------------------------------------------------------------------------------------- split
def split_names(path, seed, ratio=0.25):
    train, evals = load_examples(data_cfg(path, split_seed=seed, eval_ratio=ratio))
    return [e.prompt[0]["content"] for e in train], [e.prompt[0]["content"] for e in evals]


def test_eval_split_by_ratio_is_deterministic(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "chosen": "a", "rejected": "b"}
                                              for i in range(20)])
    train, evals = split_names(path, seed=0)
    assert len(evals) == 5 and len(train) == 15  # round(20 * 0.25)
    assert sorted(train + evals) == sorted(f"q{i}" for i in range(20))
    assert split_names(path, seed=0) == (train, evals)
    other = [split_names(path, seed=s)[1] for s in (1, 2, 3)]
    assert any(o != evals for o in other)


def test_eval_split_takes_at_least_one_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "chosen": "a", "rejected": "b"}
                                              for i in range(5)])
    train, evals = split_names(path, seed=0, ratio=0.01)
    assert len(evals) == 1 and len(train) == 4


def test_eval_file_is_used_instead_of_a_split(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "chosen": "a", "rejected": "b"}
                                              for i in range(6)])
    eval_path = write_jsonl(tmp_path / "e.jsonl", [{"question": "held", "chosen": "a", "rejected": "b"}])
    train, evals = load_examples(data_cfg(path, eval_path=str(eval_path)))
    assert [e.prompt[0]["content"] for e in train] == [f"q{i}" for i in range(6)]
    assert [e.prompt[0]["content"] for e in evals] == ["held"]


def test_max_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "chosen": "a", "rejected": "b"}
                                              for i in range(10)])
    train, _ = load_examples(data_cfg(path, eval_path=str(path), max_rows=3))
    assert [e.prompt[0]["content"] for e in train] == ["q0", "q1", "q2"]


def test_max_eval_rows_caps_the_held_out_rows_only(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "chosen": "a", "rejected": "b"}
                                              for i in range(10)])
    held = write_jsonl(tmp_path / "e.jsonl", [{"question": f"e{i}", "chosen": "a", "rejected": "b"}
                                              for i in range(5)])
    train, evals = load_examples(data_cfg(path, eval_path=str(held), max_eval_rows=2))
    assert len(train) == 10 and [e.prompt[0]["content"] for e in evals] == ["e0", "e1"]
    whole, split = load_examples(data_cfg(path)), load_examples(data_cfg(path, max_eval_rows=1))
    assert split[0] == whole[0] and split[1] == whole[1][:1]  # the same split, its first held-out row


def test_bad_eval_file_is_named(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(RlhfError) as e:
        load_examples(data_cfg(path, eval_path=str(tmp_path / "nope.jsonl")))
    assert str(tmp_path / "nope.jsonl") in one_line(e)


# -------------------------------------------------------------------------------------------- filtering
@pytest.fixture(scope="module")
def tok():
    from rlhf_cli.tiny import train_tokenizer

    return train_tokenizer(["How do I sleep better at night?", "Keep a fixed bedtime, please.",
                            "Thank you for asking!"] * 3, vocab_size=300)


def test_prompt_text_renders_the_chat_template(tok):
    assert prompt_text(tok, [SYSTEM, USER]) == ("<|im_start|>system\nBe kind.<|im_end|>\n"
                                                "<|im_start|>user\nHow do I sleep better?<|im_end|>\n"
                                                "<|im_start|>assistant\n")


def test_filter_long_prompts_drops_and_counts(tok, caplog):
    short = Example([{"role": "user", "content": "hi"}], "a", "b")
    long = Example([{"role": "user", "content": "word " * 200}], "a", "b")
    limit = len(tok(prompt_text(tok, short.prompt), add_special_tokens=False)["input_ids"])
    with caplog.at_level(logging.WARNING, logger="rlhf"):
        kept = filter_long_prompts([short, long, short], tok, limit, "train.jsonl")
    assert kept == [short, short]
    assert "train.jsonl: dropped 1 of 3 examples" in caplog.text
    too_long = rf"train\.jsonl: every prompt is longer than data\.max_prompt_length={limit - 1}"
    with pytest.raises(RlhfError, match=too_long):
        filter_long_prompts([short, long], tok, limit - 1, "train.jsonl")


def test_filter_long_prompts_empty_input(tok):
    assert filter_long_prompts([], tok, 10, "eval split") == []
