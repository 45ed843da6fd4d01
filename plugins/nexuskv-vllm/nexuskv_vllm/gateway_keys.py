"""The tenant gateway's keys file: which API key is which tenant, the salt key, the bounds on a request body.

The file (`NEXUSKV_GATEWAY_KEYS`, TOML) holds SHA-256 digests of the API keys, never the keys, and the secret the
gateway keys vLLM's `cache_salt` with:

    salt_key = "5f0c...64 hex digits..."   # secrets.token_hex(32): keys every tenant's vLLM cache salt
    max_body_bytes = 8388608               # optional
    body_timeout_s = 30                    # optional: a body not read in this long is refused (408)
    [keys.9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08]
    tenant = "acme"
    scope = "support"                      # optional
    admin = false                          # optional: true lets the key call vLLM's operator routes

A malformed file stops the server at start with the file and the problem (`ConfigError`).
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from pathlib import Path

from attrs import define

from nexuskv import ConfigError, Namespace

__all__ = ["Caller", "KeysFile", "key_digest", "tenant_salt"]

FIELDS = ("salt_key", "max_body_bytes", "body_timeout_s", "keys")


def tenant_salt(tenant: str, scope: str, client_salt: object, salt_key: bytes) -> str:
    """vLLM's `cache_salt` for a tenant's request: a MAC of its tenant, scope and the client's own salt.

    Keyed: knowing a tenant's name does not give its salt, so no route that passed a salt through unchanged could
    be aimed at another tenant's blocks in vLLM's cache.
    """
    h = hashlib.blake2b(digest_size=16, key=salt_key, person=b"nexuskv.gateway")
    for part in (tenant, scope, client_salt if isinstance(client_salt, str) else ""):
        h.update(part.encode() + b"\0")
    return f"nexuskv-{h.hexdigest()}"


def key_digest(key: str) -> str:
    """The SHA-256 hex digest of an API key, as the keys file lists it."""
    return hashlib.sha256(key.encode()).hexdigest()


@define(frozen=True)
class Caller:
    """Who an API key is: tenant, scope inside it, and whether it may call vLLM's operator routes."""

    tenant: str
    scope: str = ""
    admin: bool = False


class KeysFile:
    """The gateway's keys file, checked: API key digest -> `Caller`, the salt key, the body bounds."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            data = tomllib.loads(self.path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{self.path}: {exc}") from None
        unknown = set(data) - set(FIELDS)
        if unknown:
            raise ConfigError(f"{self.path}: unknown field(s) {sorted(unknown)} (have: {', '.join(FIELDS)})")
        self.salt_key = _salt_key(self.path, data.get("salt_key"))
        self.max_body_bytes = data.get("max_body_bytes", 8 << 20)
        if not isinstance(self.max_body_bytes, int) or not 0 < self.max_body_bytes <= 1 << 30:
            raise ConfigError(f"{self.path}: max_body_bytes must be an integer in (0, 1 GiB]")
        self.body_timeout_s = data.get("body_timeout_s", 30)
        if isinstance(self.body_timeout_s, bool) or not isinstance(self.body_timeout_s, int | float) or \
                not 0 < self.body_timeout_s <= 3600:  # fmt: skip
            raise ConfigError(f"{self.path}: body_timeout_s must be a number of seconds in (0, 3600]")
        self.keys: dict[str, Caller] = {}
        for digest, entry in (data.get("keys") or {}).items():
            self.keys[digest] = _caller(f"{self.path}: keys.{digest}", digest, entry)
        if not self.keys:
            raise ConfigError(f"{self.path}: no keys: every generation request would be refused")

    def salt(self, tenant: str, scope: str, client_salt: object) -> str:
        """`tenant_salt` under this file's salt key."""
        return tenant_salt(tenant, scope, client_salt, self.salt_key)

    def namespaces(self) -> dict[str, Namespace]:
        """vLLM `cache_salt` -> namespace of every tenant and scope in the file (requests without a client salt).

        What a router following the engines' KV events (`nexuskv_vllm_events.EngineResidency`) attributes their
        blocks with; a client's own salt makes another salt, whose blocks stay unattributed (never shared).
        """
        out = {}
        for tenant, scope in {(c.tenant, c.scope) for c in self.keys.values()}:
            salt = self.salt(tenant, scope, None)
            out[salt] = Namespace(tenant=tenant, scope=scope, cache_salt=salt)
        return out

    def caller(self, authorization: str | None) -> Caller | None:
        """Who a `Bearer <key>` header is; None for a missing or unknown key."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self.keys.get(key_digest(authorization.removeprefix("Bearer ").strip()))


def _salt_key(path: Path, value: object) -> bytes:
    if value is None:
        raise ConfigError(f"{path}: salt_key is missing: 64 hex digits or more, e.g. from "
                          "`python -c 'import secrets; print(secrets.token_hex(32))'`")  # fmt: skip
    try:
        key = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        key = b""
    if not 32 <= len(key) <= 64:
        raise ConfigError(f"{path}: salt_key must be 64 to 128 hex digits (32 to 64 bytes)")
    return key


def _caller(where: str, digest: str, entry: object) -> Caller:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ConfigError(f"{where}: not a SHA-256 hex digest (list key_digest(key), never the key)")
    if not isinstance(entry, dict) or set(entry) - {"tenant", "scope", "admin"}:
        raise ConfigError(f"{where}: a table with 'tenant' and optionally 'scope' and 'admin'")
    tenant, scope, admin = entry.get("tenant"), entry.get("scope", ""), entry.get("admin", False)
    if not isinstance(tenant, str) or not tenant or not isinstance(scope, str):
        raise ConfigError(f"{where}: 'tenant' must be a non-empty string, 'scope' a string")
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}: 'admin' must be true or false")
    return Caller(tenant, scope, admin)
