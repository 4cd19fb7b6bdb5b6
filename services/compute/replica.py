"""This compute process as a replica in Redis: registry heartbeats (so the
gateway can route to it) and the prewarm entries it prefills at start.

Without `KVPOP_REDIS_URL` neither happens and the gateway reaches compute at
its static `KVPOP_COMPUTE_ADDRESS`. A Redis outage is logged, never fatal: the
heartbeat retries each period, prewarm is skipped.
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping

from kvpop.runtime.prewarm import PrewarmCounter, PrewarmEntry
from kvpop.runtime.redis_client import RedisUnavailable, connect
from kvpop.runtime.replica_registry import Heartbeat, Replica, ReplicaRegistry

log = logging.getLogger(__name__)


class ReplicaReporter:
    def __init__(self, redis_url: str, replica_id: str, address: str, capacity: int,
                 model: str, stats: Callable[[], Mapping], heartbeat_s: float = 3.0):
        """stats: returns the engine's latest stats (no engine lock), e.g. the
        metrics refresher's `last`; its running + waiting is the load."""
        self.client = connect(redis_url)
        self.registry = ReplicaRegistry(self.client, interval_s=heartbeat_s)
        self.replica = Replica(id=replica_id, address=address, capacity=capacity, model=model)
        self.stats = stats
        self.heartbeat: Heartbeat | None = None

    def _load(self) -> int:
        s = self.stats() or {}
        return int(s.get("running", 0)) + int(s.get("waiting", 0))

    async def start(self) -> None:
        """First beat now (so a failure is logged at start), then in the background."""
        self.heartbeat = Heartbeat(self.registry, self.replica, load=self._load)
        try:
            await self.heartbeat.beat()
            log.info("replica %s registered as %s", self.replica.id, self.replica.address)
        except RedisUnavailable as e:
            log.warning("replica %s not registered yet: %s", self.replica.id, e)
        self.heartbeat.start()

    async def prewarm_entries(self, k: int) -> list[PrewarmEntry]:
        if k <= 0:
            return []
        try:
            return await PrewarmCounter(self.client).top_entries(k)
        except RedisUnavailable as e:
            log.warning("no prewarm: %s", e)
            return []

    async def leave(self) -> None:
        """Leave the registry at once (draining starts): the gateway stops
        sending new requests here while in-flight streams finish."""
        if self.heartbeat is not None:
            await self.heartbeat.stop(deregister=True)
            self.heartbeat = None

    async def stop(self) -> None:
        await self.leave()
        await self.client.aclose()
