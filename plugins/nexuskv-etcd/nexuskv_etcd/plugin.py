"""Entry point of the etcd control plane: `[control_plane] name = "etcd"` in the kernel config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexuskv import hookimpl
from nexuskv_etcd.plane import EtcdControlPlane

__all__ = ["nexuskv_control_plane"]


@hookimpl
def nexuskv_control_plane(config: Mapping[str, Any]) -> EtcdControlPlane | None:
    """An `EtcdControlPlane` when the config names `etcd` (keys: `endpoint`, `prefix`, `timeout_s`)."""
    if config.get("name") != "etcd":
        return None
    unknown = set(config) - {"name", "endpoint", "prefix", "timeout_s"}
    if unknown:
        raise ValueError(f"[control_plane] etcd: unknown keys {sorted(unknown)} "
                         "(known: endpoint, prefix, timeout_s)")  # fmt: skip
    return EtcdControlPlane(endpoint=str(config.get("endpoint", "127.0.0.1:2379")),
                            prefix=str(config.get("prefix", "nexuskv/")),
                            timeout_s=float(config.get("timeout_s", 1.0)))  # fmt: skip
