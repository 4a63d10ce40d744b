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


def earlier_output(final, text="old", kind=None):
    """A directory as an earlier rlhf run leaves it: marked (as `kind`'s output), with one file."""
    with atomic_dir(final, kind) as out:
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
    with pytest.raises(ValueError, match="boom"), atomic_dir(final) as out:
        (out / "weights").write_text("half-written")
        (out / "sub").mkdir()
        raise ValueError("boom")
    assert snapshot(final) == before
    assert sorted(p.name for p in final.iterdir()) == [OUTPUT_MARKER, "weights"]
    assert leftovers(tmp_path) == []


def test_keyboard_interrupt_keeps_old_output(tmp_path):
    final = earlier_output(tmp_path / "ppo")
    with pytest.raises(KeyboardInterrupt), atomic_dir(final):
        raise KeyboardInterrupt
    assert (final / "weights").read_text() == "old"
    assert leftovers(tmp_path) == []


def test_exception_without_old_output_leaves_nothing(tmp_path):
    final = tmp_path / "sft"
    with pytest.raises(RuntimeError), atomic_dir(final) as out:
        (out / "f").write_text("x")
        raise RuntimeError
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_stale_tmp_dir_is_cleared(tmp_path):
    final = tmp_path / "sft"
    with pytest.raises(RuntimeError), atomic_dir(final) as out:
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
    with pytest.raises(RlhfError) as e, atomic_dir(final):
        entered = True
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{final} exists and was not written by rlhf")
    assert OUTPUT_MARKER in msg and "delete it yourself" in msg
    assert not entered
    assert snapshot(final) == before and sorted(tmp_path.iterdir()) == siblings


def test_a_file_in_the_way_is_refused(tmp_path):
    final = tmp_path / "sft"
    final.write_text("keep me")
    with pytest.raises(RlhfError, match="exists and is a file"), atomic_dir(final):
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


def test_export_replaces_the_merged_folder_of_a_ppo_output(tmp_path):
    """`<ppo>/merged`: export's default target, the one output inside another (ppo.merge=true writes it too)."""
    ppo = earlier_output(tmp_path / "ppo", kind="ppo")
    (ppo / "merged").mkdir()
    (ppo / "merged" / "model.safetensors").write_text("w")
    for _ in range(2):  # written by `rlhf ppo ppo.merge=true` (no marker of its own), then by export
        with atomic_dir(ppo / "merged", "export") as out:
            (out / "model.safetensors").write_text("merged again")
    assert (ppo / "merged" / "model.safetensors").read_text() == "merged again"
    assert read_json(ppo / "merged" / OUTPUT_MARKER)["kind"] == "export"


def test_refused_directory_keeps_leftovers_untouched(tmp_path):
    """A refused run changes nothing at all, not even the cleanup of siblings."""
    final = tmp_path / "sft"
    final.mkdir()
    (final / "data.csv").write_text("a,b")
    stale = tmp_path / f".sft.tmp-{dead_pid()}"
    stale.mkdir()
    with pytest.raises(RlhfError), atomic_dir(final):
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


# ------------------------------------------------------------------------------------ outputs owned by kind
def legacy_output(final):
    """An output as versions before kinds left it: a marker that names no stage."""
    final.mkdir(parents=True)
    (final / "weights").write_text("old")
    (final / OUTPUT_MARKER).write_text(json.dumps({"written_by": "rlhf", "time": "2024-05-01T12:00:00+00:00"}))
    return final


def refused(final, kind, inputs=(), *, needle):
    """`kind` may not replace `final`: a one-line error containing `needle`, and the parent's tree unchanged."""
    parent = final.parent if final.parent.exists() else final.parent.parent
    before = snapshot(parent)
    with pytest.raises(RlhfError) as e, atomic_dir(final, kind, inputs):
        pytest.fail("entered the block")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(final)) and needle in msg, msg
    assert snapshot(parent) == before
    return msg


def test_marker_names_the_stage_and_the_run(tmp_path):
    final = earlier_output(tmp_path / "reward", kind="reward")
    marker = read_json(final / OUTPUT_MARKER)
    assert marker["kind"] == "reward" and marker["pid"] == os.getpid() and marker["command"]
    assert marker["host"] == socket.gethostname() and marker["time"]


@pytest.mark.parametrize("writer, stage", [("ppo", "eval"), ("sft", "reward"), ("reward", "ppo"), ("eval", "sft"),
                                           ("export", "ppo"), ("ppo", None)])
def test_a_stage_replaces_only_its_own_kind(tmp_path, writer, stage):
    final = earlier_output(tmp_path / "out", kind=writer)
    msg = refused(final, stage, needle=f"holds the {writer} stage's output")
    assert "choose another" in msg and "delete it yourself" in msg
    with atomic_dir(final, writer) as out:  # its own stage replaces it
        (out / "weights").write_text("new")
    assert (final / "weights").read_text() == "new"


def test_a_marker_without_a_kind_is_replaced_only_in_the_stage_default_directory(tmp_path):
    """Outputs of earlier versions: `sft` by sft (as before), never by another stage or under another name."""
    refused(legacy_output(tmp_path / "mine"), "sft", needle="earlier version whose marker names no stage")
    refused(legacy_output(tmp_path / "sft"), "reward", needle="`rlhf reward` replaces only its own output")
    refused(legacy_output(tmp_path / "reward"), "checkpoint", needle="earlier version")
    for name, kind in (("sft", "sft"), ("ppo", "ppo"), ("eval", "eval"), ("merged", "export"),
                       ("checkpoint-3", "checkpoint")):
        final = legacy_output(tmp_path / "ok" / name) if name != "merged" else legacy_output(tmp_path / "merged")
        with atomic_dir(final, kind) as out:
            (out / "weights").write_text("new")
        assert read_json(final / OUTPUT_MARKER)["kind"] == kind


def test_checkpoints_are_never_replaced_by_a_stage(tmp_path):
    checkpoints = tmp_path / ".ppo.partial" / "checkpoints"
    with atomic_dir(checkpoints / "checkpoint-2", "checkpoint") as out:
        (out / "trainer_state.json").write_text("{}")
    refused(checkpoints / "checkpoint-2", "export", needle="holds a PPO checkpoint")
    refused(checkpoints, "sft", needle="holds PPO checkpoints (checkpoint-2), which rlhf never replaces")
    with atomic_dir(checkpoints / "checkpoint-2", "checkpoint") as out:  # PPO rewrites its own
        (out / "trainer_state.json").write_text('{"update": 2}')


def test_an_input_of_the_command_is_refused(tmp_path):
    sft = earlier_output(tmp_path / "runs" / "sft", kind="sft")
    msg = refused(sft, "reward", [sft, None, "", tmp_path / "absent"], needle="is an input of `rlhf reward`")
    assert "holds the sft stage's output" in msg and "reward.output_dir" in msg
    refused(sft, "sft", [sft], needle="is an input of `rlhf sft`")  # its own kind too: sft from sft
    # a folder that holds an input, given by another spelling of its path
    runs = tmp_path / "runs"
    msg = refused(runs, "eval", [runs / ".." / "runs" / "sft"], needle="an input of `rlhf eval`")
    assert "contains" in msg


def test_a_folder_inside_an_output_is_refused(tmp_path):
    """A user's folder inside an rlhf output was replaced because its parent carried the marker."""
    reward = earlier_output(tmp_path / "reward", kind="reward")
    (reward / "notes").mkdir()
    (reward / "notes" / "mine.txt").write_text("my notes")
    msg = refused(reward / "notes", "sft", needle=f"is inside {reward}, which holds the reward stage's output")
    assert "choose another sft.output_dir outside it" in msg
    refused(reward / "new" / "deeper", "eval", needle="is inside")          # new folders too, at any depth
    refused(reward / "notes", None, needle="is inside")
    ppo = earlier_output(tmp_path / "ppo", kind="ppo")
    (ppo / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    refused(ppo / "checkpoints", "export", [ppo], needle="which holds the ppo stage's output")
    refused(ppo / "merged", "eval", needle="is inside")                    # merged is export's, nobody else's
    legacy = legacy_output(tmp_path / "old" / "sft")
    refused(legacy / "merged", "export", needle="is inside")               # merged of a ppo output only


def test_the_check_reads_only(tmp_path):
    final = earlier_output(tmp_path / "ppo", kind="ppo")
    before = snapshot(tmp_path)
    with pytest.raises(RlhfError):
        check_output_dir(final, "eval", [final])
    check_output_dir(final, "ppo", [tmp_path / "sft"])
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------- one run per output
HOLD = """
import signal, sys, time
# Ctrl-C as at a terminal: the test process may pass SIGINT on ignored (a background job's is), and a child keeps
# an ignored signal; the holder would then sleep out its 120 s and leave by a normal exit, not by Ctrl-C
signal.signal(signal.SIGINT, signal.default_int_handler)
from rlhf_cli.run_lock import claim_output
claim_output(sys.argv[1], sys.argv[2])
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder():
    """`holder(final, kind)`: another process that holds the run lock of `final` until it is stopped."""
    procs = []

    def start(final, kind="sft"):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(final), kind], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def lock_of(final):
    return final.parent / f".{final.name}.lock"


def test_the_lock_is_held_for_the_block_and_removed_after(tmp_path):
    final = tmp_path / "sft"
    with atomic_dir(final, "sft"):
        body = read_json(lock_of(final))
        assert body["pid"] == os.getpid() and body["host"] == socket.gethostname() and body["since"]
        assert body["command"] and body["output"] == str(final)
    assert not lock_of(final).exists()
    with pytest.raises(KeyboardInterrupt), atomic_dir(final, "sft"):
        raise KeyboardInterrupt
    assert leftovers(tmp_path) == []


def test_a_second_run_is_refused_at_once_naming_the_first(tmp_path, holder):
    final = earlier_output(tmp_path / "sft", kind="sft")
    first = holder(final, "sft")
    before = snapshot(tmp_path)
    with pytest.raises(RlhfError) as e, atomic_dir(final, "sft"):
        pytest.fail("entered the block")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{final} is in use by another run: pid {first.pid} on "), msg
    assert socket.gethostname() in msg and "since 20" in msg and "-c " in msg and "sft.output_dir" in msg
    assert snapshot(tmp_path) == before  # the first run's files, its lock included, untouched


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_the_lock_of_a_killed_run_is_taken_over_with_a_log_line(tmp_path, holder, caplog, sig):
    import signal

    final = tmp_path / "ppo"
    first = holder(final, "ppo")
    first.send_signal(getattr(signal, sig))
    first.wait()
    assert lock_of(final).exists()  # the kernel dropped the lock; its file still names the dead run
    with caplog.at_level("WARNING", logger="rlhf"), atomic_dir(final, "ppo") as out:
        (out / "weights").write_text("new")
    line = " ".join(r.getMessage() for r in caplog.records)
    assert "stale lock" in line and f"pid {first.pid}" in line and "which has exited" in line, line
    assert leftovers(tmp_path) == []


def test_ctrl_c_releases_the_lock_and_removes_its_file(tmp_path, holder):
    import signal

    final = tmp_path / "ppo"
    first = holder(final, "ppo")
    first.send_signal(signal.SIGINT)
    first.wait(timeout=60)  # well before the holder's 120 s sleep ends: it stopped on the Ctrl-C
    assert first.returncode != 0 and "KeyboardInterrupt" in first.stderr.read()
    assert not lock_of(final).exists()


def test_a_lock_left_on_another_host_is_taken_over_and_said(tmp_path, caplog):
    final = tmp_path / "sft"
    lock_of(final).write_text(json.dumps({"pid": 4242, "host": "elsewhere.example", "command": "rlhf sft",
                                          "since": "2024-05-01T12:00:00+00:00"}))
    with caplog.at_level("WARNING", logger="rlhf"), atomic_dir(final, "sft"):
        pass
    line = " ".join(r.getMessage() for r in caplog.records)
    assert "stale lock" in line and "elsewhere.example" in line and "another host" in line, line


def test_a_claim_lasts_until_publish(tmp_path):
    """PPO claims its output before building `.<name>.partial` and gives it back when it publishes."""
    from rlhf_cli.run_lock import claim_output, output_lock

    final = tmp_path / "ppo"
    claim_output(final, "ppo")
    claim_output(final, "ppo")  # again in the same process: no self-deadlock
    with output_lock(final, "ppo"):  # nor with a block on the same output
        pass
    assert read_json(lock_of(final))["pid"] == os.getpid()
    work = tmp_path / ".ppo.partial"
    work.mkdir()
    publish(work, final, "ppo")
    assert not lock_of(final).exists() and read_json(final / OUTPUT_MARKER)["kind"] == "ppo"


def test_only_the_main_rank_takes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    final = tmp_path / "sft"
    monkeypatch.setenv("RANK", "1")
    with atomic_dir(final, "sft"):
        assert not lock_of(final).exists()
    monkeypatch.setenv("RANK", "0")
    with atomic_dir(final, "sft"):
        assert read_json(lock_of(final))["pid"] == os.getpid()
    assert not lock_of(final).exists()


def test_a_checkpoint_takes_no_lock_of_its_own(tmp_path):
    """The PPO run that writes it holds the lock of its output, which covers `.<name>.partial`."""
    ckpts = tmp_path / ".ppo.partial" / "checkpoints"
    with atomic_dir(ckpts / "checkpoint-1", "checkpoint", every_rank=False):
        assert not lock_of(ckpts / "checkpoint-1").exists()
    assert [p.name for p in ckpts.iterdir()] == ["checkpoint-1"]
