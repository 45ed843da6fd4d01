"""Valid restore points per state kind: which cut points of a request can be restored from stored state.

Dense and latent groups need every page of the prefix; windowed and recurrent groups need a checkpoint at the
cut itself (its key commits to the whole prefix). A hybrid layout's cut is valid only where every group's is.
"""

from __future__ import annotations

from collections.abc import Sequence

from nexuskv.contracts import Layout, StateGroup, StateKind

__all__ = ["StateKind", "group_masks", "longest_restore_point", "valid_restore_point"]


def group_masks(groups: Sequence[StateGroup]) -> tuple[int, int]:
    """`(paged, checkpointed)` bit masks over the groups (bit i = group i)."""
    paged = ckpt = 0
    for i, g in enumerate(groups):
        if g.kind.checkpointed:
            ckpt |= 1 << i
        else:
            paged |= 1 << i
    return paged, ckpt


def longest_restore_point(layout: Layout | Sequence[StateGroup], masks: Sequence[int]) -> int:
    """Longest valid cut, in blocks, given per-block group masks (`masks[i]` = groups held for block i).

    `masks` may be shorter than the request: blocks past its end are treated as held by no group.
    """
    groups = layout.groups if isinstance(layout, Layout) else layout
    paged, ckpt = group_masks(groups)
    limit = len(masks)
    if paged:
        for i, m in enumerate(masks):
            if m & paged != paged:
                limit = i
                break
    if not ckpt:
        return limit
    for i in range(limit, 0, -1):
        if masks[i - 1] & ckpt == ckpt:
            return i
    return 0


def valid_restore_point(layout: Layout, masks: Sequence[int], blocks: int) -> bool:
    """True when a cut after `blocks` blocks is restorable from the held groups."""
    if blocks == 0:
        return True
    if blocks > len(masks):
        return False
    paged, ckpt = group_masks(layout.groups)
    if any(m & paged != paged for m in masks[:blocks]):
        return False
    return masks[blocks - 1] & ckpt == ckpt
