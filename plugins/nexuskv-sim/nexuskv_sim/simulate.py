"""The simulator's Python entry points: `simulate` (strategies over a trace) and `plot_ttft` (their TTFTs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from nexuskv_sim.api import SimRequest, Strategy
from nexuskv_sim.metrics import SimResult
from nexuskv_sim.profile import Profile, default_profile
from nexuskv_sim.trace import TraceRecord
from nexuskv_sim.world import TierFactory, World

__all__ = ["assign_nodes", "plot_ttft", "simulate", "to_requests"]


def to_requests(records: Iterable[TraceRecord], profile: Profile, limit: int | None = None) -> list[SimRequest]:
    """Trace records as `SimRequest`s (model "default" becomes the profile's default model)."""
    out = []
    for i, r in enumerate(records):
        if limit is not None and i >= limit:
            break
        model = profile.default_model if r.model == "default" else r.model
        profile.model(model)  # unknown model: ConfigError now, not mid-run
        out.append(SimRequest(i, float(r.timestamp), model, r.tenant, r.input_length, r.output_length, r.hash_ids,
                              profile.block_tokens))  # fmt: skip
    return out


def assign_nodes(models: Sequence[str], nodes: int, engines_per_host: int = 1) -> tuple[dict[str, str], dict[str, str]]:
    """Node names `n0..`, models round-robin over `models` (in order), `engines_per_host` nodes per host.

    Returns (node -> model, node -> host). With several engines per host, consecutive nodes share a host, so
    with as many engines per host as models every host runs one engine of each model.
    """
    if nodes < 1 or engines_per_host < 1 or not models:
        raise ValueError("need at least one node, one engine per host and one model")
    node_model = {f"n{i}": models[i % len(models)] for i in range(nodes)}
    node_host = {f"n{i}": f"h{i // engines_per_host}" for i in range(nodes)}
    return node_model, node_host


def simulate(
    records: Iterable[TraceRecord],
    strategies: Sequence[Strategy | str],
    *,
    nodes: int = 4,
    node_models: Mapping[str, str] | None = None,
    engines_per_host: int = 1,
    profile: Profile | None = None,
    congested: bool = False,
    report_delay_ms: float = 50.0,
    slo_ms: float = 2000.0,
    limit: int | None = None,
    tier_factory: TierFactory | None = None,
) -> dict[str, SimResult]:
    """Run every strategy over the same requests on identical, fresh clusters; results by strategy name.

    `strategies` are `Strategy` objects or names of the built-in ones (`nexuskv_sim.routers_sched.STRATEGIES`; a name
    gets a fresh instance). Nodes serve the trace's models round-robin in order of first appearance unless
    `node_models` (node -> model) says otherwise. `congested` scales links by the profile's `[congested]`
    factors. `tier_factory(host, tier, capacity_bytes)` builds the dram and disk tiers (default LRU).
    """
    from nexuskv_sim.routers_sched import make_strategy

    base = profile or default_profile()
    prof = base.congested() if congested else base
    reqs = to_requests(records, prof, limit)
    if node_models is not None:
        node_model = dict(node_models)
        names = list(node_model)
        node_host = {n: f"h{i // engines_per_host}" for i, n in enumerate(names)}
    else:
        models = list(dict.fromkeys(r.model for r in reqs)) or [prof.default_model]
        node_model, node_host = assign_nodes(models, nodes, engines_per_host)
    out: dict[str, SimResult] = {}
    for s in strategies:
        strategy = make_strategy(s, base) if isinstance(s, str) else s
        world = World(reqs, strategy, node_model=node_model, node_host=node_host, profile=prof,
                      report_delay_ms=report_delay_ms, slo_ms=slo_ms, tier_factory=tier_factory)  # fmt: skip
        try:
            res = world.run()
        finally:
            close = getattr(strategy, "close", None)
            if isinstance(s, str) and callable(close):  # made here: closed here (the NexusKV strategy's kernels)
                close()
        out[res.strategy] = res
    return out


def plot_ttft(results: Mapping[str, SimResult], path: str | Path, title: str = "TTFT") -> Path:
    """Write a PNG of each strategy's TTFT CDF (log-scale x, SLO marked) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    slo = None
    for name, r in results.items():
        xs = sorted(max(t, 1e-3) for t in r.ttft_ms)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=f"{name} (p90 {r.p90_ttft_ms:.0f} ms)")
        slo = r.slo_ms
    if slo is not None:
        ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:.0f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
