"""One node of a test cluster, in its own process: a kernel on etcd + the Redis index + TCP, driven over a pipe.

Run by `nexuskv_tier_redis.cluster_testing.Cluster` (`python -m nexuskv_tier_redis._cluster_node SPEC`), never
by hand. SPEC (JSON) names the node, the servers, the harness's address and the engine: `reference` serves with
the transformers reference engine (real prefill, real restored KV), `synthetic` with random payloads (no torch).
Each command answers `("ok", result)` or `("error", text)`; a request that raises is reported, never hidden.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from multiprocessing.connection import Client
from typing import Any

from nexuskv import Kernel, KernelConfig, NodeState, PlanAction, Request

SECRET = bytes(range(32))


def kernel_config(spec: dict[str, Any]) -> KernelConfig:
    """The node's kernel: one DRAM tier, etcd, the Redis index, TCP to peers, measured links."""
    return KernelConfig.from_mapping({
        "node": spec["node"], "page_size": spec.get("page_size", 16), "lease_ttl_s": spec.get("lease_ttl_s", 1.0),
        "deadline_ms": spec.get("deadline_ms", 5.0), "load_timeout_ms": spec.get("load_timeout_ms", 2000.0),
        "profile": spec.get("profile"),
        "control_plane": {"name": "etcd", "endpoint": spec["etcd"], "timeout_s": 0.5},
        "matcher": {"name": "redis", "url": spec["redis"], "poll_s": 0.05, "timeout_s": 0.5,
                    **spec.get("matcher", {})},
        "tiers": {"dram": {"store": "dram", "capacity_bytes": "1GiB"}},
        "transports": ["local", "tcp"],
        "transport_options": {"tcp": {"host": spec.get("tcp_host", "127.0.0.1"), "timeout_s": 2.0,
                                      **spec.get("tls", {})}},
        "links": spec.get("links", {"measure": True, "min_samples": 3, "max_age_s": 2.0}),
        "promote_on_hit": spec.get("promote_on_hit", True),
    })  # fmt: skip


class Node:
    """The commands a harness sends."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.kernel = Kernel(kernel_config(spec), secret=SECRET)
        self.engine = spec.get("engine", "synthetic")
        self.connectors: dict[str, Any] = {}
        if self.engine == "reference":
            from nexuskv_transformers import TransformersConnector, build_model
            from nexuskv_transformers.engine import Engine

            model = build_model("dense", size=spec.get("model_size", "demo"))
            engine = Engine(model)
            commit = spec.get("commit", True)
            for mode in ("nexuskv", "never"):
                self.connectors[mode] = TransformersConnector(self.kernel, model, mode=mode, engine=engine,
                                                              commit=mode == "nexuskv" and commit)  # fmt: skip

    def _request(self, tokens: list[int], tenant: str, request_id: str) -> Request:
        if self.engine == "reference":
            return self.connectors["nexuskv"].request(tokens, tenant=tenant, request_id=request_id)  # type: ignore[no-any-return]
        return _synthetic_request(tokens, tenant, request_id, self.kernel.keyer.page_size)

    def serve(self, tokens: list[int], tenant: str = "t", mode: str = "nexuskv",
              request_id: str = "") -> dict[str, Any]:  # fmt: skip
        """Serve one request; what was planned, loaded from where, and the time to the first token."""
        req = self._request(tokens, tenant, request_id or f"r{time.perf_counter_ns()}")
        if self.engine == "reference":
            out = self.connectors[mode].run(req)
            plan = out.plan
            return {"action": plan.action.value if plan else "prefill", "reused": out.tokens_reused,
                    "total": out.tokens_total, "ttft_ms": out.ttft_s * 1e3, "fallback": out.fallback,
                    "spans": [(s.tier, s.node, s.transport) for s in plan.spans] if plan else [],
                    "reasons": list(plan.reasons) if plan else [],
                    "timings_ms": {k.removesuffix("_s"): v * 1e3 for k, v in out.timings.items()}}  # fmt: skip
        return self._serve_synthetic(req)

    def _serve_synthetic(self, req: Request) -> dict[str, Any]:
        t0 = time.perf_counter()
        k, page = self.kernel, self.kernel.keyer.page_size
        keys = k.keys(req)
        plan = k.plan(req, keys=keys)
        reused, why = 0, ""
        if plan.action == PlanAction.MATERIALIZE:
            got = k.materialize(plan, req, keys=keys)
            reused, why = got.tokens, got.reason
        payloads = {(b, 0): os.urandom(k.cost.bytes_per_token * page // 64) for b in range(reused // page, len(keys))}
        k.commit(req, payloads, keys=keys)
        return {"action": plan.action.value, "reused": reused, "total": len(req.token_ids),
                "ttft_ms": (time.perf_counter() - t0) * 1e3, "fallback": why,
                "spans": [(s.tier, s.node, s.transport) for s in plan.spans],
                "reasons": list(plan.reasons)}  # fmt: skip

    def plan(self, tokens: list[int], tenant: str = "t") -> dict[str, Any]:
        """Plan only: where the plan would load from."""
        req = self._request(tokens, tenant, f"p{time.perf_counter_ns()}")
        keys = self.kernel.keys(req)[: (len(tokens) - 1) // self.kernel.keyer.page_size]
        plan = self.kernel.plan(req, keys=keys)
        return {"action": plan.action.value, "reused": plan.tokens_reused,
                "spans": [(s.tier, s.node, s.transport) for s in plan.spans], "reasons": list(plan.reasons)}

    def route(self, tokens: list[int], loads: dict[str, int], tenant: str = "t") -> dict[str, Any]:
        """Route among `loads` (node -> queued prefill tokens); the grant for the chosen node's first peer span."""
        req = self._request(tokens, tenant, f"r{time.perf_counter_ns()}")
        keys = self.kernel.keys(req)
        decision = self.kernel.route(req, [NodeState(node=n, queued_prefill_tokens=q) for n, q in loads.items()],
                                     keys=keys)  # fmt: skip
        chosen = next((o for o in decision.options if o.node == decision.node), None)
        spans = [list(s) for s in chosen.spans] if chosen is not None else []
        holder = spans[0][3] if spans and spans[0][0] == 0 else None
        grant = self.kernel.handoff(req, keys=keys, holder=holder) if holder and holder != decision.node else None
        return {"node": decision.node, "spans": spans, "grant": grant, "reasons": list(decision.reasons)}

    def accept(self, tokens: list[int], grant: Any, tenant: str = "t") -> dict[str, Any]:
        """Take a grant for this prompt."""
        got = self.kernel.accept_handoff(self._request(tokens, tenant, f"a{time.perf_counter_ns()}"), grant)
        return {"blocks": got.blocks, "node": got.node, "reason": got.reason}

    def flush(self) -> bool:
        """Wait for the writer."""
        return self.kernel.flush(10.0)

    def stats(self) -> dict[str, Any]:
        """Epoch, control plane health, the index's counters and peers, measured links."""
        k = self.kernel
        idx = k.index
        return {"node": k.node, "epoch": k.epoch, "ok": k.control_ok(), "members": dict(k.control.members()),
                "index": idx.stats(), "peers": idx.peers(), "ident": idx.publisher.ident if idx.publisher else "",
                "links": dict(k.links.snapshot()) if k.links is not None else {},
                "blocks": {f"{loc.tier}@{loc.node}": n for loc, n in idx.holdings().items()}}  # fmt: skip

    def set_link_age(self, max_age_s: float) -> None:
        """Change how soon measured link estimates give way to the profile again."""
        if self.kernel.links is not None:
            self.kernel.links.max_age_s = max_age_s


def _synthetic_request(tokens: list[int], tenant: str, request_id: str, page: int) -> Request:
    from nexuskv import Layout, ModelIdentity, StateGroup, TokenizerIdentity

    layout = Layout(groups=[StateGroup(kind="dense", layers=1, kv_heads=1, head_dim=8)], page_size=page)
    return Request(request_id=request_id, tenant=tenant, model=ModelIdentity("synthetic"),
                   tokenizer=TokenizerIdentity("ids"), layout=layout, token_ids=tuple(tokens))  # fmt: skip


def main() -> None:
    """Connect to the harness, start the kernel, answer commands until told to stop."""
    spec = json.loads(sys.argv[1])
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack (debugging a hang)
    conn = Client((spec["harness_host"], spec["harness_port"]), authkey=spec["authkey"].encode())
    try:
        node = Node(spec)
    except Exception as exc:
        conn.send(("error", f"node failed to start: {type(exc).__name__}: {exc}"))
        raise
    conn.send(("ok", {"epoch": node.kernel.epoch, "pid": os.getpid()}))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        if cmd == "quit":
            node.kernel.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(node, cmd)(**args)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    main()
