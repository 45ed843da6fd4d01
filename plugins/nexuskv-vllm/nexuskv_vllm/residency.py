"""Which of the blocks a worker saved its kernel holds now: the source of the worker's stored / removed reports.

A worker commits a block under its own rank's key; the kernel's writer places it a little later (or refuses it),
and a tier may evict it any time after. `Residency` remembers each committed block (own key -> the scheduler's
key) and, once a step, looks a bounded number of them up in the kernel's index: a pending block now held is
reported stored (with where it is held), a stored block no longer held is reported removed, a pending block that
never shows up within `pending_steps` steps was refused and is forgotten. The look-ups are dictionary reads on the
index, at most `budget` a step, so a worker holding a million blocks still pays microseconds per step; an eviction
is therefore reported within (held blocks / budget) steps, and until then a plan that counts on the block fails
its load on this rank and vLLM recomputes it.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

from nexuskv import DictIndex, Location

__all__ = ["Residency"]


class Residency:
    """Committed blocks of one worker and where its kernel holds them; thread-safe."""

    def __init__(self, *, budget: int = 512, pending_steps: int = 256, limit: int = 1 << 20) -> None:
        self.budget = budget
        self.pending_steps = pending_steps
        self.limit = limit
        self._lock = threading.Lock()
        self._pending: OrderedDict[bytes, tuple[bytes, int, int]] = OrderedDict()  # own key -> (theirs, step, groups)
        self._held: OrderedDict[bytes, bytes] = OrderedDict()  # own key -> scheduler key (round robin order)
        self._step = 0

    def committed(self, own: list[bytes], scheduler: list[bytes], groups: int = 1) -> None:
        """The writer took these blocks (own keys, the same blocks' scheduler keys, the group mask of each)."""
        with self._lock:
            for mine, theirs in zip(own, scheduler, strict=True):
                if mine not in self._held:
                    self._pending[mine] = (theirs, self._step, groups)
            while len(self._pending) > self.limit:
                self._pending.popitem(last=False)

    def sweep(self, index: DictIndex) -> tuple[dict[bytes, tuple[Location, int]], set[bytes]]:
        """One step's look-ups: (scheduler key -> (where held, groups held), newly held; scheduler keys gone).

        A block is held once every group committed for it is (a hybrid block's groups are placed one by one).
        """
        stored: dict[bytes, tuple[Location, int]] = {}
        removed: set[bytes] = set()
        with self._lock:
            self._step += 1
            budget = self.budget
            for mine in list(itertools.islice(self._pending, budget)):
                theirs, since, groups = self._pending[mine]
                holding = index.get(mine)
                if holding is not None and holding.locations and holding.mask & groups == groups:
                    del self._pending[mine]
                    self._held[mine] = theirs
                    stored[theirs] = (holding.locations[0][0], holding.mask)  # (location, group mask) pairs
                elif self._step - since > self.pending_steps:
                    del self._pending[mine]  # refused by the writer (bounds, policy): never held
                budget -= 1
            for _ in range(min(budget, len(self._held))):
                mine, theirs = self._held.popitem(last=False)
                if index.get(mine) is None:
                    removed.add(theirs)
                else:
                    self._held[mine] = theirs  # to the back of the round
            while len(self._held) > self.limit:
                removed.add(self._held.popitem(last=False)[1])
        return stored, removed

    def lost(self, own: bytes) -> bytes | None:
        """A block this worker failed to load: forget it; its scheduler key, to report removed (None: unknown)."""
        with self._lock:
            self._pending.pop(own, None)
            return self._held.pop(own, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held) + len(self._pending)
