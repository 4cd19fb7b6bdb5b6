"""One way to open an asyncio Redis client that fails fast, and one exception
for "Redis is not there".

Every caller in the serving path (replica registry, prewarm entries) must get
an error it can catch within about `timeout_s` when Redis dies, never a hang:
so socket and connect timeouts are always set and retries are few and short.
"""
from __future__ import annotations

import asyncio
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


def deadline_s(client: aioredis.Redis, default: float = 10.0) -> float:
    """An upper bound on one call through `client` when every try times out.

    A backstop for `unavailable_as(timeout_s=...)`, not the normal failure path:
    a refused or timed-out socket already fails the call well within it."""
    kw = client.connection_pool.connection_kwargs
    read = kw.get("socket_timeout")
    conn = kw.get("socket_connect_timeout") or read
    if not read or not conn:
        return default
    tries = 1 + max(0, client.get_retry().get_retries())
    # Per try: connect, one handshake reply, one command reply.
    return tries * (conn + 2 * read) + 0.5


@contextlib.asynccontextmanager
async def unavailable_as(what: str, timeout_s: float | None = None) -> AsyncIterator[None]:
    """Turn any Redis or socket failure inside the block into RedisUnavailable;
    with `timeout_s`, also a block still running after `timeout_s` seconds.

    A cancel sent to the task while it was inside the block always propagates
    as CancelledError, even where redis-py lost it (see below)."""
    task = asyncio.current_task()
    cancels_before = task.cancelling() if task is not None else 0
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            yield
            # redis-py writes every command under asyncio.wait_for(...,
            # socket_timeout), and on Python 3.11 wait_for drops a cancel that
            # lands in the loop iteration where the write finishes (CPython
            # gh-86296): the command returns normally and the cancelled task
            # runs on. Heartbeat.stop() waited forever on such a task after a
            # Redis restart, when the heartbeat was cancelled mid-reconnect.
            if task is not None and task.cancelling() > cancels_before:
                raise asyncio.CancelledError
    except (RedisError, OSError) as e:
        if deadline.expired():
            raise RedisUnavailable(
                f"{what}: redis unavailable (no answer within {timeout_s} s)") from e
        raise RedisUnavailable(f"{what}: redis unavailable ({type(e).__name__}: {e})") from e
