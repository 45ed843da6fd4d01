"""The plugin hooks NexusKV calls (pluggy): every extension point, with its exact signature.

`docs/plugins.md` documents each hook; a test fails when one is missing there or its signature differs.
Registrar hooks receive a `register(name, factory)` callable; `firstresult` hooks stop at the first non-None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import click
import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "nexuskv"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]


@hookspec(firstresult=True)
def nexuskv_matcher(config: Mapping[str, Any]) -> Any:
    """Return the state index / matcher (a `nexuskv.Matcher`) for this kernel, or None to pass.

    The first non-None answer wins; the builtin pure-Python `DictIndex` answers last.
    `config` is the `[matcher]` table of the kernel config (empty when absent).
    """


@hookspec(firstresult=True)
def nexuskv_keyer(secret: bytes, page_size: int, config: Mapping[str, Any]) -> Any:
    """Return the block keyer (a `nexuskv.BlockKeyer` subclass giving bit-identical keys), or None to pass.

    The first non-None answer wins; the builtin pure-Python `BlockKeyer` answers last.
    `config` is the `[keyer]` table of the kernel config (empty when absent).
    """


@hookspec(firstresult=True)
def nexuskv_control_plane(config: Mapping[str, Any]) -> Any:
    """Return the control plane (a `nexuskv.ControlPlane`: epochs, leases, membership), or None to pass.

    The first non-None answer wins; the builtin embedded control plane answers last.
    `config` is the `[control_plane]` table of the kernel config (empty when absent).
    """


@hookspec
def nexuskv_register_tier_stores(register: Register) -> None:
    """Register tier store factories: `register(name, factory)`.

    `factory(**options)` returns a `nexuskv.TierStore`; options come from a `[tiers.<name>]` config table.
    """


@hookspec
def nexuskv_register_transports(register: Register) -> None:
    """Register transport factories: `register(name, factory)`; `factory(**options)` returns a `Transport`."""


@hookspec
def nexuskv_register_connectors(register: Register) -> None:
    """Register engine connector factories: `register(name, factory)`.

    `factory(kernel, **options)` returns a connector that turns engine state into descriptors and payloads
    and executes plans (materialize / prefetch / recompute) on the engine.
    """


@hookspec
def nexuskv_register_cel_functions(register: Register) -> None:
    """Register functions callable from policy CEL: `register(name, fn, arg_types, result_type)`.

    `arg_types` and `result_type` are CEL type names (`int`, `uint`, `double`, `string`, `bool`, `bytes`,
    `list`, `map`); the policy type checker uses them at load time.
    """


@hookspec
def nexuskv_observe_decision(decision: Mapping[str, Any]) -> None:
    """Called once per kernel decision with its decision-log record (a JSON-compatible mapping).

    Observers run on the kernel's single observer thread (`nexuskv-observers`), never on the planning thread:
    records reach it through a bounded queue, and when observers fall behind, records are dropped and counted
    (`Kernel.observer_drops`, metric `nexuskv_decision_observer_drops_total`), never waited for. Observers must
    be quick and must not raise; an exception is logged and the observer is skipped.
    """


@hookspec(firstresult=True)
def nexuskv_metrics_registry(kernel: Any) -> Any:
    """Return a `prometheus_client.CollectorRegistry` the kernel adds its metrics collector to, or None to pass.

    Called once when the kernel starts (its parts are built), so an engine that exports Prometheus (vLLM,
    SGLang) serves NexusKV's `nexuskv_*` series beside its own; the kernel takes its collector out again when
    it closes. The kernel's own registry (`kernel.metrics.registry`) has the collector whatever the answer.
    """


@hookspec
def nexuskv_register_commands(cli: click.Group) -> None:
    """Add click subcommands to the `nexuskv` command line (`cli.add_command(...)`)."""
