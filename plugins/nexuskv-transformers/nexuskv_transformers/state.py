"""Model state <-> payloads: pages of paged groups and checkpoints of windowed / recurrent groups, as raw tensors.

A payload is the raw bytes of its tensors back to back; names, dtypes and shapes travel in the descriptor's
`tensors`. Decoding checks every spec against what this model would produce at that position, so state of another
shape, dtype or layer count is refused (`StateMismatch`) before it reaches the engine.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nexuskv import StateDescriptor, StateKind, TensorSpec
from nexuskv_transformers.models import ReferenceModel

__all__ = ["Snapshot", "StateCodec", "StateMismatch"]

Snapshot = dict[str, torch.Tensor]
"""The cloned state of one checkpointed group at one position: tensor name -> tensor."""


class StateMismatch(ValueError):
    """A payload whose tensors are not what this model produces at that position: never restored."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _encode(tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[bytes, tuple[TensorSpec, ...]]:
    specs = tuple(TensorSpec(name, _dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors)
    raw = b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes() for _, t in tensors)
    return raw, specs


def _nbytes(spec: TensorSpec) -> int:
    n = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
    for d in spec.shape:
        n *= d
    return n


def _decode(payload: bytes | memoryview, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    total = sum(_nbytes(s) for s in specs)
    if len(payload) != total:
        raise StateMismatch(f"payload holds {len(payload)} bytes, its tensors need {total}")
    with warnings.catch_warnings():  # read-only buffers: the tensors are copied into the cache before any write
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    out, off = {}, 0
    for s in specs:
        n = _nbytes(s)
        out[s.name] = flat[off : off + n].view(getattr(torch, s.dtype)).reshape(s.shape)
        off += n
    return out


class StateCodec:
    """Turns one reference model's cache into per-block payloads and back."""

    def __init__(self, ref: ReferenceModel) -> None:
        self.ref = ref
        self.page = ref.page_size
        self._linear_shapes: dict[str, tuple[int, ...]] | None = None
        self._specs: dict[tuple[int, int], tuple[TensorSpec, ...]] = {}  # (group, tokens kept) -> specs

    # ------------------------------------------------------------------------------------------ encode

    def page_payload(self, cache: Any, block: int, group: int) -> tuple[bytes, tuple[TensorSpec, ...]]:
        """Keys and values of block `block` (tokens [block*P, (block+1)*P)) of every layer of a paged group."""
        _, layers = self.ref.groups[group]
        lo, hi = block * self.page, (block + 1) * self.page
        tensors = []
        for i in layers:
            layer = cache.layers[i]
            tensors.append((f"L{i}.k", layer.keys[..., lo:hi, :]))
            tensors.append((f"L{i}.v", layer.values[..., lo:hi, :]))
        return _encode(tensors)

    def snapshot(self, cache: Any, group: int) -> Snapshot:
        """A copy of a checkpointed group's state now (the engine updates it in place afterwards)."""
        kind = self.ref.groups[group][0].kind
        out: Snapshot = {}
        for i in self.ref.groups[group][1]:
            layer = cache.layers[i]
            if kind == StateKind.WINDOWED:
                out[f"L{i}.k"] = layer.keys.detach().clone()
                out[f"L{i}.v"] = layer.values.detach().clone()
            else:
                for s in range(layer.number_of_states):
                    out[f"L{i}.conv{s}"] = layer.conv_states[s].detach().clone()
                    out[f"L{i}.rec{s}"] = layer.recurrent_states[s].detach().clone()
        return out

    @staticmethod
    def checkpoint_payload(snapshot: Snapshot) -> tuple[bytes, tuple[TensorSpec, ...]]:
        """The payload of a snapshot."""
        return _encode(list(snapshot.items()))

    # ------------------------------------------------------------------------------------------ expected specs

    def expected_specs(self, group: int, position: int) -> tuple[TensorSpec, ...]:
        """The tensors this model stores for `group`: one page, or the checkpoint at `position` tokens."""
        g = self.ref.groups[group][0]
        # Only a sliding window's kept length depends on the position: one entry per group otherwise.
        key = (group, min(g.window - 1, position) if g.kind == StateKind.WINDOWED else 0)
        specs = self._specs.get(key)
        if specs is None:
            specs = self._specs[key] = self._expected_specs(group, position)
        return specs

    def _expected_specs(self, group: int, position: int) -> tuple[TensorSpec, ...]:
        g, layers = self.ref.groups[group]
        dt = _dtype_name(self.ref.dtype)
        if g.kind == StateKind.RECURRENT:
            shapes = self._linear()
            return tuple(TensorSpec(f"L{i}.{part}", dt, shapes[f"{part}"]) for i in layers
                         for part in sorted(shapes, key=lambda p: (p[-1], p)))  # fmt: skip
        if g.kind == StateKind.LATENT:
            cfg = self.ref.config
            k, v = (1, 1, self.page, cfg.kv_lora_rank), (1, 1, self.page, cfg.qk_rope_head_dim)
        elif g.kind == StateKind.WINDOWED:
            t = min(g.window - 1, position)
            k = v = (1, g.kv_heads, t, g.head_dim)
        else:
            k = v = (1, g.kv_heads, self.page, g.head_dim)
        return tuple(spec for i in layers for spec in (TensorSpec(f"L{i}.k", dt, k), TensorSpec(f"L{i}.v", dt, v)))

    def _linear(self) -> dict[str, tuple[int, ...]]:
        """Shapes of one linear layer's states (position-independent), from a one-token probe run."""
        if self._linear_shapes is None:
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache(config=self.ref.config)
            with torch.no_grad():
                self.ref.model(input_ids=torch.tensor([[3]]), cache=cache, use_cache=True,
                               position_ids=torch.tensor([[0]]), logits_to_keep=1)  # fmt: skip
            g, layers = next((g, ls) for g, ls in self.ref.groups if g.kind == StateKind.RECURRENT)
            snap = self.snapshot(cache, self.ref.groups.index((g, layers)))
            first = layers[0]
            self._linear_shapes = {name.split(".", 1)[1]: tuple(t.shape) for name, t in snap.items()
                                   if name.startswith(f"L{first}.")}  # fmt: skip
        return self._linear_shapes

    def check(self, descriptor: StateDescriptor, group: int, position: int) -> None:
        """Refuse a descriptor whose tensors are not exactly what this model stores for `group` there."""
        want = self.expected_specs(group, position)
        if tuple(descriptor.tensors) != want:
            have = [(t.name, t.dtype, t.shape) for t in descriptor.tensors][:4]
            exp = [(t.name, t.dtype, t.shape) for t in want][:4]
            raise StateMismatch(f"block {descriptor.key}: tensors {have}... are not this model's {exp}...")

    # ------------------------------------------------------------------------------------------ restore

    def restore(self, states: Mapping[tuple[int, int], tuple[bytes | memoryview, StateDescriptor]], blocks: int) -> Any:
        """A fresh cache holding the state after `blocks` blocks.

        Every page of paged groups, and the checkpoint at block `blocks - 1` of checkpointed groups. Raises
        `StateMismatch` on any missing or foreign tensor.
        """
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.ref.config)
        position = blocks * self.page
        for gi, (g, layers) in enumerate(self.ref.groups):
            if g.kind.checkpointed:
                got = states.get((blocks - 1, gi))
                if got is None:
                    raise StateMismatch(f"no checkpoint of group {gi} at block {blocks - 1}")
                payload, desc = got
                self.check(desc, gi, position)
                if desc.span.end != position:
                    raise StateMismatch(f"checkpoint covers {desc.span.end} tokens, not {position}")
                t = _decode(payload, desc.tensors)
                for i in layers:
                    self._restore_checkpoint(cache.layers[i], i, g.kind, t, position)
                continue
            payloads = []
            for b in range(blocks):
                got = states.get((b, gi))
                if got is None:
                    raise StateMismatch(f"no page of group {gi} at block {b}")
                payload, desc = got
                self.check(desc, gi, (b + 1) * self.page)
                if (desc.span.start, desc.span.end) != (b * self.page, (b + 1) * self.page):
                    raise StateMismatch(f"page covers [{desc.span.start}, {desc.span.end}), not block {b}")
                payloads.append(payload)
            for name, tensor in self._pages(payloads, desc.tensors).items():
                layer = cache.layers[int(name[1:].split(".")[0])]
                if name.endswith(".k"):
                    layer.lazy_initialization(tensor, tensor)
                    layer.keys = tensor
                else:
                    layer.values = tensor
        return cache

    @staticmethod
    def _pages(payloads: Sequence[bytes | memoryview], specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Concatenate the pages of every tensor along the token axis: one copy per tensor, whatever the count.

        The payloads (all with the same, already checked, specs) are stacked as rows, each tensor's columns viewed
        as [blocks, *shape] and moved to [*shape with tokens = blocks * page].
        """
        total = sum(_nbytes(s) for s in specs)
        if any(len(p) != total for p in payloads):
            raise StateMismatch(f"a page does not hold the {total} bytes its tensors need")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for p in payloads])
        out, off = {}, 0
        n = len(payloads)
        for s in specs:
            nb = _nbytes(s)
            t = rows[:, off : off + nb].view(getattr(torch, s.dtype)).reshape(n, *s.shape)  # [n, 1, H, P, D]
            perm = t.permute(1, 2, 0, 3, 4)  # [1, H, n, P, D]
            out[s.name] = perm.reshape(s.shape[0], s.shape[1], n * s.shape[2], s.shape[3])
            off += nb
        return out

    @staticmethod
    def _restore_checkpoint(layer: Any, i: int, kind: StateKind, t: Mapping[str, torch.Tensor], position: int) -> None:
        if kind == StateKind.WINDOWED:
            k, v = t[f"L{i}.k"].clone(), t[f"L{i}.v"].clone()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            layer.cumulative_length = position  # tokens seen, not tokens kept: the mask depends on it
            return
        s = 0
        while f"L{i}.conv{s}" in t:
            conv, rec = t[f"L{i}.conv{s}"].clone(), t[f"L{i}.rec{s}"].clone()
            layer.lazy_initialization(conv_states=conv, state_idx=s)
            layer.conv_states[s].copy_(conv)
            layer.lazy_initialization(recurrent_states=rec, state_idx=s)
            layer.recurrent_states[s].copy_(rec)
            layer.has_previous_state[s] = True  # else the restored state is silently discarded
            s += 1
