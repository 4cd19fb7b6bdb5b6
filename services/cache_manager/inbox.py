"""One Advise stream's inbox: its messages read ahead of the plans, and folded
a round at a time into the sequences due a plan.

A round is every message waiting when the servicer is free: a backlog (many
sequences, a slow network) thus costs one plan per sequence per round, never
one per message, so plans do not fall further and further behind the features
they answer.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, NamedTuple

from kvpop.runtime.pb import cache_manager_pb2 as pb

# Most new blocks one network call folds in: decode batches (a page's worth each) of many
# sequences share a call, while a prompt chunk (hundreds of blocks) goes on its own, so the
# plans answered first do not wait for every prompt of the round.
GROUP_BLOCKS = 256


def num_blocks(batch: pb.FeaturesBatch) -> int:
    return len(batch.blocks) + (int(batch.arrays.block.shape[0]) if batch.HasField("arrays") and
                                batch.arrays.block.shape else 0)


class Due(NamedTuple):
    """A sequence due a plan this round."""
    message: pb.AdvisorMessage      # its batch's last message (the plan's trace parent)
    messages: int                   # messages folded since its last plan
    blocks: int                     # new blocks they brought


class Inbox:
    """A task reads the stream into a queue while the servicer plans, so a round
    takes every message that arrived meanwhile (not one per plan it answers)."""

    def __init__(self, messages: AsyncIterator[pb.AdvisorMessage]):
        self.ended = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read(messages))

    async def _read(self, messages: AsyncIterator[pb.AdvisorMessage]) -> None:
        try:
            async for msg in messages:
                self._queue.put_nowait(msg)
        finally:
            self._queue.put_nowait(None)

    async def take(self) -> list[pb.AdvisorMessage]:
        """Every message waiting, after waiting for one; sets ``ended`` once the stream has."""
        msgs = [await self._queue.get()]
        while not self._queue.empty():
            msgs.append(self._queue.get_nowait())
        if msgs[-1] is None:            # the reader's last word: nothing follows it
            self.ended = True
            msgs.pop()
        return msgs

    def close(self) -> None:
        self._reader.cancel()


class Rounds:
    """What one stream's rounds carry from one to the next: the sequences it
    has sent (dropped from the scoring state when the stream ends, as their
    compute process will never finish them here) and the batches whose later
    parts are still to come.

    fold(batch) -> bool: folds a features batch into the scoring state, False
    when it was malformed and skipped. drop(rid): forgets a sequence."""

    def __init__(self, fold: Callable[[pb.FeaturesBatch], bool], drop: Callable[[str], None]):
        self._fold, self._drop = fold, drop
        self.seen: set[str] = set()
        self.parts: dict[str, Due] = {}     # what a batch's earlier parts brought (no plan yet)

    def fold(self, msgs: list[pb.AdvisorMessage]) -> dict[str, Due]:
        """Folds a round's messages; the sequences due a plan, in the order they came."""
        due: dict[str, Due] = {}
        for msg in msgs:
            kind = msg.WhichOneof("kind")
            if kind == "finished":
                rid = msg.finished.request_id
                self._drop(rid)
                self.seen.discard(rid)
                due.pop(rid, None)
                self.parts.pop(rid, None)
                continue
            if kind != "features" or not msg.features.request_id:
                continue
            rid = msg.features.request_id
            if not self._fold(msg.features):
                continue
            self.seen.add(rid)
            _, n, blocks = self.parts.pop(rid, None) or due.pop(rid, None) or (None, 0, 0)
            # A part with more to come is folded, but planned only with its batch's last part.
            (self.parts if msg.features.more else due)[rid] = Due(msg, n + 1, blocks + num_blocks(msg.features))
        return due

    def close(self) -> None:
        for rid in self.seen:
            self._drop(rid)


def groups(due: dict[str, Due]) -> list[list[tuple[str, Due]]]:
    """The round's due sequences, fewest new blocks first (a decoding sequence's plan
    does not wait behind prompt chunks), in groups of at most GROUP_BLOCKS new
    blocks (a larger batch alone)."""
    out, size = [], 0
    for item in sorted(due.items(), key=lambda item: item[1].blocks):
        if not out or size + item[1].blocks > GROUP_BLOCKS:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1].blocks
    return out
