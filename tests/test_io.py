"""Atomic stage directories and JSON files."""

from __future__ import annotations

import json

import pytest

from rlhf_cli.io import atomic_dir, read_json, write_json


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_success_creates_final_dir(tmp_path):
    final = tmp_path / "runs" / "sft"
    with atomic_dir(final) as out:
        assert out != final and out.parent == final.parent and out.is_dir()
        assert not final.exists()  # nothing visible until the block succeeds
        (out / "model.bin").write_text("new")
    assert (final / "model.bin").read_text() == "new"
    assert leftovers(final.parent) == []


def test_success_replaces_old_output(tmp_path):
    final = tmp_path / "reward"
    final.mkdir()
    (final / "marker").write_text("old")
    (final / "only_in_old").write_text("x")
    with atomic_dir(final) as out:
        (out / "marker").write_text("new")
        assert (final / "marker").read_text() == "old"
    assert (final / "marker").read_text() == "new"
    assert not (final / "only_in_old").exists()
    assert leftovers(tmp_path) == []


def test_exception_keeps_old_output_and_removes_tmp(tmp_path):
    final = tmp_path / "reward"
    final.mkdir()
    (final / "marker").write_text("old")
    with pytest.raises(ValueError, match="boom"):
        with atomic_dir(final) as out:
            (out / "marker").write_text("half-written")
            (out / "sub").mkdir()
            raise ValueError("boom")
    assert (final / "marker").read_text() == "old"
    assert sorted(p.name for p in final.iterdir()) == ["marker"]
    assert leftovers(tmp_path) == []


def test_keyboard_interrupt_keeps_old_output(tmp_path):
    final = tmp_path / "ppo"
    final.mkdir()
    (final / "marker").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(final):
            raise KeyboardInterrupt
    assert (final / "marker").read_text() == "old"
    assert leftovers(tmp_path) == []


def test_exception_without_old_output_leaves_nothing(tmp_path):
    final = tmp_path / "sft"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as out:
            (out / "f").write_text("x")
            raise RuntimeError
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_stale_tmp_dir_is_cleared(tmp_path):
    final = tmp_path / "sft"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as out:
            stale = out
            raise RuntimeError
    stale.mkdir()
    (stale / "junk").write_text("x")
    with atomic_dir(final) as out:
        assert out == stale and list(out.iterdir()) == []
        (out / "ok").write_text("y")
    assert sorted(p.name for p in final.iterdir()) == ["ok"]


def test_write_json_is_readable_and_leaves_no_tmp(tmp_path):
    obj = {"eval_loss": 1.25, "text": "你好", "n": [1, 2]}
    path = tmp_path / "metrics.json"
    write_json(path, obj)
    assert read_json(path) == obj
    assert "你好" in path.read_text(encoding="utf-8")  # not \u-escaped
    assert json.loads(path.read_text(encoding="utf-8")) == obj
    write_json(path, {"n": 2})
    assert read_json(path) == {"n": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
