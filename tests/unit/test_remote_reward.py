"""RemoteReward against a real HTTP server on 127.0.0.1 (stdlib ``http.server`` in a thread): order
across concurrent batches, the in-flight bound, and the faults (slow answers, 500s, a dropped
connection, malformed JSON, a client error), each read off the server's request log."""

from __future__ import annotations

import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from unirl_lightning.rewards import CombinedReward, ExactMatchReward, RemoteReward, RewardError, score_parts


class ScoringServer:
    """Scores each completion by its length. The path picks a fault for the first ``k`` requests:
    ``/ok``, ``/slow/k``, ``/error500/k``, ``/drop/k``, ``/malformed/k``, ``/badrequest``, ``/nulls``.
    ``log`` holds one entry per request: path, samples, what the server did, when, how many in flight."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.log: list[dict] = []
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.in_flight = 0
        self.peak = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                parts = self.path.strip("/").split("/")
                fault, first_k = parts[0], int(parts[1]) if len(parts) > 1 else 0
                with server.lock:
                    seen = server.counts[self.path] = server.counts.get(self.path, 0) + 1
                    server.in_flight += 1
                    server.peak = max(server.peak, server.in_flight)
                    entry = {"t": time.monotonic(), "path": self.path, "samples": len(body["completions"])}
                    entry["in_flight"] = server.in_flight
                    server.log.append(entry)
                try:
                    time.sleep(delay_s)
                    faulty = fault == "badrequest" or seen <= first_k
                    if faulty and fault == "slow":
                        entry["answer"] = "slept 2 s, then 200"
                        time.sleep(2.0)
                    elif faulty and fault == "error500":
                        entry["answer"] = "500"
                        return self._send(500, b"internal error")
                    elif faulty and fault == "drop":
                        entry["answer"] = "closed the connection, no answer"
                        self.close_connection = True
                        return None
                    elif faulty and fault == "malformed":
                        entry["answer"] = "200, malformed JSON"
                        return self._send(200, b'{"scores": [1.0, ')
                    elif fault == "badrequest":
                        entry["answer"] = "400"
                        return self._send(400, b"missing field")
                    scores = [float(len(c)) for c in body["completions"]]
                    if fault == "nulls":
                        scores = [None if c == "?" else s for c, s in zip(body["completions"], scores)]
                    entry.setdefault("answer", "200")
                    assert body.get("records") is None or len(body["records"]) == len(scores)
                    self._send(200, json.dumps({"scores": scores}).encode())
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _send(self, status, payload):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except BrokenPipeError:  # the client gave up waiting (the slow answer)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answers(self, path: str) -> list[str]:
        return [entry.get("answer", "?") for entry in self.log if entry["path"] == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    server = ScoringServer()
    yield server
    print("\nrequest log:")  # shown with pytest -s
    start = server.log[0]["t"] if server.log else 0.0
    for entry in server.log:
        print(
            f"  +{entry['t'] - start:6.3f} s  POST {entry['path']:<14} {entry['samples']} samples -> {entry.get('answer')}"
        )
    server.close()


COMPLETIONS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g"]
RECORDS = [{"prompt": f"p{i}", "answer": "x", "object": object()} for i in range(7)]  # not JSON: sent as str


def test_scores_come_back_in_order_across_concurrent_batches(server):
    reward = RemoteReward(server.base + "/ok", batch_size=2, max_in_flight=4)
    assert reward(COMPLETIONS, RECORDS) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0]
    assert sorted(entry["samples"] for entry in server.log) == [1, 2, 2, 2]


def test_no_more_requests_are_in_flight_than_max_in_flight():
    server = ScoringServer(delay_s=0.3)
    try:
        reward = RemoteReward(server.base + "/ok", batch_size=1, max_in_flight=2)
        assert reward(COMPLETIONS, RECORDS) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0]
        assert len(server.log) == 7 and server.peak == 2
    finally:
        server.close()


def test_a_slow_answer_times_out_and_the_retry_scores(server):
    reward = RemoteReward(server.base + "/slow/1", batch_size=8, timeout_s=0.5, backoff_s=0.1)
    assert reward(COMPLETIONS[:3], RECORDS[:3]) == [1.0, 2.0, 3.0]
    assert server.answers("/slow/1") == ["slept 2 s, then 200", "200"]


def test_500s_are_retried_with_growing_backoff(server):
    reward = RemoteReward(server.base + "/error500/2", batch_size=8, backoff_s=0.2, max_retries=3)
    assert reward(COMPLETIONS[:2], RECORDS[:2]) == [1.0, 2.0]
    assert server.answers("/error500/2") == ["500", "500", "200"]
    times = [entry["t"] for entry in server.log]
    assert times[1] - times[0] >= 0.2 and times[2] - times[1] >= 0.4  # backoff_s, then twice it


def test_a_dropped_connection_is_retried(server):
    reward = RemoteReward(server.base + "/drop/1", backoff_s=0.05)
    assert reward(COMPLETIONS[:2], RECORDS[:2]) == [1.0, 2.0]
    assert server.answers("/drop/1") == ["closed the connection, no answer", "200"]


def test_malformed_json_is_retried(server):
    reward = RemoteReward(server.base + "/malformed/1", backoff_s=0.05)
    assert reward(COMPLETIONS[:2], RECORDS[:2]) == [1.0, 2.0]
    assert server.answers("/malformed/1") == ["200, malformed JSON", "200"]


def test_when_retries_are_spent_the_batch_fails_naming_the_url_the_status_and_the_missing_scores(server):
    url = server.base + "/error500/99"
    reward = RemoteReward(url, batch_size=4, max_retries=2, backoff_s=0.05, name="judge")
    with pytest.raises(RewardError) as info:
        score_parts(reward, COMPLETIONS, RECORDS)
    message = str(info.value)
    assert f"POST {url} failed 3 time(s) (max_retries=2)" in message
    assert "the last: status 500: 'internal error'" in message
    assert "7 of 7 samples got no score" in message and "'judge'" in message
    assert server.answers("/error500/99") == ["500"] * 6  # two batches, three attempts each


def test_a_malformed_answer_that_persists_fails_naming_it(server):
    url = server.base + "/malformed/99"
    with pytest.raises(
        RewardError, match=r"status 200 with a malformed body \(not JSON: .*in '\{\"scores\": \[1.0, '\)"
    ):
        RemoteReward(url, max_retries=1, backoff_s=0.01)(COMPLETIONS[:2], RECORDS[:2])


def test_a_client_error_fails_at_once_without_retries(server):
    with pytest.raises(
        RewardError, match=r"answered status 400: 'missing field'; a client error, not retried"
    ):
        RemoteReward(server.base + "/badrequest", max_retries=3)(COMPLETIONS[:2], RECORDS[:2])
    assert server.answers("/badrequest") == ["400"]


def test_nobody_listening_fails_naming_the_connection_error():
    with pytest.raises(RewardError, match=r"POST http://127.0.0.1:9/score failed 2 time\(s\).*ConnectError"):
        RemoteReward("http://127.0.0.1:9/score", max_retries=1, backoff_s=0.01)(["a"], [{}])


def test_null_is_no_opinion_left_out_of_a_combined_reward(server):
    combined = CombinedReward([RemoteReward(server.base + "/nulls", name="judge"), ExactMatchReward()])
    totals, parts = score_parts(combined, ["x", "?"], [{"answer": "x"}, {"answer": "x"}])
    assert parts == {"judge": [1.0, None], "exact_match": [1.0, 0.0]} and totals == [2.0, 0.0]


def test_it_pickles_and_rejects_bad_settings_naming_them():
    reward = pickle.loads(pickle.dumps(RemoteReward("http://h/score", headers={"Authorization": "Bearer t"})))
    assert reward.url == "http://h/score" and reward.headers == {"Authorization": "Bearer t"}
    with pytest.raises(ValueError, match="url='h:80' is invalid; expected an http:// or https:// URL"):
        RemoteReward("h:80")
    with pytest.raises(ValueError, match="max_in_flight=0 is invalid; expected an int >= 1"):
        RemoteReward("http://h", max_in_flight=0)
    with pytest.raises(ValueError, match="max_retries=-1 is invalid"):
        RemoteReward("http://h", max_retries=-1)
    with pytest.raises(ValueError, match="timeout_s=0 is invalid"):
        RemoteReward("http://h", timeout_s=0)
