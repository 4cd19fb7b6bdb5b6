"""Shared fixtures: a real redis-server on a free port that a test can stop
and restart."""
from __future__ import annotations

import os

import pytest
from hypothesis import settings

from helpers.common import REPO, RedisServer, free_port  # noqa: F401  (re-exported)

# CI replays the same examples every run (a red CI always means a change
# broke something); local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


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
