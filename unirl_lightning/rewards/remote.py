"""Remote reward: completions scored by an HTTP service (a judge model behind an API, a team's verifier).

Contract: :class:`RemoteReward` is a batch reward called through ``score_batch`` in the rollout
worker. It splits the batch into requests of ``batch_size`` samples, POSTs them with ``httpx``
(at most ``max_in_flight`` at once), and returns one score per completion, in order. Each request
has a ``timeout_s`` deadline and is retried up to ``max_retries`` times, with exponential backoff
(``backoff_s * 2**attempt``, at most ``max_backoff_s``), when the connection fails or drops, the
answer is late, the status is 5xx / 408 / 425 / 429, or the body is not the JSON below.

**A sample whose score never arrives fails the batch**: once a request's retries are spent, the
reward raises :class:`~unirl_lightning.rewards.RewardError` naming the URL, the last failure (the
status and the start of the body, the timeout, or the connection error), the attempts and the
number of samples left without a score; the worker's request fails with it and the run stops.
Nothing is made up for a missing score, and no group is trained with a hole in it. A 4xx status
other than 408 / 425 / 429 (the request itself is wrong) fails at once, without retries.

Wire format (UTF-8 JSON, ``Content-Type: application/json``)::

    POST <url>
    {"completions": ["...", ...],              # this request's samples, in order
     "records": [{"prompt": "...", "answer": ..., ...}, ...]}   # their prompt records (send_records);
                                               # values JSON cannot encode are sent as str(value)
    -> 200 {"scores": [0.5, null, ...]}        # one per completion, same order: a finite number,
                                               # or null for "no opinion" (as a TRL reward's None:
                                               # left out of a CombinedReward, 0 alone)

Any other key in the answer is ignored. ``headers`` (e.g. ``Authorization``) go with every request.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from unirl_lightning.rewards.base import Reward, RewardError
from unirl_lightning.rewards.callable import run_coroutine

__all__ = ["RETRIED_STATUSES", "RemoteReward"]

RETRIED_STATUSES = frozenset({408, 425, 429})
"""Client-error statuses that are retried (with every 5xx): timeouts and rate limits."""


class _Malformed(ValueError):
    """The answer is not ``{"scores": [one number or null per completion]}``."""


class RemoteReward(Reward):
    """Scores from an HTTP service, posted in concurrent batches with timeouts and retries.

    See the module docstring for the wire format and what happens when a score never arrives.

    Args:
        url: The service's endpoint (``http://`` or ``https://``); every batch is POSTed to it.
        batch_size: Samples per request.
        max_in_flight: Requests in flight at once (per reward call in a worker).
        timeout_s: Deadline of one request (connect, send, wait, read).
        max_retries: Retries of a failed request (0 = one attempt only).
        backoff_s: Wait before the first retry; doubled before each next one.
        max_backoff_s: Longest wait between two attempts.
        headers: HTTP headers sent with every request (e.g. ``{"Authorization": "Bearer ..."}``).
        send_records: Send the prompt records with the completions (False: completions only,
            ``"records"`` is then absent).
        name: Name in logs (``rollout/reward/<name>_mean``) and errors.

    Example::

        # YAML
        # reward:
        #   class_path: unirl_lightning.rewards.RemoteReward
        #   init_args: {url: "http://judge:8000/score", batch_size: 16, max_in_flight: 4, timeout_s: 60}
        reward = RemoteReward("http://127.0.0.1:8000/score")
        reward(["4", "five"], [{"prompt": "2+2=", "answer": "4"}] * 2)  # -> e.g. [1.0, 0.0]
    """

    allows_none = True  # the service's null: "no opinion"

    def __init__(
        self,
        url: str,
        batch_size: int = 32,
        max_in_flight: int = 4,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        headers: dict[str, str] | None = None,
        send_records: bool = True,
        name: str = "remote",
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteReward url={url!r} is invalid; expected an http:// or https:// URL.")
        for key, value, least in (("batch_size", batch_size, 1), ("max_in_flight", max_in_flight, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"RemoteReward {key}={value!r} is invalid; expected an int >= {least}.")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"RemoteReward max_retries={max_retries!r} is invalid; expected an int >= 0.")
        for key, value in (
            ("timeout_s", timeout_s),
            ("backoff_s", backoff_s),
            ("max_backoff_s", max_backoff_s),
        ):
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not value >= 0
                or math.isinf(value)
            ):
                raise ValueError(f"RemoteReward {key}={value!r} is invalid; expected a finite number >= 0.")
        if timeout_s == 0:
            raise ValueError("RemoteReward timeout_s=0 is invalid; expected a number > 0.")
        try:
            import httpx  # noqa: F401  (fail at construction, not on the first batch)
        except ImportError as err:
            raise ImportError("RemoteReward needs the 'httpx' package: pip install 'httpx>=0.27'.") from err
        self.url = url
        self.batch_size = batch_size
        self.max_in_flight = max_in_flight
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.headers = dict(headers or {})
        self.send_records = send_records
        self.name = name

    def __repr__(self) -> str:
        return f"RemoteReward(url={self.url!r}, name={self.name!r})"

    def __call__(self, completions: list[str], records: list[dict]) -> list[float | None]:
        if not completions:
            return []
        return run_coroutine(self._score_all(list(completions), list(records)))

    def score(self, completion: str, record: dict) -> float | None:
        return self([completion], [record])[0]

    async def _score_all(self, completions: list[str], records: list[dict]) -> list[float | None]:
        import httpx

        starts = range(0, len(completions), self.batch_size)
        in_flight = asyncio.Semaphore(self.max_in_flight)
        limits = httpx.Limits(
            max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight
        )
        headers = {"Content-Type": "application/json", **self.headers}
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=headers) as client:
            tasks = [
                self._post(
                    client, in_flight, completions[s : s + self.batch_size], records[s : s + self.batch_size]
                )
                for s in starts
            ]
            results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            missing = sum(
                len(completions[s : s + self.batch_size]) for s, r in zip(starts, results) if r in failed
            )
            first = failed[0]
            if isinstance(first, RewardError):
                raise RewardError(f"{first} {missing} of {len(completions)} samples got no score.") from first
            raise first
        return [score for batch in results for score in batch]  # type: ignore[union-attr]

    async def _post(
        self, client: Any, in_flight: asyncio.Semaphore, completions: list[str], records: list[dict]
    ):
        import httpx

        payload: dict[str, Any] = {"completions": completions}
        if self.send_records:
            payload["records"] = records
        body = json.dumps(payload, default=str).encode()
        attempts = self.max_retries + 1
        last = "no attempt"
        async with in_flight:
            for attempt in range(attempts):
                if attempt:
                    await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
                try:
                    response = await client.post(self.url, content=body)
                except httpx.TimeoutException:
                    last = f"no answer within timeout_s={self.timeout_s:g}"
                    continue
                except httpx.TransportError as err:  # refused, reset, dropped before the answer
                    last = f"{type(err).__name__}: {err}"
                    continue
                status = response.status_code
                text = response.text
                if status != 200:
                    last = f"status {status}: {text[:200]!r}"
                    if 400 <= status < 500 and status not in RETRIED_STATUSES:
                        raise RewardError(
                            f"RemoteReward {self.name!r}: POST {self.url} answered {last}; a client error, "
                            "not retried (check the url, headers and wire format)."
                        )
                    continue
                try:
                    return _scores(text, len(completions))
                except _Malformed as err:
                    last = f"status 200 with a malformed body ({err})"
        raise RewardError(
            f"RemoteReward {self.name!r}: POST {self.url} failed {attempts} time(s) (max_retries="
            f"{self.max_retries}); the last: {last}. A sample whose score never arrives fails the batch."
        )


def _scores(text: str, expected: int) -> list[float | None]:
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise _Malformed(f"not JSON: {err.msg} in {text[:200]!r}") from None
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list):
        raise _Malformed(f'no "scores" list in {text[:200]!r}')
    if len(scores) != expected:
        raise _Malformed(f"{len(scores)} scores for {expected} completions")
    checked: list[float | None] = []
    for index, value in enumerate(scores):
        if value is None:
            checked.append(None)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            checked.append(float(value))
        else:
            raise _Malformed(f"score {value!r} at index {index} is not a finite number or null")
    return checked
