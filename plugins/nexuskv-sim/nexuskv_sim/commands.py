"""The simulator's commands: `nexuskv simulate` (strategies over a trace on a simulated cluster), `gen-trace`."""

from __future__ import annotations

import json
from pathlib import Path

import click

__all__ = ["gen_trace_command", "simulate_command"]


@click.command("simulate")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--nodes", default=4, show_default=True, help="Inference nodes (engines).")
@click.option("--strategies", default="never,round-robin,sglang,dynamo,llm-d,mooncake,nexuskv", show_default=True,
              help="Comma-separated built-in strategy names. sglang, dynamo, llm-d and mooncake are this plugin's "
                   "re-implementations of those routers' published policies, not the routers themselves.")
@click.option("--congested", is_flag=True, help="Scale NIC and disk bandwidth by the profile's [congested] factors.")
@click.option("--limit", type=int, default=None, help="Only the first N requests of the trace.")
@click.option("--scale", "copies", type=click.IntRange(min=1), default=1, show_default=True,
              help="Copies of the trace, each with its own tenants and prefixes (a fleet COPIES times larger).")
@click.option("--window-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Only the records of the first SECONDS of the trace.")
@click.option("--slo-ms", type=float, default=2000.0, show_default=True, help="TTFT SLO for the attainment column.")
@click.option("--report-delay-ms", type=float, default=50.0, show_default=True,
              help="How stale the cluster view strategies see is.")
@click.option("--engines-per-host", type=int, default=1, show_default=True,
              help="Engines sharing one host's dram, disk and links.")
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Simulator profile TOML (default: the one shipped with the plugin).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="Write a TTFT CDF PNG.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write results as JSON.")
def simulate_command(trace: str, nodes: int, strategies: str, congested: bool, limit: int | None, copies: int,
                     window_s: float | None, slo_ms: float, report_delay_ms: float, engines_per_host: int,
                     profile_path: str | None, plot_path: str | None, json_path: str | None) -> None:  # fmt: skip
    """Run strategies over TRACE (Mooncake JSONL) on a simulated cluster and print a table per strategy.

    The baselines named after real routers (sglang, dynamo, llm-d, mooncake) are this plugin's re-implementations
    of their published routing policies, inside the simulator; no real router runs here.
    """
    from nexuskv_sim.metrics import summary
    from nexuskv_sim.profile import default_profile, load_profile
    from nexuskv_sim.routers_sched import STRATEGIES
    from nexuskv_sim.simulate import plot_ttft, simulate
    from nexuskv_sim.trace import read_trace, scale

    names = [s.strip() for s in strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; built in: {', '.join(STRATEGIES)}", param_hint="--strategies")
    profile = load_profile(profile_path) if profile_path else default_profile()
    records = read_trace(trace)
    if copies > 1 or window_s is not None:
        records = scale(records, copies, window_ms=None if window_s is None else window_s * 1e3)  # type: ignore[assignment]
    results = simulate(records, names, nodes=nodes, profile=profile, congested=congested, limit=limit,
                       slo_ms=slo_ms, report_delay_ms=report_delay_ms, engines_per_host=engines_per_host)  # fmt: skip
    scaled = f", x{copies}" if copies > 1 else ""
    window = f", first {window_s:g} s" if window_s is not None else ""
    title = f"{Path(trace).name}{scaled}{window}: {nodes} nodes{', congested' if congested else ''}"
    click.echo(title)
    click.echo(summary(results))
    if json_path:
        doc = {"trace": trace, "nodes": nodes, "congested": congested,
               "results": [r.to_dict() for r in results.values()]}  # fmt: skip
        Path(json_path).write_text(json.dumps(doc, indent=2))
    if plot_path:
        plot_ttft(results, plot_path, title)
        click.echo(f"plot: {plot_path}")


@click.command("gen-trace")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--requests", default=400, show_default=True, help="Requests to generate.")
@click.option("--seed", default=0, show_default=True)
@click.option("--rate", "rate_per_s", default=4.0, show_default=True, help="Poisson arrivals per second.")
@click.option("--mixed", is_flag=True, help="Mixed models and tenants (llama-8b, qwen-moe-30b, llama-70b).")
def gen_trace_command(out: str, requests: int, seed: int, rate_per_s: float, mixed: bool) -> None:
    """Write a synthetic Mooncake-format workload to OUT."""
    from nexuskv_sim.trace import generate, generate_mixed, write_trace

    gen = generate_mixed if mixed else generate
    n = write_trace(gen(requests, seed=seed, rate_per_s=rate_per_s), out)
    click.echo(f"wrote {n} requests to {out}")
