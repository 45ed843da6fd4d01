"""The reference engine: prefill on CPU with an optional restored cache, snapshotting checkpointed state on the way.

Windowed and recurrent state can only be restored where it was saved, so a prefill that must save checkpoints
runs in chunks ending at those positions and copies the state at each. Positions are always passed explicitly
(some hybrid models number them from 0 otherwise) and the cache always as `cache=` (the aliases are ignored by
some models without an error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from attrs import define

from nexuskv_transformers.models import ReferenceModel
from nexuskv_transformers.state import Snapshot, StateCodec

__all__ = ["Engine", "Prefill"]


@define
class Prefill:
    """What a prefill produced: logits, the cache after the last token, and checkpoint snapshots by position."""

    logits: torch.Tensor  # [positions, vocab]: the last position only unless all were asked for
    cache: Any
    snapshots: dict[int, dict[int, Snapshot]]  # position -> group -> snapshot


class Engine:
    """Runs one reference model; single-threaded, no gradients."""

    def __init__(self, ref: ReferenceModel, codec: StateCodec | None = None) -> None:
        self.ref = ref
        self.codec = codec or StateCodec(ref)
        self.checkpointed = [gi for gi, (g, _) in enumerate(ref.groups) if g.kind.checkpointed]

    def new_cache(self) -> Any:
        """An empty cache of the right layer types for this model."""
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.ref.config)

    def prefill(
        self,
        token_ids: Sequence[int],
        *,
        cache: Any = None,
        start: int = 0,
        checkpoints: Sequence[int] = (),
        all_logits: bool = False,
    ) -> Prefill:
        """Run tokens [start, len) on top of `cache` (state of tokens [0, start)); snapshot at `checkpoints`.

        Checkpoint positions outside (start, len] are ignored. Returns the logits of the last position (of every
        position from `start` on with `all_logits`).
        """
        total = len(token_ids)
        if not 0 <= start < total:
            raise ValueError(f"start {start} must leave at least one of {total} tokens to compute")
        cache = self.new_cache() if cache is None else cache
        cuts = sorted({p for p in checkpoints if start < p <= total} | {total}) if self.checkpointed else [total]
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        snapshots: dict[int, dict[int, Snapshot]] = {}
        logits = []
        pos = start
        with torch.inference_mode():
            for cut in cuts:
                out = self.ref.model(input_ids=ids[:, pos:cut], cache=cache, use_cache=True,
                                     position_ids=torch.arange(pos, cut).unsqueeze(0),
                                     logits_to_keep=0 if all_logits else 1)  # fmt: skip
                cache = out.cache if getattr(out, "cache", None) is not None else cache
                if all_logits:
                    logits.append(out.logits[0])
                if cut != total or cut in checkpoints:
                    snapshots[cut] = {gi: self.codec.snapshot(cache, gi) for gi in self.checkpointed}
                pos = cut
        last = torch.cat(logits) if all_logits else out.logits[0, -1:]
        return Prefill(last.float().clone(), cache, snapshots)
