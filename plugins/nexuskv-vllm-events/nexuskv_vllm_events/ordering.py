"""Where a batch stands in one publisher's sequence: the next one, past a gap, a duplicate, or a restart.

vLLM numbers every batch it publishes from 0 (`ZmqEventPublisher`), so a subscriber sees a gap when a number is
skipped (the PUB socket dropped batches at its high-water mark, or the subscriber connected late), and a restart
when the numbers go back (the engine restarted: its cache is empty). A batch the subscriber fetched through the
replay endpoint can arrive again live; it is a duplicate only when its bytes are the ones replayed (a restarted
engine reusing the number publishes other bytes, with another timestamp).
"""

from __future__ import annotations

import hashlib
from enum import StrEnum

__all__ = ["Ordering", "Position"]

MAX_REPLAYED = 1 << 17  # replayed batches remembered as possible duplicates (vLLM keeps 10,000 by default)


class Position(StrEnum):
    NEXT = "next"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class Ordering:
    """One publisher's sequence as seen so far (used from one thread: the subscriber's)."""

    def __init__(self) -> None:
        self.next: int | None = None  # the number expected next; None before the first batch
        self.last: tuple[int, bytes] | None = None  # the last batch applied: its number and digest
        self._replayed: dict[int, bytes] = {}

    def classify(self, seq: int, payload: bytes) -> Position:
        """Where a live batch `seq` stands."""
        if self.next is None or seq == self.next:
            return Position.NEXT
        if seq > self.next:
            return Position.GAP
        if self._replayed.get(seq) == _digest(payload):
            return Position.DUPLICATE
        return Position.RESTART

    def continues(self, seq: int, payload: bytes) -> bool:
        """True when batch `seq` with these bytes is the last one applied: the publisher's numbering goes on."""
        return self.last == (seq, _digest(payload))

    def applied(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        """Batch `seq` was applied; a replayed one is remembered so that its live copy is known as a duplicate."""
        self.next = seq + 1
        digest = _digest(payload)
        self.last = (seq, digest)
        if replayed:
            self._replayed[seq] = digest
            while len(self._replayed) > MAX_REPLAYED:
                del self._replayed[next(iter(self._replayed))]
        elif self._replayed:  # live batches arrive in order: nothing before this one comes again
            self._replayed = {s: d for s, d in self._replayed.items() if s > seq}

    def reset(self) -> None:
        """Start over (after a restart, or a gap nothing could fill)."""
        self.next = None
        self.last = None
        self._replayed.clear()
