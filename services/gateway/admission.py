"""Whether a validated Generate call may start, and under whose allowance.

One place for the limits a caller is held to: the largest max_tokens, open
streams, requests and generated tokens per minute. With API keys each key has
its own (its line in the key list, else the gateway's KVPOP_* defaults);
without them the stream limit applies per client (limits.py). A refusal is
RESOURCE_EXHAUSTED naming the limit, and for the per-minute ones when to retry.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvpop.runtime.config import GatewayConfig
from kvpop.runtime.pb import compute_pb2
from services.gateway.apikeys import ApiKey
from services.gateway.key_metrics import key_metrics
from services.gateway.limits import StreamLimiter, client_key
from services.gateway.rates import KeyRates, RateExceeded
from services.gateway.validation import Invalid


@dataclass(frozen=True)
class Admitted:
    client: str             # what the stream limit counts
    key: str | None         # the API key's name (None: no keys)


class Refused(Invalid):
    def __init__(self, error: Invalid, limit: str):
        super().__init__(error.message, error.code)
        self.limit = limit
        self.retry_after_s = getattr(error, "retry_after_s", None)


class Admission:
    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.streams = StreamLimiter(cfg.max_streams_per_client)
        self.rates = KeyRates()
        self.metrics = key_metrics()

    def _limit(self, key: ApiKey, name: str, default: int) -> int:
        return key.limits.get(name, default)

    def admit(self, context, key: ApiKey | None, creq: compute_pb2.ComputeRequest,
              max_tokens_set: bool) -> Admitted:
        """Raises Invalid for a bad x-client-id, Refused for a limit."""
        client = client_key(context, key.name if key else None)
        if key is None:
            try:
                self.streams.acquire(client)
            except Invalid as e:
                raise Refused(e, "streams") from None
            return Admitted(client, None)
        try:
            self._admit_key(key, client, creq, max_tokens_set)
        except Refused as e:
            self.metrics.refused(key.name, e.limit)
            raise
        self.metrics.admitted(key.name)
        return Admitted(client, key.name)

    def _admit_key(self, key: ApiKey, client: str, creq, max_tokens_set: bool) -> None:
        largest = self._limit(key, "max_tokens", 0)
        if largest and creq.sampling.max_tokens > largest:
            if max_tokens_set:
                raise Refused(Invalid(f"max_tokens is {creq.sampling.max_tokens}; API key {key.name!r} may ask "
                                      f"for at most {largest} (its max_tokens limit)",
                                      grpc.StatusCode.RESOURCE_EXHAUSTED), "max_tokens")
            creq.sampling.max_tokens = largest     # the gateway's default, capped to what the key may ask
        try:
            self.streams.acquire(client, self._limit(key, "streams", self.cfg.max_streams_per_client))
        except Invalid as e:
            raise Refused(e, "streams") from None
        try:
            self.rates.admit(key.name, self._limit(key, "requests_per_minute", self.cfg.key_requests_per_minute),
                             self._limit(key, "tokens_per_minute", self.cfg.key_tokens_per_minute))
        except RateExceeded as e:
            self.streams.release(client)
            raise Refused(e, e.limit) from None

    def generated(self, admitted: Admitted, n: int) -> None:
        if admitted.key is not None and n:
            self.rates.generated(admitted.key, n)
            self.metrics.generated(admitted.key, n)

    def session_refused(self, admitted: Admitted) -> None:
        if admitted.key is not None:
            self.metrics.refused(admitted.key, "session_not_found")

    def release(self, admitted: Admitted) -> None:
        self.streams.release(admitted.client)
