"""Shared fixtures: a real redis-server on a free port that a test can stop
and restart."""
from __future__ import annotations

import pytest

from helpers_common import REPO, RedisServer, free_port  # noqa: F401  (re-exported)


@pytest.fixture
def redis_server():
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def shared_redis():
    server = RedisServer().start()
    yield server
    server.cleanup()
