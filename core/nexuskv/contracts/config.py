"""Kernel configuration: `KernelConfig`, read from a mapping or a TOML file, and the plugin environment it implies.

Every key is optional; unknown keys and wrong types (a string where a list is expected, too) are a `ConfigError`
naming the file and the key path. Relative paths in a file (policies, profile, secret file, decision file, shadow and
rollout directories, tiers' path options: `path`, `shm_dir`, `*_dir`, `*_file`, `*_path`) are relative to the file.
The planning budget is sized by the stakes (`nexuskv.planning.budget`): `deadline_fraction` (0.8 %) of the predicted
prefill time of the prompt, at least `deadline_ms` (the floor, 0.5 ms; `NEXUSKV_DEADLINE_MS` sets it for a whole
deployment) and at most `deadline_cap_ms` (50 ms). A request's `slo.deadline_ms` replaces the rule, never above
`max_deadline_ms` (1 s: a request comes from a tenant, and no tenant holds a plan for longer than the operator
allows).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from attrs import define, field
from cattrs.v import format_exception

from nexuskv.contracts.checksums import CHECKSUMS, DEFAULT_CHECKSUM
from nexuskv.errors import ConfigError

__all__ = ["KernelConfig", "plugin_env"]


def _env_float(name: str, default: float) -> float:
    """A number from the environment (a deployment's default that no config file sets), else `default`."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number") from None


def _default_tiers() -> dict[str, dict[str, Any]]:
    return {"dram": {"store": "dram", "capacity_bytes": "1GiB"}}


@define(frozen=True)
class KernelConfig:
    """Kernel settings, as read from a TOML file (every key optional)."""

    node: str = "local"
    page_size: int = 16
    secret: str | None = None
    secret_file: str | None = None
    lease_ttl_s: float = 10.0
    keyer: dict[str, Any] = field(factory=dict)  # [keyer] name = "native" (default when installed) or "python"
    matcher: dict[str, Any] = field(factory=dict)  # [matcher] name = "native" (default when installed) or "dict"
    control_plane: dict[str, Any] = field(factory=dict)
    tiers: dict[str, dict[str, Any]] = field(factory=_default_tiers)
    transports: tuple[str, ...] = ("local",)
    transport_options: dict[str, dict[str, Any]] = field(factory=dict)  # [transport_options.tcp] host = "10.0.0.5"
    plugins: tuple[str, ...] | None = None  # allow list of entry-point plugins (as NEXUSKV_PLUGINS)
    disable_plugins: tuple[str, ...] = ()  # block list, builtins included (as NEXUSKV_DISABLE_PLUGINS)
    policies: str | None = None
    policy_watch: bool = False  # reload the policy directory when it changes (needs the `watch` extra)
    # "" (off), "control-plane" (the control plane's policy channel: etcd), or a shared directory path
    policy_rollout: str = ""
    policy_rollout_interval_s: float = field(default=1.0, validator=attrs.validators.gt(0))
    policy_shadow: str | None = None  # a candidate policy directory evaluated beside the live one (shadow mode)
    decision_file: str | None = None  # JSON lines of every decision record (written off the hot path)
    decision_inputs: tuple[str, ...] = ()  # tenants ("*": all) whose decision records carry their inputs
    # fraction of plans whose `decision` line is logged (fallbacks' always are), its level, records kept for /status
    decision_log_sample: float = field(default=1.0, validator=[attrs.validators.ge(0), attrs.validators.le(1)])
    decision_log_level: str = field(default="info", validator=attrs.validators.in_(("info", "debug", "off")))
    decision_log_recent: int = field(default=100, validator=attrs.validators.ge(0))
    metrics_port: int | None = field(  # serve GET /metrics and /status here (0: a free port; docs/operations.md)
        default=None, validator=attrs.validators.optional([attrs.validators.ge(0), attrs.validators.le(65535)]))
    metrics_host: str = "127.0.0.1"
    profile: str | None = None
    # the planning budget: deadline_fraction of the prompt's predicted prefill, between deadline_ms and deadline_cap_ms
    deadline_ms: float = field(factory=lambda: _env_float("NEXUSKV_DEADLINE_MS", 0.5), validator=attrs.validators.gt(0))
    deadline_fraction: float = field(default=0.008, validator=[attrs.validators.ge(0), attrs.validators.le(1)])
    deadline_cap_ms: float = field(default=50.0, validator=attrs.validators.gt(0))
    # the most a request's `slo.deadline_ms` may ask for (a request comes from a tenant; planning time is bounded)
    max_deadline_ms: float = field(default=1000.0, validator=attrs.validators.gt(0))
    load_timeout_ms: float = 200.0
    writer_max_bytes: int = 256 << 20
    writer_max_items: int = 4096
    prefetch_max_bytes: int = 512 << 20
    prefetch_max_tasks: int = 64
    prefetch_tenant_share: float = 0.5
    prefetch_deadline_s: float = 5.0
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    session_cache: int = 1024
    # how long a prefill node's handoff grant stays usable (P/D disaggregation: nexuskv.storage.handoff)
    handoff_ttl_s: float = field(default=60.0, validator=attrs.validators.gt(0))
    bandwidth_scale: dict[str, float] = field(factory=dict)
    links: dict[str, Any] = field(factory=dict)  # [links] measure, decay, min_samples, max_age_s, probe_s
    demote: bool = True
    promote_on_hit: bool = True  # a hit in a slower tier is copied to the tier the `place` rules choose
    eviction: str = field(default="cost", validator=attrs.validators.in_(("cost", "lru")))
    # algorithm of the checksums written (every known one is verified); "blake2b-128" while older nodes share tiers
    checksum: str = field(default=DEFAULT_CHECKSUM, validator=attrs.validators.in_(tuple(CHECKSUMS)))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], origin: str = "<config>",
                     relative_to: str | os.PathLike[str] | None = None) -> KernelConfig:  # fmt: skip
        """Build from a mapping; unknown keys and wrong types are a `ConfigError` naming origin and path.

        With `relative_to` (a directory: a config file's), relative paths are resolved against it, as `from_toml`
        does; without, they stay relative to the current directory.
        """
        _no_bare_strings(cls, data, origin)
        conv = cattrs.Converter(forbid_extra_keys=True)
        try:
            cfg = conv.structure(dict(data), cls)
        except cattrs.BaseValidationError as exc:
            msgs = "; ".join(cattrs.transform_error(exc, path=origin, format_exception=_explain))
            raise ConfigError(f"{origin}: {msgs}") from None
        return cfg if relative_to is None else _resolve_paths(cfg, Path(relative_to))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> KernelConfig:
        """Read a TOML config file; relative paths in it are relative to the file (made absolute)."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: {exc}") from None
        return cls.from_mapping(data, origin=str(p), relative_to=Path(os.path.abspath(p)).parent)


_PATH_KEYS = ("policies", "profile", "secret_file", "policy_shadow", "decision_file", "policy_rollout")


def _is_path_option(key: str) -> bool:
    """A tier option naming a file or directory (`path`, the shm tier's `shm_dir`, `..._file`, `..._path`)."""
    return key == "path" or key.endswith(("_dir", "_file", "_path"))


def _resolve_paths(cfg: KernelConfig, base: Path) -> KernelConfig:
    """`cfg` with its relative paths (the `_PATH_KEYS` and tiers' path options) resolved against `base`."""

    def resolved(value: Any) -> Any:
        return str(base / value) if isinstance(value, str) and value and not Path(value).is_absolute() else value

    changes = {key: resolved(getattr(cfg, key)) for key in _PATH_KEYS
               if not (key == "policy_rollout" and getattr(cfg, key) == "control-plane")}  # fmt: skip
    tiers = {name: {k: resolved(v) if _is_path_option(k) else v for k, v in opts.items()}
             for name, opts in cfg.tiers.items()}  # fmt: skip
    return attrs.evolve(cfg, tiers=tiers, **changes)


def _no_bare_strings(cls: type, data: Mapping[str, Any], origin: str) -> None:
    """A string where a list of strings is expected (`decision_inputs = "chat"`) is an error, not its characters."""
    for f in attrs.fields(cls):
        value = data.get(f.name)
        if isinstance(value, str) and str(f.type).startswith("tuple["):
            raise ConfigError(f"{origin}: {f.name}: expected a list of strings, got a string {json.dumps(value)} "
                              f"(write {f.name} = [{json.dumps(value)}])")


def _explain(exc: BaseException, type_: type | None) -> str:
    """cattrs' message, but a validator's own words for a value no validator accepted (it names the key)."""
    if isinstance(exc, ValueError) and type_ is None:
        return str(exc.args[0]) if exc.args else str(exc)
    return format_exception(exc, type_)


def plugin_env(config: KernelConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the plugin manager reads, with the config's allow / block lists applied on top."""
    env = dict(os.environ if environ is None else environ)
    if config.plugins is not None:
        env["NEXUSKV_PLUGINS"] = ",".join(config.plugins)
    if config.disable_plugins:
        extra = [n for n in env.get("NEXUSKV_DISABLE_PLUGINS", "").split(",") if n.strip()]
        env["NEXUSKV_DISABLE_PLUGINS"] = ",".join([*extra, *config.disable_plugins])
    return env
