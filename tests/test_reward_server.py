"""A reward server as a `ppo.reward` source (`rlhf_cli.ppo.rewards.RemoteReward`), against a small server this
file starts on 127.0.0.1 that scores politeness with `rlhf_cli.demo:is_polite`: what is sent, both answer
formats (ours and OpenRLHF's bare list), retries, and every way a server can fail, each one error line naming
the URL. The slow tests run the real `rlhf ppo` against such a server: it trains, and a server that goes away
mid-run stops the run with one line and leaves the earlier outputs byte-identical.

`PoliteServer` below is also the shortest example of a reward server: read the JSON body, answer
`{"rewards": [...]}`, one number per response.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from clitools import EVAL_ROWS
from test_bad_inputs_ownership import one_error_line, rlhf, tree  # the real CLI, one error line, hashed trees

from rlhf_cli.config import compose
from rlhf_cli.demo import is_polite
from rlhf_cli.errors import RlhfError
from rlhf_cli.ppo.config import PPOConfig
from rlhf_cli.ppo.rewards import RemoteReward, RewardFunction, source_names

PROMPTS = ["<user>How do I boil an egg?", "<user>Fix my bike", "<user>Hi"]
RESPONSES = ["Thanks for asking! Boil it for 8 minutes.", "Ugh, do it yourself.", ""]
POLITE = [1.0, 0.0, 0.0]
LIFETIME_S = 900  # a server left running by a failed test stops itself after this


# ------------------------------------------------------------------------------------------------- the server
def polite(body: dict):
    """Our format: {"rewards": [1.0 for a polite response, else 0.0]}."""
    return 200, {"rewards": [1.0 if is_polite(r) else 0.0 for r in body["responses"]]}


def polite_openrlhf(body: dict):
    """An OpenRLHF-style server: reads `query` and `prompts` only, answers a bare list."""
    return 200, [1.0 if is_polite(q[len(p):]) else 0.0 for q, p in zip(body["query"], body["prompts"])]


class PoliteServer:
    """A ThreadingHTTPServer on 127.0.0.1 (a free port) serving `answer(body) -> (status, JSON value or bytes)`
    (or `(status, value, headers)`) on POST in a thread; keeps every request body. Stops when the `with` block
    ends, after `LIFETIME_S`, or after answering `stop_after` requests (its port then refuses connections).
    `trickle_s`: the answer's body is sent one byte at a time, this many seconds apart. A GET (what a POST
    becomes after a 302 in urllib) is kept in `gets` and answered with three rewards of 1.0."""

    def __init__(self, answer: Callable = polite, stop_after: int | None = None,
                 trickle_s: float | None = None) -> None:
        self.answer, self.stop_after, self.trickle_s, self.bodies, self.gets = answer, stop_after, trickle_s, [], []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # http.server calls it by this name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append(body)
                status, value, *headers = server.answer(body)
                data = value if isinstance(value, bytes) else json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, text in (headers[0] if headers else {}).items():
                    self.send_header(name, text)
                self.end_headers()
                if server.trickle_s is None:
                    self.wfile.write(data)
                for i in range(len(data) if server.trickle_s is not None else 0):
                    self.wfile.write(data[i:i + 1])
                    time.sleep(server.trickle_s)
                if server.stop_after is not None and len(server.bodies) >= server.stop_after:
                    threading.Thread(target=server.stop, daemon=True).start()

            def do_GET(self):
                server.gets.append(self.path)
                data = json.dumps([1.0, 1.0, 1.0]).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda request, address: None  # a client that gave up: no traceback
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/score"
        self._stopped = threading.Event()
        self._timer = threading.Timer(LIFETIME_S, self.stop)
        self._timer.daemon = True

    def stop(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._timer.cancel()
            self.httpd.shutdown()
            self.httpd.server_close()

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def quick(url: str, timeout_s: float = 5.0, retries: int = 3) -> RemoteReward:
    """A RemoteReward that backs off for milliseconds, not seconds."""
    return RemoteReward(url, timeout_s=timeout_s, retries=retries, backoff_s=0.01)


def fails(reward: RemoteReward, *needles: str) -> str:
    with pytest.raises(RlhfError) as e:
        reward(PROMPTS, RESPONSES)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"ppo.reward server {reward.url} failed "), msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- what is sent
def test_one_post_per_batch_with_texts_token_ids_rows_and_openrlhf_fields():
    inputs = {"prompt_ids": [[1, 2], [3], [4, 5, 6]], "response_ids": [[7, 2], [8], [2]],
              "truncated": [False, True, False], "answer": ["8 minutes", None, "hello"],
              "label": [None, None, 3]}
    with PoliteServer() as server:
        assert quick(server.url)(PROMPTS, RESPONSES, **inputs) == POLITE
    assert len(server.bodies) == 1
    body = server.bodies[0]
    assert body["prompts"] == PROMPTS and body["responses"] == RESPONSES
    assert body["query"] == [p + r for p, r in zip(PROMPTS, RESPONSES)]
    assert body["labels"] == ["8 minutes", "", "3"]  # label, else answer, else ""; as text
    assert body["rows"] == [{"answer": "8 minutes", "label": None}, {"answer": None, "label": None},
                            {"answer": "hello", "label": 3}]
    assert {k: body[k] for k in ("prompt_ids", "response_ids", "truncated")} == \
        {k: inputs[k] for k in ("prompt_ids", "response_ids", "truncated")}


def test_both_answer_formats():
    with PoliteServer(polite) as ours, PoliteServer(polite_openrlhf) as theirs:
        assert quick(ours.url)(PROMPTS, RESPONSES) == POLITE
        assert quick(theirs.url)(PROMPTS, RESPONSES) == POLITE
    with PoliteServer(lambda body: (200, {"rewards": [0.5, -1, 2.0], "scores": [0, 0, 0], "extra_logs": {}})) as s:
        assert quick(s.url)(PROMPTS, RESPONSES) == [0.5, -1.0, 2.0]  # other keys (OpenRLHF's) ignored


def test_loaded_as_a_reward_source_with_its_name_and_keys():
    url = "http://127.0.0.1:8000/score"
    r = RewardFunction.load(url, {"answer"}, timeout_s=7, retries=1)
    assert isinstance(r, RemoteReward) and (r.url, r.timeout_s, r.retries) == (url, 7.0, 1)
    assert r.spec == url and r.name == "http_127_0_0_1_8000_score"
    assert source_names(("model", "rlhf_cli.demo:polite_reward", url, "https://rm.example.com/v1/score")) == \
        ["model", "polite_reward", "http_127_0_0_1_8000_score", "https_rm_example_com_v1_score"]
    cfg = compose("ppo", [f"ppo.reward=[model,rlhf_cli.demo:polite_reward,{url}]", "ppo.reward_weights=[1,0.5,2]",
                          "ppo.reward_timeout_s=7", "ppo.reward_retries=1"])
    c = PPOConfig.from_cfg(cfg.ppo)
    assert c.reward == ("model", "rlhf_cli.demo:polite_reward", url) and c.weights() == (1.0, 0.5, 2.0)
    assert (cfg.ppo.reward_timeout_s, cfg.ppo.reward_retries) == (7, 1)
    defaults = compose("ppo").ppo
    assert (defaults.reward_timeout_s, defaults.reward_retries, defaults.reward_max_abs) == (60, 3, 1e4)
    assert compose("ppo", ["ppo.reward_max_abs=null"]).ppo.reward_max_abs is None
    r = RewardFunction.load(url, max_abs=50)
    assert isinstance(r, RemoteReward) and r.max_abs == 50.0 and RewardFunction.load(url, max_abs=None).max_abs is None


@pytest.mark.parametrize("url, needle", [
    ("http://:8000/score", "(no host)"),
    ("http://127.0.0.1:port/score", "(Port could not be cast to integer value"),
    ("https://127.0.0.1:99999/score", "(Port out of range"),
    ("http://127.0.0.1:0/score", "(port 0)"),
])
def test_a_malformed_url_is_one_line(url, needle):
    with pytest.raises(RlhfError) as e:
        compose("ppo", [f"ppo.reward=[{url}]"])
    msg = str(e.value)
    assert msg.startswith(f"ppo.reward: {url} is not a reward server URL {needle}") and "\n" not in msg, msg
    assert msg.endswith("use http(s)://host[:port]/path")
    with pytest.raises(RlhfError, match="is not a reward server URL"):
        RewardFunction.load(url)


@pytest.mark.parametrize("override, needle", [
    ("ppo.reward_timeout_s=0", "ppo.reward_timeout_s=0 is out of range"),
    ("ppo.reward_retries=-1", "ppo.reward_retries=-1 is out of range"),
    ("ppo.reward_max_abs=0", "ppo.reward_max_abs=0 is out of range; use a number > 0, or null"),
    ("ppo.reward_max_abs=inf", "ppo.reward_max_abs=inf is not a finite number"),
])
def test_timeout_and_retries_are_checked(override, needle):
    with pytest.raises(RlhfError, match=needle):
        compose("ppo", [override])


# --------------------------------------------------------------------------------------------------- retries
def test_a_failing_server_is_retried_then_its_answer_used(caplog):
    answers = iter([(500, b"model loading"), (503, {"detail": "busy"})])
    with PoliteServer(lambda body: next(answers, None) or polite(body)) as server, \
            caplog.at_level(logging.WARNING, logger="rlhf"):
        assert quick(server.url)(PROMPTS, RESPONSES) == POLITE
    assert len(server.bodies) == 3
    tried = [r.getMessage() for r in caplog.records]
    assert len(tried) == 2 and "try 1 of 4 failed (HTTP 500 Internal Server Error (model loading))" in tried[0]
    assert "try 2 of 4 failed (HTTP 503 Service Unavailable" in tried[1]


def test_retries_back_off_exponentially():
    with PoliteServer(lambda body: (500, b"down")) as server:
        start = time.monotonic()
        fails(RemoteReward(server.url, retries=2, backoff_s=0.2), "after 3 tries", "HTTP 500")
        assert time.monotonic() - start >= 0.6  # 0.2 + 0.4
    assert len(server.bodies) == 3


# --------------------------------------------------------------------------------------- a server that fails
def test_a_closed_port_is_connection_refused():
    msg = fails(quick(f"http://127.0.0.1:{closed_port()}/score", retries=2), "after 3 tries", "connection refused",
                "start the server, or fix the host and port in ppo.reward")
    assert msg.count("127.0.0.1") == 1


def test_a_server_that_always_fails_names_its_last_status():
    with PoliteServer(lambda body: (500, b"CUDA out of memory\nTraceback...")) as server:
        fails(quick(server.url), "after 4 tries", "HTTP 500 Internal Server Error (CUDA out of memory Traceback...)",
              "see the server's log")
    assert len(server.bodies) == 4


def test_a_server_that_answers_too_late_times_out():
    def slow(body):
        time.sleep(1.0)
        return polite(body)

    with PoliteServer(slow) as server:
        fails(quick(server.url, timeout_s=0.2, retries=1), "after 2 tries", "no answer within 0.2 s",
              "raise ppo.reward_timeout_s (now 0.2)")


def test_a_wrong_url_path_is_not_retried():
    with PoliteServer(lambda body: (404, b"")) as server:
        fails(quick(server.url), "failed at its first try: HTTP 404 Not Found; check the URL's path")
    assert len(server.bodies) == 1


@pytest.mark.parametrize("answer, needle", [
    ({"rewards": [1.0, 0.0]}, "2 rewards for 3 responses"),
    ([1.0, 0.0, 1.0, 1.0], "4 rewards for 3 responses"),
    (b'{"rewards": [1.0, NaN, 0.0]}', "a non-finite reward (nan) for response 1"),
    (b"[1.0, 0.0, Infinity]", "a non-finite reward (inf) for response 2"),
    ({"rewards": [1.0, None, 0.0]}, "no reward (null) for response 1"),
    ({"rewards": [1.0, "high", 0.0]}, 'a reward that is not a number ("high") for response 1'),
    ({"scores": [1.0, 0.0, 0.0]}, 'an answer without "rewards" (keys: scores)'),
    ({"rewards": 1.0}, "rewards that are a float, not a list"),
    (b"<html>Bad Gateway</html>", "malformed JSON (<html>Bad Gateway</html>)"),
    (b"", "malformed JSON (empty)"),
])
def test_a_malformed_answer_is_never_used(answer, needle):
    with PoliteServer(lambda body: (200, answer)) as server:
        fails(quick(server.url, retries=1), "after 2 tries", needle,
              'the server must answer {"rewards": [one finite number per response]}')
    assert len(server.bodies) == 2


@pytest.mark.parametrize("code", [307, 308])
def test_a_307_or_308_redirect_is_followed_with_the_same_post(code):
    with PoliteServer() as target, \
            PoliteServer(lambda body: (code, b"", {"Location": target.url})) as moved:
        assert quick(moved.url, retries=0)(PROMPTS, RESPONSES) == POLITE
    assert len(moved.bodies) == len(target.bodies) == 1 and moved.bodies == target.bodies  # body and all
    assert not target.gets


@pytest.mark.parametrize("code", [301, 302, 303])
def test_a_redirect_that_would_drop_the_batch_is_refused_naming_both_urls(code):
    """urllib follows these with a body-less GET and would use its answer (here three rewards of 1.0)."""
    with PoliteServer() as target, \
            PoliteServer(lambda body: (code, b"", {"Location": target.url})) as moved:
        msg = fails(quick(moved.url), f"failed at its first try: HTTP {code} ",
                    f", a redirect to {target.url}, which would drop the batch (a GET); set ppo.reward to "
                    f"{target.url} (307 / 308 redirects are followed)")
    assert msg.count(moved.url) == 1
    assert len(moved.bodies) == 1 and not target.bodies and not target.gets  # not retried, nothing sent on


def test_a_redirect_loop_stops_after_a_few_hops():
    with PoliteServer(lambda body: (307, b"", {"Location": "/score"})) as loop:
        fails(quick(loop.url), "failed at its first try: more than 5 redirects (the last, HTTP 307, to "
              f"{loop.url}); set ppo.reward to the server's final URL")
    assert len(loop.bodies) == 6


def test_the_timeout_bounds_the_whole_answer_not_each_byte():
    """A server that trickles its answer a byte every 0.1 s never trips a per-read timeout of 1 s."""
    with PoliteServer(trickle_s=0.1) as server:
        start = time.monotonic()
        fails(quick(server.url, timeout_s=1.0, retries=0), "at its first try: no complete answer within 1 s (",
              "bytes by then); make the server answer a batch faster, or raise ppo.reward_timeout_s (now 1)")
        assert 0.9 <= time.monotonic() - start < 2.0
    with PoliteServer(trickle_s=0.002) as server:  # slow bytes, within the time: read whole
        assert quick(server.url, timeout_s=5.0, retries=0)(PROMPTS, RESPONSES) == POLITE


def test_a_reward_beyond_reward_max_abs_stops_at_once():
    with PoliteServer(lambda body: (200, {"rewards": [1.0, -2e300, 0.0]})) as server:
        with pytest.raises(RlhfError) as e:
            quick(server.url)(PROMPTS, RESPONSES)
        assert str(e.value) == (f"ppo.reward server {server.url} answered -2e+300 for response 1, beyond "
                                "ppo.reward_max_abs=10000; rescale its rewards, or raise ppo.reward_max_abs (null: "
                                "no limit)")
        assert len(server.bodies) == 1  # not retried: the server would say the same again
        unbounded = RemoteReward(server.url, timeout_s=5.0, retries=0, max_abs=None)
        assert unbounded(PROMPTS, RESPONSES) == [1.0, -2e300, 0.0]


# ------------------------------------------------------------------------------------ the real `rlhf ppo`
RUN = Path("runs/tiny")
PPO = ["device.threads=1", "ppo.value_init=sft", "ppo.num_mini_batches=1", "ppo.save_every=1", EVAL_ROWS]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A working directory with the tiny recipe's runs/tiny/sft, trained for a few steps."""
    cwd = tmp_path_factory.mktemp("server")
    proc = rlhf(cwd, "sft", "device.threads=1", "sft.max_steps=4", "sft.eval_steps=4", "data.max_rows=64", EVAL_ROWS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


@pytest.mark.slow
def test_ppo_trains_against_a_reward_server(sft):
    with PoliteServer() as server:
        proc = rlhf(sft, "ppo", *PPO, f"ppo.reward=[{server.url}]", "ppo.total_episodes=64",
                    "ppo.output_dir=runs/tiny/ppo-ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(server.bodies) == 2  # one POST per update: 64 episodes, 32 per update
    assert all(len(b["responses"]) == len(b["prompts"]) == len(b["query"]) == 32 for b in server.bodies)
    assert all(r.keys() == {"prompts", "responses", "query", "labels", "rows", "prompt_ids", "response_ids",
                            "truncated"} for r in server.bodies)
    name = server.url.removeprefix("http://").replace(".", "_").replace(":", "_").replace("/", "_")
    metrics = json.loads((sft / RUN / "ppo-ok" / "metrics.json").read_text())
    assert f"reward/http_{name}" in metrics and metrics["reward"] == [server.url], sorted(metrics)


@pytest.mark.slow
def test_a_server_that_goes_away_mid_run_stops_it_with_one_line(sft):
    before = tree(sft / RUN / "sft")
    with PoliteServer(stop_after=1) as server:
        proc = rlhf(sft, "ppo", *PPO, f"ppo.reward=[{server.url}]", "ppo.total_episodes=96",
                    "ppo.reward_retries=1", "ppo.reward_timeout_s=5", "ppo.output_dir=runs/tiny/ppo-gone")
    line = one_error_line(proc, "ppo")
    assert f"ppo.reward server {server.url} failed after 2 tries in" in line, line
    assert "connection refused" in line or "no answer within 5 s" in line, line
    assert len(server.bodies) == 1
    assert tree(sft / RUN / "sft") == before  # the SFT output byte-identical
    assert not (sft / RUN / "ppo-gone").exists()  # nothing published; the partial run stays for ppo.resume=true
    assert (sft / RUN / ".ppo-gone.partial" / "checkpoints" / "checkpoint-1").is_dir()

