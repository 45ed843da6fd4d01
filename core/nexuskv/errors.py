"""The kernel's exception hierarchy: every error NexusKV raises on purpose derives from `NexusKVError`.

Each error carries enough context (field path, file, rule, plugin name) to be acted on without a debugger.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Iterable


class NexusKVError(Exception):
    """Base class of every error NexusKV raises on purpose."""


class ContractError(NexusKVError):
    """A contract dict (descriptor, request, plan, profile) does not match its schema.

    `problems` lists `(path, message)` pairs, every one found, in path order.
    """

    def __init__(self, contract: str, problems: list[tuple[str, str]]) -> None:
        self.contract = contract
        self.problems = problems
        lines = "; ".join(f"{path}: {msg}" for path, msg in problems)
        super().__init__(f"invalid {contract}: {lines}")


class SchemaVersionError(ContractError):
    """A contract dict names a `schema_version` this kernel does not speak."""

    def __init__(self, contract: str, got: object, supported: int) -> None:
        self.got = got
        self.supported = supported
        super().__init__(
            contract,
            [("schema_version", f"version {got!r} is not supported (this kernel speaks {supported})")],
        )


class ConfigError(NexusKVError):
    """A configuration value or file is missing or malformed."""


class PluginError(NexusKVError):
    """A plugin could not be loaded, or misbehaved in a way the kernel cannot absorb."""


class ChecksumError(NexusKVError):
    """A payload does not match the checksum of its descriptor."""


class DeadlinePassed(NexusKVError):
    """A plan's deadline passed during a stage (keys, match, ...); the read path answers `recompute`."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


def check_deadline(deadline: float | None, stage: str) -> None:
    """Raise `DeadlinePassed(stage)` once the `time.perf_counter()` value `deadline` has passed (None: never)."""
    if deadline is not None and time.perf_counter() > deadline:
        raise DeadlinePassed(stage)


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `candidates` to a mistyped `name`, or "" when none is close.

    The one suggestion of every "unknown ..." message: CEL names, contract fields, policy rule kinds.
    """
    close = difflib.get_close_matches(name, sorted(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
