"""One way to open an asyncio Redis client that fails fast, and one exception
for "Redis is not there".

Every caller in the serving path (replica registry, prewarm entries) must get
an error it can catch within about `timeout_s` when Redis dies, never a hang:
so socket and connect timeouts are always set and retries are few and short.
"""
from __future__ import annotations

import contextlib
from typing import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

# Keys of every kvpop module start with this; the version lets a later layout
# live beside this one during a rolling upgrade.
KEY_PREFIX = "kvpop:v1:"


class RedisUnavailable(ConnectionError):
    """Redis could not be reached or answered with an error (the cause is chained)."""


def connect(url: str, timeout_s: float = 1.0) -> aioredis.Redis:
    """An asyncio client for `url` (redis://host:port/db) with bounded waits.

    Nothing is sent until the first command, so this never blocks."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        # Two quick retries ride over a Redis restart; more would only delay
        # the error the caller needs to see.
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
        decode_responses=True,
        health_check_interval=5,
    )


@contextlib.asynccontextmanager
async def unavailable_as(what: str) -> AsyncIterator[None]:
    """Turn any Redis or socket failure inside the block into RedisUnavailable."""
    try:
        yield
    except (RedisError, OSError) as e:
        raise RedisUnavailable(f"{what}: redis unavailable ({type(e).__name__}: {e})") from e
