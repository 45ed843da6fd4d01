"""The demo's mixed workload: chat, RAG over shared documents, an agent loop, unique prompts, a slow link.

Deterministic for a seed; token ids are random (the models are random too).
"""

from __future__ import annotations

import torch
from attrs import define

__all__ = ["PHASES", "SHARED_PHASES", "Item", "demo_workload"]

PHASES = ("chat", "rag", "agent", "unique", "slowlink")
SHARED_PHASES = ("chat", "rag", "agent")


@define(frozen=True)
class Item:
    """One request of the workload."""

    phase: str
    request_id: str
    tenant: str
    tokens: tuple[int, ...]
    scope: str = ""
    session: str | None = None


def demo_workload(seed: int = 0, *, sessions: int = 3, turns: int = 4, docs: int = 3, queries: int = 3,
                  agent_steps: int = 6, unique: int = 6) -> list[Item]:  # fmt: skip
    """The workload, phase by phase (requests of one phase interleave the way real traffic would)."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 2000, (n,), generator=g).tolist()

    items: list[Item] = []
    # Multi-turn chat: one system prompt shared by every session; each turn appends the reply and a new message.
    system = toks(512)
    convo = {s: [*system, *toks(64)] for s in range(sessions)}
    for t in range(turns):
        for s in range(sessions):
            if t:
                convo[s] += toks(48) + toks(80)  # the model's reply, then the user's next message
            items.append(Item("chat", f"chat-s{s}-t{t}", "chat", tuple(convo[s]), session=f"chat-{s}"))
    # RAG: documents shared by every user of the tenant (scope "docs"); queries round-robin over them.
    documents = [toks(1024) for _ in range(docs)]
    for q in range(queries):
        for d in range(docs):
            items.append(Item("rag", f"rag-d{d}-q{q}", "rag", (*documents[d], *toks(64)), scope="docs"))
    # Agent loop: instructions and tool schemas, then each step appends a tool result.
    ctx = toks(768)
    for step in range(agent_steps):
        ctx += toks(96)
        items.append(Item("agent", f"agent-step{step}", "agent", tuple(ctx), session="agent"))
    # Unique prompts: nothing to reuse; a cost-aware layer must not make them slower.
    for u in range(unique):
        n = int(torch.randint(384, 1280, (1,), generator=g))
        items.append(Item("unique", f"unique-{u}", "chat", tuple(toks(n))))
    # Documents placed on the remote tier behind a slow link: reading them back is slower than recomputing.
    archive = [toks(1024) for _ in range(docs)]
    for q in range(queries):
        for d in range(docs):
            items.append(Item("slowlink", f"slow-d{d}-q{q}", "rag", (*archive[d], *toks(64)), scope="archive"))
    return items
