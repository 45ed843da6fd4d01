"""The plugin manager: builtins and entry-point plugins behind one pluggy manager, failures reported, not fatal.

Builtins register like any plugin. Separately installed distributions are found in the `nexuskv` entry-point
group; `NEXUSKV_PLUGINS` (comma-separated allow list of entry-point names) and `NEXUSKV_DISABLE_PLUGINS`
(block list, builtins included) decide what loads; a name in either that no plugin has is reported. A plugin
that fails to import or register, or a registrar that raises, is reported in `problems` and skipped: the kernel
still starts.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

import pluggy
from attrs import define, field

from nexuskv.errors import PluginError
from nexuskv.logs import get_logger
from nexuskv.plugins import hookspecs

__all__ = ["BUILTINS", "PluginInfo", "PluginManager", "PluginProblem"]

ENTRY_POINT_GROUP = "nexuskv"
ALLOW_ENV = "NEXUSKV_PLUGINS"
DENY_ENV = "NEXUSKV_DISABLE_PLUGINS"

# name -> module of each builtin plugin, in registration order.
BUILTINS: dict[str, str] = {
    "dram": "nexuskv.builtins.dram",
    "local": "nexuskv.builtins.local",
    "dict-matcher": "nexuskv.builtins.matcher",
    "python-keyer": "nexuskv.builtins.keyer",
    "embedded": "nexuskv.builtins.embedded",
    "shaped-link": "nexuskv.builtins.shaped",
}

log = get_logger("nexuskv.plugins")  # the component name operators filter on: stable


@define(frozen=True)
class PluginProblem:
    """A plugin that could not be used, and why."""

    plugin: str
    stage: str  # "load", "register", "allow-list", "block-list", or the hook name that failed
    message: str


@define(frozen=True)
class PluginInfo:
    """What `nexuskv plugins` shows for one loaded plugin."""

    name: str
    source: str  # "builtin" or the distribution name
    version: str
    hooks: tuple[str, ...] = field(converter=tuple)


def _names(env: Mapping[str, str], var: str) -> set[str] | None:
    raw = env.get(var)
    if raw is None or not raw.strip():
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


class PluginManager:
    """Loads plugins and calls their hooks with per-plugin error isolation."""

    def __init__(self, env: Mapping[str, str] | None = None, *, entry_points: bool = True) -> None:
        self.env = os.environ if env is None else env
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.problems: list[PluginProblem] = []
        self._sources: dict[str, tuple[str, str]] = {}
        allow = _names(self.env, ALLOW_ENV)
        deny = _names(self.env, DENY_ENV) or set()
        for name, module in BUILTINS.items():
            if name not in deny:
                self._register(name, lambda m=module: importlib.import_module(m), ("builtin", _kernel_version()))
        if entry_points:
            self._load_entry_points(allow, deny)
        self._unknown_denied(deny)

    # ---------------------------------------------------------------- loading

    def _problem(self, plugin: str, stage: str, message: str) -> None:
        self.problems.append(PluginProblem(plugin, stage, message))
        log.error("plugin problem", plugin=plugin, stage=stage, problem=message)

    def _register(self, name: str, load: Callable[[], object], source: tuple[str, str]) -> None:
        try:
            plugin = load()
        except Exception as exc:
            self._problem(name, "load", f"{type(exc).__name__}: {exc}")
            return
        try:
            self.pm.register(plugin, name=name)
        except Exception as exc:  # pluggy.PluginValidationError, duplicate names
            self._problem(name, "register", f"{type(exc).__name__}: {exc}")
            return
        unknown = sorted(hc.name for hc in self.pm.get_hookcallers(plugin) or [] if hc.spec is None)
        if unknown:  # a typo in a hook name would otherwise be silently never called
            self.pm.unregister(plugin)
            self._problem(name, "register", f"implements unknown hooks {unknown} (see docs/plugins.md)")
            return
        self._sources[name] = source

    def _load_entry_points(self, allow: set[str] | None, deny: set[str]) -> None:
        found = set()
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            found.add(ep.name)
            if ep.name in deny or (allow is not None and ep.name not in allow):
                continue
            if ep.name in self._sources:
                self._problem(ep.name, "register", "a plugin with this name is already registered")
                continue
            dist = ep.dist
            source = (dist.metadata["Name"], dist.version) if dist is not None else (ep.value, "?")
            self._register(ep.name, ep.load, source)
        for name in sorted((allow or set()) - found - set(BUILTINS)):
            self._problem(name, "allow-list", f"plugin {name!r} is named in {ALLOW_ENV} but is not installed")

    def _unknown_denied(self, deny: set[str]) -> None:
        """A block-list name no builtin and no installed plugin has (a typo blocks nothing): a problem, as for allow."""
        known = set(BUILTINS) | {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
        for name in sorted(deny - known):
            self._problem(name, "block-list", f"plugin {name!r} is named in {DENY_ENV} (or a config's disable_plugins)"
                          f" but no such plugin exists (known: {', '.join(sorted(known))})")  # fmt: skip

    def register(self, plugin: object, name: str) -> None:
        """Register a plugin object at run time (tests, embedding applications)."""
        self._register(name, lambda: plugin, ("runtime", "-"))

    # ---------------------------------------------------------------- calling

    def _impls(self, hook_name: str) -> list[pluggy.HookImpl]:
        return list(reversed(getattr(self.pm.hook, hook_name).get_hookimpls()))  # call order

    def collect(self, hook_name: str) -> dict[str, Any]:
        """Call a registrar hook on every plugin; return `name -> registered value` (first registered wins).

        A plugin whose registrar raises is reported and its registrations dropped; a name registered twice is
        reported and the first registration kept.
        """
        out: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():  # registration order: builtins first
            mine: dict[str, Any] = {}

            def register(name: str, value: Any, *more: Any, _mine: dict[str, Any] = mine) -> None:
                _mine[name] = (value, *more) if more else value

            try:
                impl.function(register)
            except Exception as exc:
                self._problem(impl.plugin_name, hook_name, f"{type(exc).__name__}: {exc}")
                continue
            for name, value in mine.items():
                if name in out:
                    self._problem(impl.plugin_name, hook_name, f"{name!r} already registered by {owner[name]!r}")
                    continue
                out[name] = value
                owner[name] = impl.plugin_name
        return out

    def first(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a firstresult hook plugin by plugin; a plugin that raises is reported and skipped."""
        failed: list[str] = []
        for impl in self._impls(hook_name):
            try:
                got = impl.function(*(kwargs[a] for a in impl.argnames))
            except Exception as exc:
                self._problem(impl.plugin_name, hook_name, f"{type(exc).__name__}: {exc}")
                failed.append(f"{impl.plugin_name}: {type(exc).__name__}: {exc}")
                continue
            if got is not None:
                return got
        why = f"; failed: {'; '.join(failed)}" if failed else " (all passed)"
        raise PluginError(f"no plugin answered {hook_name}{why}")

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call an observer hook on every plugin; exceptions are logged and swallowed."""
        for impl in self._impls(hook_name):
            try:
                impl.function(*(kwargs[a] for a in impl.argnames))
            except Exception as exc:
                log.warning("observer failed", plugin=impl.plugin_name, hook=hook_name, error=repr(exc))

    # ---------------------------------------------------------------- typed accessors

    def tier_stores(self) -> dict[str, Callable[..., Any]]:
        """Tier store factories by name."""
        return self.collect("nexuskv_register_tier_stores")

    def transports(self) -> dict[str, Callable[..., Any]]:
        """Transport factories by name."""
        return self.collect("nexuskv_register_transports")

    def connectors(self) -> dict[str, Callable[..., Any]]:
        """Engine connector factories by name."""
        return self.collect("nexuskv_register_connectors")

    def cel_functions(self) -> dict[str, Any]:
        """CEL functions by name: `(fn, arg_types, result_type)`."""
        return self.collect("nexuskv_register_cel_functions")

    def keyer(self, secret: bytes, page_size: int, config: Mapping[str, Any] | None = None) -> Any:
        """The block keyer the first answering plugin provides."""
        return self.first("nexuskv_keyer", secret=secret, page_size=page_size, config=dict(config or {}))

    def matcher(self, config: Mapping[str, Any] | None = None) -> Any:
        """The matcher the first answering plugin provides."""
        return self.first("nexuskv_matcher", config=dict(config or {}))

    def control_plane(self, config: Mapping[str, Any] | None = None) -> Any:
        """The control plane the first answering plugin provides."""
        return self.first("nexuskv_control_plane", config=dict(config or {}))

    def metrics_registry(self, kernel: Any) -> Any:
        """The registry a plugin wants the kernel's metrics added to (None when no plugin answers)."""
        if not self.pm.hook.nexuskv_metrics_registry.get_hookimpls():
            return None
        try:
            return self.first("nexuskv_metrics_registry", kernel=kernel)
        except PluginError:  # every plugin passed or failed (failures are in `problems`)
            return None

    def observe_decision(self, decision: Mapping[str, Any]) -> None:
        """Hand a decision record to every observer."""
        self.notify("nexuskv_observe_decision", decision=decision)

    def info(self) -> list[PluginInfo]:
        """Loaded plugins with their source, version and implemented hooks."""
        out = []
        for name, plugin in sorted(self.pm.list_name_plugin()):
            hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
            source, version = self._sources.get(name, ("?", "?"))
            out.append(PluginInfo(name=name, source=source, version=version, hooks=hooks))
        return out


def _kernel_version() -> str:
    try:
        return metadata.version("nexuskv")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"
