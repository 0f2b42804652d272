"""The one fake pending generation every test that drives a controller uses (no Ray)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class FakeGenerationHandle:
    """A pending generation the test controls.

    ``ready()`` is true once the test sets ``is_ready`` (or ``wait()`` ran), or after ``delay``
    polls when a delay is given (slow generation). ``result()`` returns ``value``, calls
    ``on_result`` first when given, and raises ``failure`` while ``failures_left`` is positive
    (a retryable failure). ``result_calls`` / ``wait_calls`` count the calls.
    """

    def __init__(
        self,
        value: Any,
        ready: bool = False,
        delay: int | None = None,
        on_result: Callable[[], None] | None = None,
    ) -> None:
        self.value = value
        self.is_ready = ready
        self.delay = delay
        self.on_result = on_result
        self.failures_left = 0
        self.failure: BaseException = RuntimeError("generation failed")
        self.result_calls = 0
        self.wait_calls = 0

    def ready(self) -> bool:
        if self.delay is not None and not self.is_ready:
            self.delay -= 1
            self.is_ready = self.delay < 0
        return self.is_ready

    def wait(self) -> None:
        self.wait_calls += 1
        self.is_ready = True

    def result(self) -> Any:
        self.result_calls += 1
        if self.on_result is not None:
            self.on_result()
        if self.failures_left:
            self.failures_left -= 1
            raise self.failure
        return self.value
