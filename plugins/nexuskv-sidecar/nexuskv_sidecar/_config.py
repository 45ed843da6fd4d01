"""Private: the sidecar's config file (`nexuskv serve CONFIG`): where to listen, which kernel, whose tokens.

```toml
kernel = "kernel.toml"        # the kernel config, relative to this file
host = "127.0.0.1"
port = 8470
workers = 2                   # HTTP worker processes (default 1: everything in one process)
[auth]                        # tenant -> tokens that may act for it; "*" is the operator (status, metrics, all)
chat = ["sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
rag  = ["env:NEXUSKV_RAG_TOKEN"]
```

A token is given as its SHA-256 (`sha256:<64 hex>`, what `nexuskv serve-token` prints), or read at start from an
environment variable (`env:NAME`) or a file (`file:PATH`, relative to this file). Plain tokens in the file are
refused: a config file is copied and read by more people than a secret should be. Every problem is a `ConfigError`
naming the file and the key.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attrs import define, field

from nexuskv import ConfigError

OPERATOR = "*"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEYS = {"kernel", "host", "port", "auth", "max_body_bytes", "max_plan_body_bytes", "max_tokens", "max_deadline_ms",
         "tenant_concurrency", "oversize_hold_s", "oversize_holds_per_token", "workers"}


def digest(token: str) -> bytes:
    """The SHA-256 of a token: what the config holds and what a request's bearer token is compared by."""
    return hashlib.sha256(token.encode()).digest()


@define(frozen=True)
class SidecarConfig:
    """Where the sidecar listens, the kernel config it runs, and token digests -> tenant."""

    kernel: str | None = None
    host: str = "127.0.0.1"
    port: int = 8470
    tokens: Mapping[bytes, str] = field(factory=dict)
    max_body_bytes: int = 64 << 20
    max_plan_body_bytes: int = 4 << 20
    max_tokens: int = 1 << 19
    max_deadline_ms: float = 1000.0
    tenant_concurrency: int = 2
    oversize_hold_s: float = 5.0
    oversize_holds_per_token: int = 8
    workers: int = 1  # HTTP processes; above 1 they ask this process's kernel for every decision

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> SidecarConfig:
        """Read a sidecar config file; a `ConfigError` names the file and key of any problem."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{p}: no such sidecar config file") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: {exc}") from None
        return cls.from_mapping(data, origin=str(p), base=p.parent)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], origin: str = "<sidecar>",
                     base: Path | None = None) -> SidecarConfig:  # fmt: skip
        """Build from a mapping (a parsed file); relative paths are relative to `base`."""
        base = base or Path.cwd()
        unknown = sorted(set(data) - _KEYS)
        if unknown:
            raise ConfigError(f"{origin}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})")
        kernel = data.get("kernel")
        if kernel is not None and not isinstance(kernel, str):
            raise ConfigError(f"{origin}: kernel: expected a path string, got {type(kernel).__name__}")
        host = _typed(data, "host", str, "127.0.0.1", origin)
        port = _typed(data, "port", int, 8470, origin)
        if not 0 <= port < 65536:
            raise ConfigError(f"{origin}: port: {port} is not a TCP port (0 picks a free one)")
        max_body = _typed(data, "max_body_bytes", int, 64 << 20, origin)
        if max_body < 1024:
            raise ConfigError(f"{origin}: max_body_bytes: {max_body} is too small to take any request (at least 1024)")
        limits = {
            "max_plan_body_bytes": _typed(data, "max_plan_body_bytes", int, 4 << 20, origin),
            "max_tokens": _typed(data, "max_tokens", int, 1 << 19, origin),
            "max_deadline_ms": float(_typed(data, "max_deadline_ms", (int, float), 1000.0, origin)),
            "tenant_concurrency": _typed(data, "tenant_concurrency", int, 2, origin),
            "oversize_hold_s": float(_typed(data, "oversize_hold_s", (int, float), 5.0, origin)),
            "oversize_holds_per_token": _typed(data, "oversize_holds_per_token", int, 8, origin),
        }
        for key, floor in (("max_plan_body_bytes", 1024), ("max_tokens", 1), ("max_deadline_ms", 0.001),
                           ("tenant_concurrency", 1), ("oversize_hold_s", 0),
                           ("oversize_holds_per_token", 0)):  # fmt: skip
            if limits[key] < floor:
                raise ConfigError(f"{origin}: {key}: {limits[key]} is below {floor}")
        if not limits["oversize_hold_s"] <= 3600:  # a hold is a socket held: bounded in time too (inf, NaN refused)
            raise ConfigError(f"{origin}: oversize_hold_s: {limits['oversize_hold_s']} is not at most 3600")
        workers = _typed(data, "workers", int, 1, origin)
        if not 1 <= workers <= 64:
            raise ConfigError(f"{origin}: workers: {workers} is not between 1 and 64")
        auth = data.get("auth", {})
        if not isinstance(auth, Mapping):
            raise ConfigError(f"{origin}: auth: expected a table of tenant = [tokens], got {type(auth).__name__}")
        tokens: dict[bytes, str] = {}
        for tenant, refs in auth.items():
            if not isinstance(refs, list) or not refs:
                raise ConfigError(f"{origin}: auth.{tenant}: expected a non-empty list of tokens")
            for i, ref in enumerate(refs):
                d = _resolve(ref, f"{origin}: auth.{tenant}[{i}]", base)
                if d in tokens and tokens[d] != tenant:
                    raise ConfigError(f"{origin}: auth.{tenant}[{i}]: the same token already acts for {tokens[d]!r}")
                tokens[d] = tenant
        kernel_path = str(base / kernel) if kernel and not Path(kernel).is_absolute() else kernel
        return cls(kernel=kernel_path, host=host, port=port, tokens=tokens, max_body_bytes=max_body, workers=workers,
                   **limits)  # fmt: skip


def _typed(data: Mapping[str, Any], key: str, tp: type | tuple[type, ...], default: Any, origin: str) -> Any:
    value = data.get(key, default)
    if not isinstance(value, tp) or isinstance(value, bool):
        want = " or ".join(t.__name__ for t in tp) if isinstance(tp, tuple) else tp.__name__
        raise ConfigError(f"{origin}: {key}: expected {want}, got {type(value).__name__}")
    return value


def _resolve(ref: Any, where: str, base: Path) -> bytes:
    """A token reference -> its digest (sha256:HEX as is; env:NAME and file:PATH read and hashed)."""
    if not isinstance(ref, str):
        raise ConfigError(f"{where}: expected a string, got {type(ref).__name__}")
    kind, _, rest = ref.partition(":")
    if kind == "sha256":
        if not _HEX64.fullmatch(rest):
            raise ConfigError(f"{where}: sha256: needs 64 lowercase hex digits (`nexuskv serve-token` prints one)")
        return bytes.fromhex(rest)
    if kind == "env":
        value = os.environ.get(rest, "")
        if not value.strip():
            raise ConfigError(f"{where}: environment variable {rest!r} is not set (or empty)")
        return digest(value.strip())
    if kind == "file":
        path = Path(rest) if Path(rest).is_absolute() else base / rest
        try:
            value = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read token file {path}: {exc.strerror or exc}") from None
        if not value:
            raise ConfigError(f"{where}: token file {path} is empty")
        return digest(value)
    raise ConfigError(f"{where}: a token is given as sha256:<hex>, env:NAME or file:PATH, not in plain text")
