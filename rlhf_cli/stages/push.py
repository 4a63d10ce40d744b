"""`rlhf push`: upload a published model directory (sft, reward, ppo, dpo, a PPO run's best/, an export) with its
model card to the Hugging Face hub or ModelScope, as a private repository unless `push.private=false`.

What goes up is the directory's files less its training logs and resume checkpoints (`rlhf_cli.cards.
NOT_PUBLISHED`), the output marker, and nested outputs that are pushed on their own (a PPO run's best/ and
merged/). `push.dry_run=true` lists exactly those files and uploads nothing. Offline (`HF_HUB_OFFLINE=1`,
`model.offline=true`) or without a token it stops with one line before anything is created or uploaded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rlhf_cli import settings
from rlhf_cli.cards import CARD, NOT_PUBLISHED
from rlhf_cli.choices import PUSH_HUBS
from rlhf_cli.errors import RlhfError
from rlhf_cli.io import OUTPUT_MARKER, output_kind

log = logging.getLogger("rlhf")

MODEL_KINDS = ("sft", "reward", "ppo", "dpo", "export")  # what the output markers of model directories name
TOKEN_ENV = dict(zip(PUSH_HUBS, ("HF_TOKEN", "MODELSCOPE_API_TOKEN")))


def files_to_push(directory: Path) -> list[str]:
    """The files `rlhf push` uploads from `directory`, relative to it, sorted."""
    out = []
    for f in sorted(directory.rglob("*")):
        rel = f.relative_to(directory)
        if not f.is_file() or rel.name == OUTPUT_MARKER or rel.name.startswith("."):
            continue
        parents = [directory.joinpath(*rel.parts[:i]) for i in range(1, len(rel.parts))]
        if set(rel.parts[:-1]) & set(NOT_PUBLISHED) or any((p / OUTPUT_MARKER).is_file() for p in parents):
            continue
        out.append(rel.as_posix())
    return out


def check_directory(spec) -> Path:
    """`push.dir`: an rlhf model output with its card."""
    if spec in (None, ""):
        raise RlhfError("push.dir is not set; give the directory to upload, e.g. push.dir=runs/tiny/ppo")
    d = Path(str(spec)).expanduser()
    if not d.is_dir():
        raise RlhfError(f"push.dir={spec} is not a directory; give an output of rlhf sft, reward, ppo, dpo or export")
    kind = output_kind(d)
    if kind not in MODEL_KINDS:
        raise RlhfError(f"push.dir={spec} is not a model written by rlhf (sft, reward, ppo, dpo, export"
                        f"{'; it holds ' + kind + ' output' if kind else ''}); point it at one")
    if not (d / CARD).is_file():
        raise RlhfError(f"push.dir={spec} has no model card ({CARD}): it was written by an older rlhf; run its "
                        "stage again to publish it with one")
    return d


def token_for(hub: str, given, offline: bool) -> str:
    """The token to upload with; offline or without one: one line, before anything is uploaded."""
    if offline or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        raise RlhfError("offline (HF_HUB_OFFLINE=1 or model.offline=true), nothing uploaded; go online, or "
                        "list what would go up with push.dry_run=true")
    token = given or os.environ.get(TOKEN_ENV[hub])
    if not token and hub == "hf":
        from huggingface_hub import get_token

        token = get_token()
    if not token:
        raise RlhfError(f"no {hub} token, nothing uploaded; set push.token=..., the {TOKEN_ENV[hub]} "
                        "environment variable" + (", or log in with `hf auth login`" if hub == "hf" else ""))
    return token


def upload(hub: str, repo_id: str, directory: Path, files: list[str], private: bool, token: str,
           message: str) -> None:
    """Create the repository (kept if it exists) and upload exactly `files` of `directory` in one commit."""
    if hub == "hf":
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=str(directory), allow_patterns=files,
                          commit_message=message, repo_type="model")
        return
    from modelscope.hub.api import HubApi

    api = HubApi()
    api.login(token)
    api.create_repo(repo_id, visibility="private" if private else "public", exist_ok=True, repo_type="model")
    api.upload_folder(repo_id=repo_id, folder_path=str(directory), allow_patterns=files, commit_message=message,
                      repo_type="model")


def run(cfg) -> None:
    typed = settings.of(cfg)  # what the stage reads
    p = typed.push
    d = check_directory(p.dir)
    if not p.repo_id or str(p.repo_id).count("/") != 1:
        raise RlhfError(f"push.repo_id={p.repo_id} is not a repository id; give OWNER/NAME, e.g. "
                        "push.repo_id=me/tiny-ppo")
    files = files_to_push(d)
    where = f"{p.hub}:{p.repo_id} ({'private' if p.private else 'public'})"
    if p.dry_run:
        print(f"push.dry_run=true: would upload {len(files)} files of {d} to {where}:")
        for f in files:
            print(f"  {f}  {(d / f).stat().st_size} bytes")
        return
    token = token_for(str(p.hub), p.token, bool(typed.model.offline))
    upload(str(p.hub), str(p.repo_id), d, files, bool(p.private), token, str(p.commit_message))
    log.info("push: %d files of %s uploaded to %s", len(files), d, where)
    print(f"uploaded {len(files)} files to {where}")
