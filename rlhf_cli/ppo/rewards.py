"""Rewards and ground truth written as Python functions or served over HTTP: `ppo.reward` entries and
`data.ground_truth`.

A function is named as `module:function` (an importable module, e.g. `rlhf_cli.demo:polite_reward`) or
`/path/file.py:function` (a file, relative to the working directory or absolute). It is loaded once, before any
model, and every call's result is checked, so that a broken function stops the run with one line naming it.

Reward function (`ppo.reward`): called once per batch as ``fn(prompts, responses, **wanted)`` and returns one
float per response. `prompts` are the rendered prompt texts the policy continued (chat template included),
`responses` the decoded responses (special tokens dropped). `wanted` holds only what the function declares as
parameters (all of it with ``**kwargs``): `prompt_ids` / `response_ids` (lists of token ids, no padding; a
response's ids end with its stop token when it has one), `truncated` (bools: cut at ppo.response_length
without a stop token), and every extra field of the data rows by its name (e.g. a reference `answer`).

Reward server (`ppo.reward` entry `http://host:port/path` or https): `RemoteReward`, one JSON POST per batch with
the same inputs, `{"rewards": [...]}` back; OpenRLHF's remote reward servers work as they are.

Ground truth (`data.ground_truth`): called once per response as ``fn(response, **wanted)`` with `prompt` and the
row's extra fields on request; returns a bool, or a number in [0, 1] (partial credit). `demo_polite` is the
shipped demo's checker, `rlhf_cli.demo:is_polite`.

User code cannot end the run without saying why: sys.exit() (argparse at import, say) or GeneratorExit while
importing or calling a function becomes one RlhfError line naming it. Ctrl-C (KeyboardInterrupt) and the CLI's
SIGTERM pass through as they are: those are the user's, not the function's.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import logging
import math
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sized
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import torch

from rlhf_cli.choices import GROUND_TRUTH_SPECS
from rlhf_cli.errors import RlhfError
from rlhf_cli.schema import is_server_url, server_url_error

log = logging.getLogger("rlhf")

BUILTIN_GROUND_TRUTH = GROUND_TRUTH_SPECS
REWARD_INPUTS = ("prompt_ids", "response_ids", "truncated")  # besides prompts and responses, and the data's fields
SPEC_HELP = "module:function or /path/file.py:function"
DEFAULT_MAX_ABS = 1e4  # ppo.reward_max_abs's default: the largest |score| a function or server may give
USER_EXITS = (SystemExit, GeneratorExit)  # what user code ends with that is no error of an Exception's kind
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


# -------------------------------------------------------------------------------------------------- loading
def split_spec(spec: str) -> tuple[str, str] | None:
    """`module:function` / `path.py:function` -> (target, function); None when `spec` has neither shape."""
    target, sep, name = str(spec).rpartition(":")
    if not sep or not target or not _NAME.match(name):
        return None
    if not _is_file(target) and not _NAME.match(target):
        return None
    return target, name


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def load_function(spec: str, key: str) -> Callable:
    """The callable `spec` names; `key` (the config key) is named in every error."""
    parts = split_spec(spec)
    if parts is None:
        raise RlhfError(f"{key}: {spec!r} is not a function reference; use {SPEC_HELP}")
    target, name = parts
    if _is_file(target):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise RlhfError(f"{key}: {spec}: file {path} does not exist; give the path of a .py file")
        mod_name = f"rlhf_user_{re.sub(r'[^A-Za-z0-9_]', '_', str(path))}"
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                _importing(lambda: loader_spec.loader.exec_module(module), f"{key}: {spec}: importing {path}")
            except RlhfError:
                raise
            except Exception as e:  # noqa: BLE001 - any error in the user's file: one line naming it
                raise RlhfError(f"{key}: {spec}: importing {path} failed ({_first_line(e)})") from e
            sys.modules[mod_name] = module
    else:
        try:
            module = _importing(lambda: importlib.import_module(target), f"{key}: {spec}: importing {target}")
        except RlhfError:
            raise
        except ModuleNotFoundError as e:
            raise RlhfError(f"{key}: {spec}: no module {e.name!r} (is it installed, or on PYTHONPATH? a file is "
                            "named as /path/file.py:function)") from e
        except Exception as e:  # noqa: BLE001
            raise RlhfError(f"{key}: {spec}: importing {target} failed ({_first_line(e)})") from e
    fn = module
    for part in name.split("."):
        if not hasattr(fn, part):
            raise RlhfError(f"{key}: {spec}: {target} has no {name!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise RlhfError(f"{key}: {spec}: {name} is a {type(fn).__name__}, not a function")
    return fn


def _importing(load: Callable, what: str):
    """`load()`, the import of a user's module, with what it writes to stderr held back until it is done: a
    module that exits at import (argparse reading rlhf's own command line, say) printed an error that reads as
    rlhf's, so its last line is quoted in ours instead. Whatever else it printed is passed on."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            return load()
    except USER_EXITS as e:
        printed = (held.getvalue().strip().splitlines() or [""])[-1]
        held = None
        raise RlhfError(f"{what} {_exit_text(e)}{f' after printing {_one_line(printed, 160)!r}' if printed else ''}"
                        "; the module is imported, not run: put its command-line code under "
                        "`if __name__ == \"__main__\":`") from e
    finally:
        if held is not None and held.getvalue():
            sys.stderr.write(held.getvalue())


def _exit_text(e: BaseException) -> str:
    """"called sys.exit(2)" / "raised GeneratorExit": how user code tried to end the run."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({'' if e.code is None else repr(e.code)})"
    return f"raised {type(e).__name__}"


class _NoExit:
    """Around a call of user code: sys.exit() or GeneratorExit in it becomes one RlhfError line `what ... doing;
    fix` (the CLI would otherwise end with that exit's code and no word on why). Everything else passes."""

    def __init__(self, what: str, doing: str, fix: str) -> None:
        self.what, self.doing, self.fix = what, doing, fix

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if isinstance(e, USER_EXITS):
            raise RlhfError(f"{self.what} {_exit_text(e)} {self.doing}; {self.fix}") from e
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _wanted(fn: Callable, spec: str, key: str, positional: int, offered: set[str]) -> set[str] | None:
    """The keyword inputs `fn` declares among `offered` (None: it takes **kwargs, so all). Refuses a function
    that cannot take `positional` arguments or needs a parameter nobody supplies."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins without a signature: positional arguments only
    params = list(sig.parameters.values())
    takes_all = any(q.kind is q.VAR_KEYWORD for q in params)
    pos = [q for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    if len(pos) < positional and not any(q.kind is q.VAR_POSITIONAL for q in params):
        raise RlhfError(f"{key}: {spec} takes {len(pos)} positional argument(s); it is called as "
                        f"{'fn(prompts, responses, ...)' if positional == 2 else 'fn(response, ...)'}")
    rest = [q for q in params[positional:] if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)] \
        if len(pos) >= positional else [q for q in params if q.kind is q.KEYWORD_ONLY]
    missing = [q.name for q in rest if q.default is q.empty and q.name not in offered]
    if missing:
        raise RlhfError(f"{key}: {spec} needs {', '.join(missing)}, which rlhf does not supply; it can ask for "
                        f"{', '.join(sorted(offered)) or 'nothing more'}")
    return None if takes_all else {q.name for q in rest if q.name in offered}


# -------------------------------------------------------------------------------------------------- checks
def _scores(out, n: int, what: str) -> list[float]:
    """`n` finite floats from what a reward function returned: a list, tuple or generator, or a tensor / array
    of n values (shape (n,), (n, 1) or (1, n)), one number per response in order. A dict (its keys would be the
    scores), a set (no order), text or bytes (characters) are refused, not read as numbers."""
    fix = f"return one float per response ({n}), in order"
    if isinstance(out, (str, bytes, bytearray, memoryview, Mapping, AbstractSet)):
        raise RlhfError(f"{what} returned a {type(out).__name__} ({_one_line(repr(out), 60)}), not a list; {fix}")
    if isinstance(out, torch.Tensor) or (hasattr(out, "__array__") and hasattr(out, "shape")):
        shape = tuple(out.shape)
        if sum(d != 1 for d in shape) > 1:
            raise RlhfError(f"{what} returned a {type(out).__name__} of shape {shape}; {fix}")
        if isinstance(out, torch.Tensor):
            out = out.detach().flatten().tolist()
        else:
            import numpy as np

            out = np.asarray(out).reshape(-1).tolist()
    if not isinstance(out, Sized):
        if not isinstance(out, Iterable):
            raise RlhfError(f"{what} returned a {type(out).__name__}, not a list; {fix}")
        out = list(itertools.islice(out, n + 1))  # a generator: read no further than one too many
        if len(out) > n:
            raise RlhfError(f"{what} returned more than {n} values for {n} responses; {fix}")
    if len(out) != n:
        raise RlhfError(f"{what} returned {len(out)} values for {n} responses; return one float per response")
    return [_number(v, i, what) for i, v in enumerate(out)]


def _within(scores: list[float], max_abs: float | None, what: str) -> list[float]:
    """`scores`, unless one is beyond ±`max_abs` (ppo.reward_max_abs): such a score swamps the KL penalty and
    the other sources, and the run would end later as a loss blow-up blamed on the learning rate."""
    if max_abs is None or not scores:
        return scores
    i = max(range(len(scores)), key=lambda j: abs(scores[j]))
    if abs(scores[i]) > max_abs:
        raise RlhfError(f"{what} {scores[i]:g} for response {i}, beyond ppo.reward_max_abs={max_abs:g}; rescale "
                        "its rewards, or raise ppo.reward_max_abs (null: no limit)")
    return scores


def _number(v, i: int, what: str) -> float:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    try:
        if isinstance(v, (str, bytes)):
            raise TypeError
        x = float(v)
    except (TypeError, ValueError):
        raise RlhfError(f"{what} returned {v!r} ({type(v).__name__}) for response {i}; "
                        "return one float per response") from None
    if not math.isfinite(x):
        raise RlhfError(f"{what} returned a non-finite value ({x}) for response {i}; return finite floats")
    return x


# -------------------------------------------------------------------------------------------------- rewards
@dataclass(frozen=True)
class RewardFunction:
    """One `ppo.reward` function, loaded and checked once."""

    spec: str
    fn: Callable
    wanted: frozenset[str] | None   # keyword inputs it declared; None: all (it takes **kwargs)
    max_abs: float | None = DEFAULT_MAX_ABS  # ppo.reward_max_abs: the largest |score| accepted; None: any

    @property
    def name(self) -> str:
        return self.spec.rpartition(":")[2]

    @classmethod
    def load(cls, spec: str, extra_fields: set[str] = frozenset(), key: str = "ppo.reward", *,
             timeout_s: float = 60.0, retries: int = 3,
             max_abs: float | None = DEFAULT_MAX_ABS) -> RewardFunction | RemoteReward:
        """The function `spec` names, or for an http(s) URL the `RemoteReward` asking that server (`timeout_s`
        and `retries` are its ppo.reward_timeout_s and ppo.reward_retries): both are called the same way.
        `max_abs` is ppo.reward_max_abs, for both."""
        max_abs = None if max_abs is None else float(max_abs)
        if is_server_url(spec):
            return RemoteReward.load(spec, key, timeout_s=timeout_s, retries=retries, max_abs=max_abs)
        fn = load_function(spec, key)
        wanted = _wanted(fn, spec, key, 2, set(REWARD_INPUTS) | set(extra_fields))
        return cls(spec, fn, None if wanted is None else frozenset(wanted), max_abs)

    def __call__(self, prompts: list[str], responses: list[str], **inputs) -> list[float]:
        """Scores of `responses`: one finite float each, or an RlhfError naming the function."""
        kw = inputs if self.wanted is None else {k: v for k, v in inputs.items() if k in self.wanted}
        what, n = f"ppo.reward function {self.spec}", len(responses)
        try:
            with _NoExit(what, f"while scoring {n} responses", "return the scores instead, or remove it from "
                         "ppo.reward"):
                scores = _scores(self.fn(prompts, responses, **kw), n, what)  # a generator's code runs here too
        except RlhfError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: one line naming it
            raise RlhfError(f"{what} raised {_first_line(e)}; fix it (it got {n} responses) or "
                            "remove it from ppo.reward") from e
        return _within(scores, self.max_abs, f"{what} returned")


# ---------------------------------------------------------------------------------------------- reward servers
class _TryFailed(Exception):
    """One failed POST: what went wrong, what to do about it, and whether another try can help."""

    def __init__(self, reason: str, fix: str, retry: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.fix, self.retry = reason, fix, retry


FORMAT_FIX = 'the server must answer {"rewards": [one finite number per response]} or a bare list of them'
MAX_BACKOFF_S = 30.0
MAX_REDIRECTS = 5   # 307 / 308 hops followed per try


class _Redirects(urllib.request.HTTPRedirectHandler):
    """307 / 308: the same POST, body and all, sent again to the Location, at most MAX_REDIRECTS times. 301 /
    302 / 303 are refused: urllib would follow them with a GET without the batch and use whatever came back."""

    max_repeats = max_redirections = MAX_REDIRECTS + 1  # the count below stops first, with a clearer line

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if code not in (307, 308):
            fp.close()
            raise _TryFailed(f"HTTP {code} {msg}, a redirect to {newurl}, which would drop the batch (a GET)",
                             f"set ppo.reward to {newurl} (307 / 308 redirects are followed)", retry=False)
        hops = getattr(req, "rlhf_hops", 0) + 1
        if hops > MAX_REDIRECTS:
            fp.close()
            raise _TryFailed(f"more than {MAX_REDIRECTS} redirects (the last, HTTP {code}, to {newurl})",
                             "set ppo.reward to the server's final URL", retry=False)
        new = urllib.request.Request(newurl, data=req.data, headers=dict(req.headers), method="POST")
        new.rlhf_hops = hops
        return new


@dataclass(frozen=True)
class RemoteReward:
    """One `ppo.reward` URL: a reward server, asked with one JSON POST per scoring step.

    Request body, one entry per response in every list:
      prompts, responses           the rendered prompt texts (chat template included), the decoded responses
      query                        prompt + response, concatenated
      labels                       each row's `label` field, else its `answer`, else ""
      rows                         each data row's extra fields, as a dict
      prompt_ids, response_ids, truncated   as a reward function gets them
    `query`, `prompts` and `labels` are OpenRLHF's remote reward format (openrlhf/utils/remote_rm_utils.py):
    its `serve_rm` reads `query` only, custom OpenRLHF servers `query`, `prompts` and `labels`.
    Answer: `{"rewards": [...]}` (OpenRLHF's; other keys are ignored) or a bare list, one finite number per
    response, used as returned. A failed try is repeated up to `retries` times, `backoff_s` · 2^k apart; a 4xx
    answer other than 408 / 429 is not (the URL or the request is wrong), nor a 301 / 302 / 303 redirect (307 /
    308 are followed with the same POST). Then one RlhfError line names the URL, the last error and what to do.
    A reward beyond ±`max_abs` stops the run at once. The test's server (tests/test_reward_server.py) is a
    minimal example.
    """

    url: str
    timeout_s: float = 60.0       # per try, all of it: connecting, redirects, the answer's last byte
    retries: int = 3              # tries after the first
    backoff_s: float = 1.0        # wait before the first retry; doubled each time, at most MAX_BACKOFF_S
    max_abs: float | None = DEFAULT_MAX_ABS  # ppo.reward_max_abs: the largest |reward| accepted; None: any

    @property
    def spec(self) -> str:
        return self.url

    @property
    def name(self) -> str:
        """`http_127_0_0_1_8000_score`: scheme, host, port and path, fit for a metric name."""
        parts = urlsplit(self.url)
        return re.sub(r"[^A-Za-z0-9]+", "_", f"{parts.scheme}_{parts.netloc}{parts.path}").strip("_").lower()

    @classmethod
    def load(cls, url: str, key: str = "ppo.reward", *, timeout_s: float = 60.0, retries: int = 3,
             max_abs: float | None = DEFAULT_MAX_ABS) -> RemoteReward:
        """Checks the URL's shape only: the server is first asked at the first scoring step."""
        problem = server_url_error(key, url)
        if problem:
            raise RlhfError(problem)
        return cls(url, float(timeout_s), int(retries), max_abs=None if max_abs is None else float(max_abs))

    def body(self, prompts: list[str], responses: list[str], **inputs) -> dict:
        """The request for one batch; `inputs` as `reward_inputs` gives them (the data's fields as lists)."""
        fields = [k for k in inputs if k not in REWARD_INPUTS]
        rows = [{k: inputs[k][i] for k in fields} for i in range(len(responses))]
        body = {"prompts": list(prompts), "responses": list(responses),
                "query": [p + r for p, r in zip(prompts, responses)],
                "labels": [_label(row) for row in rows], "rows": rows}
        body.update({k: inputs[k] for k in REWARD_INPUTS if k in inputs})
        return body

    def __call__(self, prompts: list[str], responses: list[str], **inputs) -> list[float]:
        """One finite reward per response, from the server; or an RlhfError line naming the URL."""
        data = json.dumps(self.body(prompts, responses, **inputs), default=_jsonable).encode("utf-8")
        tries, start = self.retries + 1, time.monotonic()
        for k in range(tries):
            try:
                rewards = self._post(data, len(responses))
                return _within(rewards, self.max_abs, f"ppo.reward server {self.url} answered")  # not retried
            except _TryFailed as e:
                failed = e
                if not e.retry or k == tries - 1:
                    break
                wait = min(self.backoff_s * 2 ** k, MAX_BACKOFF_S)
                log.warning("ppo.reward server %s: try %d of %d failed (%s); trying again in %g s", self.url,
                            k + 1, tries, e.reason, wait)
                time.sleep(wait)
        took = f"after {k + 1} tries in {time.monotonic() - start:.1f} s" if k else "at its first try"
        raise RlhfError(f"ppo.reward server {self.url} failed {took}: {failed.reason}; {failed.fix}")

    @property
    def _wait_fix(self) -> str:
        return (f"make the server answer a batch faster, or raise ppo.reward_timeout_s (now {self.timeout_s:g}) "
                "or ppo.reward_retries")

    def _post(self, data: bytes, n: int) -> list[float]:
        """One try: POST `data`, read `n` rewards, or raise `_TryFailed`; all of it within `timeout_s`."""
        wait_fix = self._wait_fix
        request = urllib.request.Request(self.url, data=data, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        deadline = time.monotonic() + self.timeout_s
        try:
            with urllib.request.build_opener(_Redirects).open(request, timeout=self.timeout_s) as reply:
                raw = self._read(reply, deadline)
        except urllib.error.HTTPError as e:
            detail = _one_line(e.read().decode("utf-8", "replace"), 160)
            reason = f"HTTP {e.code} {_one_line(e.reason)}" + (f" ({detail})" if detail else "")
            if e.code >= 500 or e.code in (408, 429):
                raise _TryFailed(reason, "see the server's log") from None
            fix = "check the URL's path" if e.code in (404, 405) else \
                "set ppo.reward to the server's final URL" if 300 <= e.code < 400 else \
                "the server refused the request: see its log (the request is RemoteReward's in rlhf_cli.ppo.rewards)"
            raise _TryFailed(reason, fix, retry=False) from None
        except TimeoutError:  # while reading the answer
            raise _TryFailed(f"no answer within {self.timeout_s:g} s", wait_fix) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise _TryFailed(f"no answer within {self.timeout_s:g} s", wait_fix) from None
            if isinstance(e.reason, ConnectionRefusedError):
                raise _TryFailed("connection refused", "start the server, or fix the host and port in ppo.reward") \
                    from None
            if isinstance(e.reason, socket.gaierror):
                raise _TryFailed(f"unknown host ({_one_line(e.reason)})", "fix the host in ppo.reward") from None
            raise _TryFailed(_one_line(e.reason), "check that the server is running and reachable") from None
        except (OSError, http.client.HTTPException) as e:  # reset or closed connections, broken HTTP answers
            raise _TryFailed(f"connection broken ({_one_line(e) or type(e).__name__})", "see the server's log") \
                from None
        try:
            answer = json.loads(raw)
        except ValueError:
            raise _TryFailed(f"malformed JSON ({_one_line(raw.decode('utf-8', 'replace'), 80) or 'empty'})",
                             FORMAT_FIX) from None
        return _server_rewards(answer, n)

    def _read(self, reply, deadline: float) -> bytes:
        """The answer's body, read chunk by chunk against the try's `deadline`: a socket timeout bounds each wait
        only, so a server trickling its answer a byte at a time would otherwise hold the run for ever."""
        chunks, got = [], 0
        while True:
            left = deadline - time.monotonic()
            sock = getattr(getattr(getattr(reply, "fp", None), "raw", None), "_sock", None)
            try:
                if left <= 0:
                    raise TimeoutError
                if isinstance(sock, socket.socket):
                    sock.settimeout(left)  # the next wait ends at the deadline too
                chunk = reply.read1(65536)
            except TimeoutError:
                raise _TryFailed(f"no complete answer within {self.timeout_s:g} s ({got} bytes by then)",
                                 self._wait_fix) from None
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            got += len(chunk)


def _server_rewards(answer, n: int) -> list[float]:
    """The rewards of a server's decoded answer: `{"rewards": [...]}` or a bare list, `n` finite numbers."""
    if isinstance(answer, dict):
        if "rewards" not in answer:
            raise _TryFailed(f"an answer without \"rewards\" (keys: {', '.join(map(str, answer)) or 'none'})",
                             FORMAT_FIX)
        answer = answer["rewards"]
    if not isinstance(answer, list):
        raise _TryFailed(f"rewards that are a {type(answer).__name__}, not a list", FORMAT_FIX)
    if len(answer) != n:
        raise _TryFailed(f"{len(answer)} rewards for {n} responses", FORMAT_FIX)
    for i, v in enumerate(answer):
        if v is None:
            raise _TryFailed(f"no reward (null) for response {i}", FORMAT_FIX)
        if not isinstance(v, (int, float)):
            raise _TryFailed(f"a reward that is not a number ({_one_line(json.dumps(v), 40)}) for response {i}",
                             FORMAT_FIX)
        if not math.isfinite(v):
            raise _TryFailed(f"a non-finite reward ({v}) for response {i}", FORMAT_FIX)
    return [float(v) for v in answer]


def _label(row: dict) -> str:
    """OpenRLHF's `labels` entry of a row: its `label`, else its `answer` field, as text ("" without either)."""
    v = row.get("label") if row.get("label") is not None else row.get("answer")
    return "" if v is None else v if isinstance(v, str) else json.dumps(v, default=_jsonable)


def _jsonable(v):
    """A data field JSON cannot write as it is: numpy values as numbers and lists, anything else as text."""
    return v.tolist() if hasattr(v, "tolist") else str(v)


def _one_line(v, limit: int = 200) -> str:
    return " ".join(str(v).split())[:limit]


def reward_inputs(exp, rows: list[dict]) -> dict:
    """What a reward function may ask for, from an `Experience` and the data rows' extra fields (one dict per
    row): prompt_ids, response_ids, truncated, and each extra field as a list."""
    P = exp.context_length
    prompt_ids = [ids[m.bool()].tolist()
                  for ids, m in zip(exp.input_ids[:, :P].cpu(), exp.attention_mask[:, :P].cpu())]
    response_ids = [ids[m.bool()].tolist() for ids, m in zip(exp.response_ids.cpu(), exp.response_mask.cpu())]
    inputs = {"prompt_ids": prompt_ids, "response_ids": response_ids,
              "truncated": [not bool(s) for s in exp.has_stop.tolist()]}
    for name in sorted({k for r in rows for k in r}):
        if name not in inputs and name not in ("prompts", "responses"):
            inputs[name] = [r.get(name) for r in rows]
    return inputs


def source_names(specs: tuple[str, ...]) -> list[str]:
    """Metric names of the reward sources (`reward/<name>`): "model", each function's name and each server's
    (`http_127_0_0_1_8000_score`), made unique."""
    names = []
    for spec in specs:
        if is_server_url(spec):
            base = RemoteReward(spec).name
        else:
            base = spec if ":" not in spec else spec.rpartition(":")[2]
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


def weighted_sum(scores: list[torch.Tensor], weights: tuple[float, ...]) -> torch.Tensor:
    """Σ_k w_k · s_k over the sources, each (B,) -> (B,). A single source of weight 1 is returned as it is."""
    if len(scores) == 1 and weights[0] == 1.0:
        return scores[0]
    total = torch.zeros_like(scores[0])
    for s, w in zip(scores, weights):
        total = total + float(w) * s
    return total


# ---------------------------------------------------------------------------------------------- ground truth
@dataclass(frozen=True)
class GroundTruth:
    """`data.ground_truth`: a checker of one response, returning a bool or a number in [0, 1]."""

    spec: str
    fn: Callable
    wanted: frozenset[str] | None

    @classmethod
    def load(cls, spec: str | None, extra_fields: set[str] = frozenset()) -> GroundTruth | None:
        """None for null; `demo_polite` is the demo's checker."""
        if spec in (None, ""):
            return None
        spec = BUILTIN_GROUND_TRUTH.get(str(spec), str(spec))
        fn = load_function(spec, "data.ground_truth")
        wanted = _wanted(fn, spec, "data.ground_truth", 1, {"prompt"} | set(extra_fields))
        return cls(spec, fn, None if wanted is None else frozenset(wanted))

    def __call__(self, responses: list[str], prompts: list[str] | None = None,
                 rows: list[dict] | None = None) -> list[float]:
        """One value in [0, 1] per response (a bool is 0 or 1); pass = value ≥ 0.5."""
        out = []
        what = f"data.ground_truth function {self.spec}"
        for i, text in enumerate(responses):
            offered = dict(rows[i]) if rows else {}
            if prompts is not None:
                offered["prompt"] = prompts[i]
            kw = offered if self.wanted is None else {k: v for k, v in offered.items() if k in self.wanted}
            try:
                with _NoExit(what, f"on response {i} ({text[:40]!r})", "return a bool or a number in [0, 1] "
                             "instead, or set data.ground_truth=null"):
                    x = _number(self.fn(text, **kw), i, what)
            except RlhfError:
                raise
            except Exception as e:  # noqa: BLE001
                raise RlhfError(f"{what} raised {_first_line(e)} on response {i} ({text[:40]!r}); fix it or set "
                                "data.ground_truth=null") from e
            if not 0.0 <= x <= 1.0:
                raise RlhfError(f"{what} returned {x} for response {i}; return a bool or a number in [0, 1]")
            out.append(x)
        return out
