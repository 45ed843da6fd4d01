"""docs/plugins.md's plugin-author reference holds: the whole cost profile, the helpers' contracts, the connector's
calls (issue 35: these were only in example code)."""

from __future__ import annotations

import heapq
import inspect
import json
import re
from pathlib import Path

from nexuskv import CostProfile, Kernel, KernelConfig, Lineage, from_dict, pick_victims
from tests.conftest import make_request

DOC = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()


def section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n### ", start + len(title))
    return DOC[start:end]


def test_the_whole_profile_file_is_a_valid_profile_with_every_field():
    text = re.search(r"A whole profile file.*?```json\n(.*?)```", DOC, re.S).group(1)
    raw = json.loads(text)
    profile = from_dict(CostProfile, raw)
    assert set(raw) == {f.name for f in CostProfile.__attrs_attrs__}  # every field shown
    assert profile.tiers["example"].bandwidth_bytes_per_s == 1.5e9


def test_pick_victims_pops_what_it_takes_drops_stale_entries_and_leaves_the_heap_when_it_cannot():
    sizes = {b"a": 10, b"b": 10, b"c": 10}
    seqs = {b"a": 1, b"b": 2, b"c": 3}
    heap = [(0.0, 0, b"a"), (0.0, 1, b"a"), (1.0, 2, b"b"), (5.0, 3, b"c")]  # (0.0, 0, a) is stale: a moved to 1
    heapq.heapify(heap)

    def size_of(slot: bytes, seq: int) -> int | None:
        return sizes[slot] if seqs.get(slot) == seq else None

    got = pick_victims(heap, used=30, need=15, capacity=30, priority=2.0, size_of=size_of)
    assert [v[2] for v in got] == [b"a", b"b"] and [e[2] for e in heap] == [b"c"]  # popped; the stale one dropped
    before = list(heap)
    assert pick_victims(heap, used=30, need=15, capacity=30, priority=2.0, size_of=size_of) is None
    assert heap == before  # c is above the incoming priority: nothing taken, the heap as it was
    assert "pops" in section("### The helpers' contracts") and "size_of(slot, seq) -> int | None" in DOC


def test_lineage_takes_the_stores_membership_test():
    held = {b"x"}
    lineage = Lineage(held.__contains__)
    assert inspect.signature(Lineage).parameters.keys() == {"held"}
    assert not lineage.has_children(b"parent")
    assert "`nexuskv.Lineage(held)`" in DOC


def test_the_async_calls_exist_and_the_materialize_example_runs(tmp_path):
    for name in ("aplan", "aroute", "amaterialize", "acommit"):
        assert inspect.iscoroutinefunction(getattr(Kernel, name)) and f"`{name}`" in DOC
    code = re.search(r"### The kernel's calls a connector makes.*?```python\n(.*?)```", DOC, re.S).group(1)
    mounted: list[tuple[int, int, int]] = []
    prefilled: list[int] = []

    class Engine:
        def mount(self, block: int, group: int, payload) -> None:
            mounted.append((block, group, len(payload)))

        def prefill(self, ids) -> None:
            prefilled.append(len(ids))

    with Kernel(KernelConfig(node="n1", page_size=16), secret=bytes(32)) as kernel:
        request = make_request(range(64))
        kernel.commit(request, [bytes([i]) * 64 for i in range(4)])
        assert kernel.flush(10)
        plan = kernel.plan(request)
        assert plan.tokens_reused >= 32, plan.reasons  # the example has something to mount
        exec(compile(code, "docs/plugins.md", "exec"), {"kernel": kernel, "plan": plan, "request": request,
                                                         "engine": Engine()})  # fmt: skip
    assert mounted == [(b, 0, 64) for b in range(plan.tokens_reused // 16)]
    assert prefilled == [64 - plan.tokens_reused]


def test_disable_plugins_is_documented_as_a_config_key():
    assert "disable_plugins" in KernelConfig.__annotations__ and "`disable_plugins = " in DOC
    from nexuskv.testing import prefix_problems

    assert "make_store(capacity_bytes)" in (prefix_problems.__doc__ or "") and "make_store(capacity_bytes)" in DOC
