"""Requests and generated tokens per minute, per API key (sliding 60 s windows).

A key at its requests-per-minute limit, or whose tokens generated in the last
minute reached its tokens-per-minute limit, is refused RESOURCE_EXHAUSTED
until enough of the window has passed; the message names the limit and says
in how many seconds to retry (also sent as `retry-after` trailing metadata).
Tokens are counted as they stream, so a burst of long generations is seen
while it runs, and a stream that started under the limit finishes.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

import grpc

from services.gateway.validation import Invalid

WINDOW_S = 60.0
RETRY_AFTER = "retry-after"


def _seconds(wait: float) -> int:
    return max(1, math.ceil(wait))


class RateExceeded(Invalid):
    def __init__(self, message: str, retry_after_s: float, limit: str):
        super().__init__(message, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.limit = limit
        self.retry_after_s = _seconds(retry_after_s)


class Window:
    """(time, amount) events of the last WINDOW_S seconds."""

    def __init__(self):
        self.events: deque[tuple[float, int]] = deque()
        self.total = 0

    def expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - WINDOW_S:
            self.total -= self.events.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        self.events.append((now, amount))
        self.total += amount

    def wait_until_below(self, limit: int, now: float) -> float:
        """Seconds until the total falls below `limit` (events expiring oldest first)."""
        total = self.total
        for t, amount in self.events:
            total -= amount
            if total < limit:
                return t + WINDOW_S - now
        return 0.0


def _check(window: Window, limit: int, now: float, what: str, unit: str, which: str) -> None:
    """RateExceeded when ``window`` holds ``limit`` or more in the last minute (0 = no limit)."""
    if limit and window.total >= limit:
        wait = window.wait_until_below(limit, now)
        raise RateExceeded(f"{what.format(total=window.total)} in the last minute; its limit is {limit} {unit} "
                           f"per minute: retry in {_seconds(wait)} s", wait, which)


class KeyRates:
    """Windows per key name; limits are passed at each call (they may be reloaded)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.requests: dict[str, Window] = {}
        self.tokens: dict[str, Window] = {}

    def _window(self, table: dict[str, Window], name: str, now: float) -> Window:
        w = table.setdefault(name, Window())
        w.expire(now)
        return w

    def admit(self, name: str, requests_per_minute: int, tokens_per_minute: int) -> None:
        """Count one request, or raise RateExceeded (0 = no limit)."""
        now = self.clock()
        _check(self._window(self.tokens, name, now), tokens_per_minute, now,
               f"API key {name!r} generated {{total}} tokens", "tokens", "tokens_per_minute")
        requests = self._window(self.requests, name, now)
        _check(requests, requests_per_minute, now, f"API key {name!r} made {{total}} requests", "requests",
               "requests_per_minute")
        requests.add(now, 1)

    def generated(self, name: str, n: int) -> None:
        if n > 0:
            now = self.clock()
            self._window(self.tokens, name, now).add(now, n)
