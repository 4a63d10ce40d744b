"""`rlhf push`: which files go up (a dry run lists exactly them), the hub calls it makes (the upload itself
replaced by a recorder), and the one line it stops with offline, without a token or without a model to push."""

from __future__ import annotations

import json

import pytest
from clitools import EVAL_ROWS

from rlhf_cli.errors import RlhfError
from rlhf_cli.io import OUTPUT_MARKER
from rlhf_cli.stages import push


def published(tmp_path, kind="ppo"):
    """A fake published PPO directory: adapter, card, value/, a best/ output of its own, logs and checkpoints."""
    d = tmp_path / "runs/x/ppo"
    for rel in ("adapter_model.safetensors", "adapter_config.json", "README.md", "value/model.safetensors",
                "tensorboard/events.out", "checkpoints/checkpoint-1/adapter_model.safetensors",
                "best/adapter_model.safetensors", "best/README.md", ".README.md.tmp-1"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("x")
    (d / OUTPUT_MARKER).write_text(json.dumps({"written_by": "rlhf", "kind": kind}))
    (d / "best" / OUTPUT_MARKER).write_text(json.dumps({"written_by": "rlhf", "kind": "ppo"}))
    return d


def test_files_to_push_leave_out_logs_checkpoints_markers_and_nested_outputs(tmp_path):
    d = published(tmp_path)
    assert push.files_to_push(d) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                     "value/model.safetensors"]
    assert push.files_to_push(d / "best") == ["README.md", "adapter_model.safetensors"]


def test_upload_calls_the_hub_with_exactly_the_files_private(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    class Recorder:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw))

    monkeypatch.setattr(huggingface_hub, "HfApi", Recorder)
    d = published(tmp_path)
    files = push.files_to_push(d)
    push.upload("hf", "me/tiny", d, files, True, "tok", "msg")
    assert calls == [("token", "tok"),
                     ("create_repo", "me/tiny", {"private": True, "exist_ok": True, "repo_type": "model"}),
                     ("upload_folder", {"repo_id": "me/tiny", "folder_path": str(d), "allow_patterns": files,
                                        "commit_message": "msg", "repo_type": "model"})]


def test_offline_or_no_token_stops_before_any_upload(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RlhfError, match=r"^offline .* nothing uploaded; .* push.dry_run=true$"):
        push.token_for("hf", "tok", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(RlhfError, match="offline"):
        push.token_for("hf", "tok", True)  # model.offline=true
    monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
    with pytest.raises(RlhfError, match=r"^no modelscope token, nothing uploaded; set push.token=\.\.\., the "
                                        r"MODELSCOPE_API_TOKEN"):
        push.token_for("modelscope", None, False)
    assert push.token_for("modelscope", "abc", False) == "abc"


def test_push_refuses_what_is_no_published_model(tmp_path):
    with pytest.raises(RlhfError, match=r"push.dir is not set"):
        push.check_directory(None)
    d = published(tmp_path, kind="eval")
    with pytest.raises(RlhfError, match=r"is not a model written by rlhf .* it holds eval output"):
        push.check_directory(d)
    d = published(tmp_path / "b")
    (d / "README.md").unlink()
    with pytest.raises(RlhfError, match=r"has no model card \(README.md\)"):
        push.check_directory(d)


@pytest.mark.slow
def test_rlhf_push_dry_run_lists_the_files_and_offline_is_one_line(run_cli, tmp_path):
    rc, _, err = run_cli("sft", "recipe=tiny-math", "device.threads=1", "sft.max_steps=2", "sft.eval_steps=2",
                         "data.max_rows=64", EVAL_ROWS)
    assert rc == 0, err[-3000:]
    sft = tmp_path / "runs/tiny-math/sft"
    rc, out, err = run_cli("push", f"push.dir={sft}", "push.repo_id=me/tiny-sft", "push.dry_run=true")
    assert rc == 0, err[-3000:]
    listed = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  ")]
    assert listed == push.files_to_push(sft) and "README.md" in listed and "model.safetensors" in listed
    assert "hf:me/tiny-sft (private)" in out
    # the tests run offline (HF_HUB_OFFLINE=1): one line, nothing uploaded
    rc, out, err = run_cli("push", f"push.dir={sft}", "push.repo_id=me/tiny-sft")
    assert rc != 0 and "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("rlhf push: error: offline (HF_HUB_OFFLINE=1") and "nothing uploaded" in lines[-1]
    rc, _, err = run_cli("push", "push.repo_id=me/x")
    assert rc != 0 and "rlhf push: error: push.dir is not set" in err
