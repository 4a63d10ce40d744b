"""Atomic stage directories, the ownership marker, leftovers of killed runs, and JSON files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from rlhf_cli.errors import RlhfError
from rlhf_cli.io import OUTPUT_MARKER, atomic_dir, check_output_dir, publish, read_json, write_json


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def earlier_output(final, text="old"):
    """A directory as an earlier rlhf run leaves it: marked, with one file."""
    with atomic_dir(final) as out:
        (out / "weights").write_text(text)
    return final


def snapshot(root):
    """Every path under `root` with its bytes (None for directories) and modification time."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def dead_pid():
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_success_creates_final_dir(tmp_path):
    final = tmp_path / "runs" / "sft"
    with atomic_dir(final) as out:
        assert out != final and out.parent == final.parent and out.is_dir()
        assert not final.exists()  # nothing visible until the block succeeds
        (out / "model.bin").write_text("new")
    assert (final / "model.bin").read_text() == "new"
    assert leftovers(final.parent) == []
    marker = read_json(final / OUTPUT_MARKER)
    assert marker["written_by"] == "rlhf" and marker["time"]


def test_success_replaces_old_output(tmp_path):
    final = earlier_output(tmp_path / "reward")
    (final / "only_in_old").write_text("x")
    with atomic_dir(final) as out:
        (out / "weights").write_text("new")
        assert (final / "weights").read_text() == "old"
    assert (final / "weights").read_text() == "new"
    assert not (final / "only_in_old").exists()
    assert leftovers(tmp_path) == []


def test_exception_keeps_old_output_and_removes_tmp(tmp_path):
    final = earlier_output(tmp_path / "reward")
    before = snapshot(final)
    with pytest.raises(ValueError, match="boom"):
        with atomic_dir(final) as out:
            (out / "weights").write_text("half-written")
            (out / "sub").mkdir()
            raise ValueError("boom")
    assert snapshot(final) == before
    assert sorted(p.name for p in final.iterdir()) == [OUTPUT_MARKER, "weights"]
    assert leftovers(tmp_path) == []


def test_keyboard_interrupt_keeps_old_output(tmp_path):
    final = earlier_output(tmp_path / "ppo")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(final):
            raise KeyboardInterrupt
    assert (final / "weights").read_text() == "old"
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
        assert out == stale and [p.name for p in out.iterdir()] == [OUTPUT_MARKER]
        (out / "ok").write_text("y")
    assert sorted(p.name for p in final.iterdir()) == [OUTPUT_MARKER, "ok"]


# ----------------------------------------------------------------------- never delete what rlhf did not write
def test_foreign_directory_is_refused_and_left_byte_identical(tmp_path):
    final = tmp_path / "my_thesis"
    (final / "chapters").mkdir(parents=True)
    (final / "chapters" / "one.tex").write_text("\\section{Intro}")
    (final / "notes.txt").write_bytes(b"\xff\x00 irreplaceable")
    before, siblings = snapshot(final), sorted(tmp_path.iterdir())
    entered = False
    with pytest.raises(RlhfError) as e:
        with atomic_dir(final):
            entered = True
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{final} exists and was not written by rlhf")
    assert OUTPUT_MARKER in msg and "delete it yourself" in msg
    assert not entered
    assert snapshot(final) == before and sorted(tmp_path.iterdir()) == siblings


def test_a_file_in_the_way_is_refused(tmp_path):
    final = tmp_path / "sft"
    final.write_text("keep me")
    with pytest.raises(RlhfError, match="exists and is a file"):
        with atomic_dir(final):
            pass
    assert final.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["sft"]


def test_symlink_output_is_refused(tmp_path):
    target = earlier_output(tmp_path / "real")
    (tmp_path / "sft").symlink_to(target)
    with pytest.raises(RlhfError, match="symbolic link"):
        check_output_dir(tmp_path / "sft")


def test_empty_directory_is_accepted(tmp_path):
    final = tmp_path / "sft"
    final.mkdir()
    check_output_dir(final)
    with atomic_dir(final) as out:
        (out / "weights").write_text("new")
    assert (final / "weights").read_text() == "new"


def test_missing_and_marked_directories_are_accepted(tmp_path):
    check_output_dir(tmp_path / "new" / "sft")
    final = earlier_output(tmp_path / "sft")
    check_output_dir(final)
    (final / OUTPUT_MARKER).unlink()
    with pytest.raises(RlhfError):
        check_output_dir(final)


def test_directory_inside_an_output_is_accepted(tmp_path):
    """e.g. `ppo/merged`, written by the PPO stage inside its own marked output."""
    ppo = earlier_output(tmp_path / "ppo")
    (ppo / "merged").mkdir()
    (ppo / "merged" / "model.safetensors").write_text("w")
    with atomic_dir(ppo / "merged") as out:
        (out / "model.safetensors").write_text("merged again")
    assert (ppo / "merged" / "model.safetensors").read_text() == "merged again"


def test_refused_directory_keeps_leftovers_untouched(tmp_path):
    """A refused run changes nothing at all, not even the cleanup of siblings."""
    final = tmp_path / "sft"
    final.mkdir()
    (final / "data.csv").write_text("a,b")
    stale = tmp_path / f".sft.tmp-{dead_pid()}"
    stale.mkdir()
    with pytest.raises(RlhfError):
        with atomic_dir(final):
            pass
    assert stale.exists()


# ------------------------------------------------------------------------------- leftovers of killed runs
def test_leftovers_of_dead_processes_are_cleaned_and_live_ones_kept(tmp_path):
    gone, alive = dead_pid(), os.getppid()
    names = [f".sft.tmp-{gone}", f".sft.old-{gone}",           # a killed run: removed
             f".sft.tmp-{alive}", f".sft.old-{alive}",         # a run still going: kept
             ".sft.tmp-abc123", ".sft.old-abc123",             # a launcher's run id: not a pid, kept
             ".sft.partial", f".sft.partialx-{gone}",          # PPO's resumable run: never touched
             f".sft.tmp-{gone}0000000000",                     # longer than any pid: a run id, kept
             f".other.tmp-{gone}"]                             # another output's leftover
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    with atomic_dir(tmp_path / "sft") as out:
        (out / "weights").write_text("new")
    kept = set(names) - {f".sft.tmp-{gone}", f".sft.old-{gone}"}
    assert set(leftovers(tmp_path)) == kept
    assert (tmp_path / "sft" / "weights").read_text() == "new"


def test_leftover_tmp_is_judged_by_the_pid_in_its_marker(tmp_path):
    """Under a launcher the tag is a port; the marker written at creation names the real process."""
    port_dead_writer, port_live_writer = tmp_path / ".sft.tmp-29500", tmp_path / ".sft.tmp-29501"
    port_dead_writer.mkdir()
    port_live_writer.mkdir()
    host = socket.gethostname()
    (port_dead_writer / OUTPUT_MARKER).write_text(json.dumps({"pid": dead_pid(), "host": host}))
    (port_live_writer / OUTPUT_MARKER).write_text(json.dumps({"pid": os.getppid(), "host": host}))
    with atomic_dir(tmp_path / "sft"):
        pass
    assert leftovers(tmp_path) == [".sft.tmp-29501"]


def test_tmp_of_a_killed_run_names_its_process(tmp_path):
    with atomic_dir(tmp_path / "sft") as out:
        assert read_json(out / OUTPUT_MARKER)["pid"] == os.getpid()


# ------------------------------------------------------------------------------------------------- publish
def test_publish_an_arbitrary_directory(tmp_path):
    final = earlier_output(tmp_path / "ppo")
    work = tmp_path / ".ppo.partial"
    (work / "checkpoints").mkdir(parents=True)
    (work / "adapter.safetensors").write_text("trained")
    publish(work, final)
    assert not work.exists()
    assert sorted(p.name for p in final.iterdir()) == [OUTPUT_MARKER, "adapter.safetensors", "checkpoints"]
    assert read_json(final / OUTPUT_MARKER)["written_by"] == "rlhf"
    assert leftovers(tmp_path) == []


def test_publish_into_a_new_place(tmp_path):
    work = tmp_path / "build"
    work.mkdir()
    (work / "f").write_text("x")
    publish(work, tmp_path / "out")
    assert (tmp_path / "out" / "f").read_text() == "x" and not work.exists()


def test_publish_refuses_a_foreign_directory_and_changes_nothing(tmp_path):
    final = tmp_path / "ppo"
    final.mkdir()
    (final / "mine.txt").write_text("mine")
    work = tmp_path / ".ppo.partial"
    work.mkdir()
    (work / "adapter.safetensors").write_text("trained")
    before_final, before_work = snapshot(final), snapshot(work)
    with pytest.raises(RlhfError, match="was not written by rlhf"):
        publish(work, final)
    assert snapshot(final) == before_final and snapshot(work) == before_work


def test_publish_cleans_leftovers_but_not_its_source(tmp_path):
    gone = dead_pid()
    src = tmp_path / f".ppo.tmp-{gone}"  # a source named like a leftover is still the source
    src.mkdir()
    (src / "f").write_text("x")
    (tmp_path / f".ppo.old-{gone}").mkdir()
    publish(src, tmp_path / "ppo")
    assert (tmp_path / "ppo" / "f").exists() and leftovers(tmp_path) == []


def test_failed_rename_puts_the_earlier_output_back(tmp_path, monkeypatch):
    final = earlier_output(tmp_path / "sft")
    work = tmp_path / "build"
    work.mkdir()
    real_rename = type(work).rename

    def rename(self, target):
        if self == work:
            raise OSError("disk gone")
        return real_rename(self, target)

    monkeypatch.setattr(type(work), "rename", rename)
    with pytest.raises(OSError, match="disk gone"):
        publish(work, final)
    assert (final / "weights").read_text() == "old" and leftovers(tmp_path) == []


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
