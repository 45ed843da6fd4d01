"""The native keyer: `BlockKeyer` with its hashing primitive in C (the GIL released for long chains)."""

from __future__ import annotations

from collections.abc import Sequence

from nexuskv import CHAIN_PERSON, BlockKeyer
from nexuskv_native import _native

__all__ = ["NativeKeyer"]


class NativeKeyer(BlockKeyer):
    """Block keys bit-identical to `BlockKeyer` (roots, chains, extras, errors), hashed in C."""

    __slots__ = ()

    name = "native"
    deadline_chunk = 128
    """Blocks hashed per chunk where a caller checks deadlines between chunks (sessions); `keys_until` checks
    in C every 16 blocks."""

    def _blocks(self, parent: bytes, token_ids: Sequence[int], extras: dict[int, bytes], start: int = 0,
                stop: int | None = None) -> list[bytes]:  # fmt: skip
        """The reference's `_blocks`, in C: `token_ids[start:stop]` is read in place, not copied.

        The GIL is released while chains of 512 blocks or more hash.
        """
        return _native.chain(parent, token_ids, self.page_size, extras or None, CHAIN_PERSON, start,
                             len(token_ids) if stop is None else stop)  # fmt: skip

    def _blocks_until(self, parent: bytes, token_ids: Sequence[int], extras: dict[int, bytes],
                      deadline: float) -> list[bytes]:  # fmt: skip
        """The reference's `_blocks_until` in one C call: the deadline is checked in C every 16 blocks.

        With a deadline the GIL is kept for the call (about 0.5 ms for 2,048 blocks): taking it back from busy
        threads can cost a whole switch interval (5 ms), far past a planning deadline. `_blocks` (no deadline:
        commits, sessions, scheduler-side keys) releases it.
        """
        return _native.chain(parent, token_ids, self.page_size, extras or None, CHAIN_PERSON, 0, len(token_ids),
                             deadline)  # fmt: skip
