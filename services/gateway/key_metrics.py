"""Per-API-key counters of the gateway, labelled by the key's name (never the key).

| metric | labels |
| --- | --- |
| `kvpop_api_key_requests_total` | `key`: Generate calls admitted |
| `kvpop_api_key_refusals_total` | `key`, `limit`: `streams`, `requests_per_minute`, `tokens_per_minute`, `max_tokens`, `session_not_found` |
| `kvpop_api_key_generation_tokens_total` | `key`: tokens streamed back |

Names come from the key list only (an unknown key is refused before it gets
here), and at most MAX_NAMES distinct names get their own series: later ones
share `key="other"`, so a key list that grows does not grow the scrape without bound.
"""
from __future__ import annotations

from prometheus_client import Counter

from kvpop.runtime.metrics import get_metrics

MAX_NAMES = 100
OTHER = "other"


class KeyMetrics:
    def __init__(self):
        r = get_metrics().registry
        self.requests = Counter("kvpop_api_key_requests_total", "Generate calls admitted, per API key name",
                                ["key"], registry=r)
        self.refusals = Counter("kvpop_api_key_refusals_total", "Generate calls refused by a per-key limit",
                                ["key", "limit"], registry=r)
        self.tokens = Counter("kvpop_api_key_generation_tokens_total", "tokens generated, per API key name",
                              ["key"], registry=r)
        self._names: set[str] = set()

    def label(self, name: str) -> str:
        if name in self._names:
            return name
        if len(self._names) < MAX_NAMES:
            self._names.add(name)
            return name
        return OTHER

    def admitted(self, name: str) -> None:
        self.requests.labels(key=self.label(name)).inc()

    def refused(self, name: str, limit: str) -> None:
        self.refusals.labels(key=self.label(name), limit=limit).inc()

    def generated(self, name: str, n: int) -> None:
        self.tokens.labels(key=self.label(name)).inc(n)


_instance: KeyMetrics | None = None


def key_metrics() -> KeyMetrics:
    """The process's one set (a registry takes each metric name once)."""
    global _instance
    if _instance is None:
        _instance = KeyMetrics()
    return _instance
