"""Model sources: the embedded tiny base (built on first use), a local directory, or a hub id resolved from the
local ModelScope / Hugging Face cache, else downloaded; and whether a hub can be reached. Imports no torch."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rlhf_cli.errors import RlhfError

log = logging.getLogger("rlhf")


def base_model_dir(run) -> Path:
    """The base model directory of the run's settings (`run`: rlhf_cli.settings.of): the embedded tiny model
    (built on first use; its tokenizer trained on the user's data file where one is given, else on the demo's), a
    local dir, or a hub id."""
    from rlhf_cli import tiny
    from rlhf_cli.own_data import tokenizer_texts

    m = run.model
    if tiny.is_tiny_spec(str(m.name_or_path)):
        t = m.tiny
        return tiny.build_tiny_base(t.dir, seed=int(t.seed), vocab_size=int(t.vocab_size),
                                    hidden_size=int(t.hidden_size), intermediate_size=int(t.intermediate_size),
                                    num_hidden_layers=int(t.num_hidden_layers),
                                    num_attention_heads=int(t.num_attention_heads),
                                    num_key_value_heads=int(t.num_key_value_heads), head_dim=int(t.head_dim),
                                    embedding_rows=int(t.embedding_rows) if t.get("embedding_rows") else None,
                                    texts=tokenizer_texts(run.data) if run.get("data") is not None else None)
    return resolve_model_source(str(m.name_or_path), hub=m.hub, revision=m.revision, cache_dir=m.cache_dir,
                                offline=bool(m.offline))


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def resolve_model_source(name: str, hub: str = "modelscope", revision: str | None = None,
                         cache_dir: str | None = None, offline: bool = False) -> Path:
    """A local directory as is; a hub id from the local cache first, then (unless offline) the network.

    ModelScope retries for ~22 s when offline, so the cache is asked first with `local_files_only=True`, which
    answers at once.
    """
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise RlhfError(f"model directory {p} has no config.json; point model.name_or_path at a saved model")
        return p
    if _looks_like_path(name):
        raise RlhfError(f"model path {p} does not exist; set model.name_or_path to a model directory or a hub id "
                        "such as Qwen/Qwen3-0.6B")
    if hub not in ("modelscope", "hf"):
        raise RlhfError(f"model.hub={hub} is unknown; use modelscope or hf")
    fetch = _modelscope_snapshot if hub == "modelscope" else _hf_snapshot
    try:
        return Path(fetch(name, revision, cache_dir, local_files_only=True))
    except Exception as cached_err:  # noqa: BLE001 - not in the cache: fall through to the network
        if offline:
            raise RlhfError(f"{name} is not in the local {hub} cache and model.offline=true; download it once "
                            f"with network access, or set model.name_or_path to a local directory") from cached_err
    other = "hf" if hub == "modelscope" else "modelscope"
    why = unreachable(hub)
    if why:  # the hub clients retry for half a minute before they give up: say it at once
        raise RlhfError(f"{name} is not in the local {hub} cache and {why}; check the network (`rlhf doctor`), try "
                        f"model.hub={other}, or set model.name_or_path to a local directory")
    log.info("downloading %s from %s", name, hub)
    try:
        return Path(fetch(name, revision, cache_dir, local_files_only=False))
    except Exception as e:  # noqa: BLE001 - network errors, unknown ids, auth: all one line for the user
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RlhfError(f"could not get model '{name}' from {hub} ({type(e).__name__}: {first}); check the id and "
                        f"the network, try model.hub={other}, "
                        "or set model.name_or_path to a local directory") from e


def hub_hosts() -> dict[str, tuple[str, int]]:
    """(host, port) of each hub, as its client reaches it (MODELSCOPE_DOMAIN_URL, HF_ENDPOINT)."""
    from urllib.parse import urlparse

    hf = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    ms = urlparse(os.environ.get("MODELSCOPE_DOMAIN_URL") or "https://www.modelscope.cn")
    return {"modelscope": (ms.hostname or "www.modelscope.cn", ms.port or 443),
            "hf": (hf.hostname or "huggingface.co", hf.port or 443)}


def unreachable(hub: str, timeout: float = 5.0) -> str | None:
    """Why `hub` cannot be reached (name resolution and one TCP connection), or None when it answers."""
    import socket

    host, port = hub_hosts()[hub]
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return f"{host} cannot be reached ({type(e).__name__}: {str(e) or 'no answer'})"


def _modelscope_snapshot(name, revision, cache_dir, local_files_only):
    from modelscope import snapshot_download

    kwargs = {"cache_dir": cache_dir, "local_files_only": local_files_only}
    if revision:
        kwargs["revision"] = revision
    return snapshot_download(name, **kwargs)


def _hf_snapshot(name, revision, cache_dir, local_files_only):
    from huggingface_hub import snapshot_download

    return snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
