"""Sessions belong to the API key that started them.

With API keys on, a session id is the caller's own: the gateway stores and
continues `<key name>~<session id>` (`scoped`), in Redis
(`kvpop:v1:session:alice~s1`, its turns likewise) and on compute (the parked
KV), so nothing one key does can read or continue another key's session,
whatever else fails. `~` is not allowed in a client's session id: no client
can name a scoped id.

On top of that a session id is claimed by the first key that uses it
(`kvpop:v1:session-owner:<id>`, living as long as the session), and another
key that names it gets NOT_FOUND rather than a fresh session of the same
name that its owner would mistake for theirs. While Redis is unreachable
the claims this gateway saw are checked from memory.

Without API keys sessions belong to no one: whoever names a session id
continues it (docs/reference/api.md says so).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

from kvpop.runtime.redis_client import KEY_PREFIX, RedisUnavailable, unavailable_as

log = logging.getLogger(__name__)

SEPARATOR = "~"
MAX_REMEMBERED = 100_000


def scoped(owner: str | None, session_id: str) -> str:
    return f"{owner}{SEPARATOR}{session_id}" if owner else session_id


def claim_key(session_id: str) -> str:
    return f"{KEY_PREFIX}session-owner:{session_id}"


class SessionOwners:
    def __init__(self, redis, ttl_s: int):
        self.redis, self.ttl_s = redis, ttl_s
        self._seen: OrderedDict[str, str] = OrderedDict()

    def _remember(self, session_id: str, owner: str) -> None:
        self._seen[session_id] = owner
        self._seen.move_to_end(session_id)
        if len(self._seen) > MAX_REMEMBERED:
            self._seen.popitem(last=False)

    async def claim(self, session_id: str, owner: str) -> bool:
        """True when `owner` may use `session_id` (new, or already its own)."""
        if self.redis is not None:
            try:
                holder = await self._claim_in_redis(session_id, owner)
            except RedisUnavailable as e:
                log.warning("session owner of %s checked from memory: %s", session_id, e)
            else:
                self._remember(session_id, holder)
                return holder == owner
        holder = self._seen.get(session_id, owner)
        self._remember(session_id, holder)
        return holder == owner

    async def _claim_in_redis(self, session_id: str, owner: str) -> str:
        key = claim_key(session_id)
        async with unavailable_as("claiming a session id"):
            for _ in range(2):      # the second time only if the claim expired between SET and GET
                if await self.redis.set(key, owner, nx=True, ex=self.ttl_s):
                    return owner
                holder = await self.redis.get(key)
                if holder is not None:
                    if holder == owner:
                        await self.redis.expire(key, self.ttl_s)
                    return holder
        return owner
