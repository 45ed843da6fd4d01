"""A policy bundle: every file of a policy directory, under one content revision, as one unit to ship.

A bundle is what a fleet rollout publishes and what each node applies whole (or not at all). Its revision is a
content hash over the files' relative paths and texts, the same revision `Policies.revision` reports for the
directory it came from, so a node's reported revision names exactly the files it runs. `from_json` checks the
revision against the content: a bundle damaged or edited on the way is refused, never applied.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attrs import define, field

from nexuskv.errors import NexusKVError

__all__ = ["BundleError", "PolicyBundle", "bundle_revision", "policy_files"]

FORMAT = "nexuskv-policy-bundle/1"


class BundleError(NexusKVError):
    """A bundle could not be read, or its content does not match its revision."""


def bundle_revision(files: Mapping[str, str]) -> str:
    """The content revision of policy files (relative path -> text): 16 hex digits of a SHA-256."""
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(files[rel].encode()).digest())
    return h.hexdigest()[:16]


def policy_files(root: Path) -> list[Path]:
    """The files a policy directory consists of: `*.toml` at the top and `tenants/*.toml`, in load order."""
    return sorted(root.glob("*.toml")) + sorted((root / "tenants").glob("*.toml"))


@define(frozen=True)
class PolicyBundle:
    """Policy files by relative path (`default.toml`, `tenants/chat.toml`) with their content revision."""

    files: Mapping[str, str] = field(converter=lambda f: dict(sorted(f.items())))
    revision: str = ""
    created_at: float = 0.0  # when it was built (seconds since the epoch); not part of the revision
    note: str = ""  # what the publisher said about it (a commit message); not part of the revision

    def __attrs_post_init__(self) -> None:
        for rel in self.files:
            parts = Path(rel).parts
            if Path(rel).is_absolute() or ".." in parts or not rel.endswith(".toml") or len(parts) > 2 \
                    or (len(parts) == 2 and parts[0] != "tenants"):  # fmt: skip
                raise BundleError(f"bundle file {rel!r}: expected NAME.toml or tenants/NAME.toml")
        want = bundle_revision(self.files)
        if not self.revision:
            object.__setattr__(self, "revision", want)
        elif self.revision != want:
            raise BundleError(f"bundle revision {self.revision} does not match its content ({want}): "
                              "damaged or edited on the way")  # fmt: skip

    @classmethod
    def from_directory(cls, root: str | os.PathLike[str], note: str = "") -> PolicyBundle:
        """Every policy file of `root` (unreadable files are a `BundleError` naming the file)."""
        root = Path(root)
        if not root.is_dir():
            raise BundleError(f"{root}: no such policy directory")
        files: dict[str, str] = {}
        for path in policy_files(root):
            try:
                files[path.relative_to(root).as_posix()] = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise BundleError(f"{path}: cannot read: {exc}") from None
        if not files:
            raise BundleError(f"{root}: no policy files (expected default.toml, tenants/*.toml)")
        return cls(files, created_at=time.time(), note=note)

    def to_json(self) -> str:
        """The bundle as one JSON document (`from_json` reads it back and checks the revision)."""
        return json.dumps({"format": FORMAT, "revision": self.revision, "created_at": self.created_at,
                           "note": self.note, "files": dict(self.files)}, sort_keys=True)  # fmt: skip

    @classmethod
    def from_json(cls, text: str | bytes) -> PolicyBundle:
        """Read a bundle; a wrong format, missing fields or content that does not match the revision raise."""
        try:
            data: Any = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BundleError(f"bundle is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BundleError(f"not a policy bundle (format must be {FORMAT!r})")
        files, revision = data.get("files"), data.get("revision")
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise BundleError("bundle `files` must map relative paths to texts")
        if not isinstance(revision, str) or not revision:
            raise BundleError("bundle has no revision")
        created, note = data.get("created_at") or 0.0, data.get("note") or ""
        if isinstance(created, bool) or not isinstance(created, int | float) or not isinstance(note, str):
            raise BundleError("bundle `created_at` must be a number and `note` a string")
        return cls(files, revision, float(created), note)

    @classmethod
    def stored(cls, data: str | bytes, revision: str, where: str) -> PolicyBundle:
        """The bundle a channel stored as `revision` at `where`; damaged or another revision's is a `BundleError`."""
        try:
            bundle = cls.from_json(data)
        except BundleError as exc:
            raise BundleError(f"{where}: {exc}") from None
        if bundle.revision != revision:
            raise BundleError(f"{where}: holds revision {bundle.revision}, not {revision}")
        return bundle

    def write_to(self, root: str | os.PathLike[str]) -> Path:
        """Write the files under `root` (a directory `nexuskv policy check` / `test` can read); returns it."""
        root = Path(root)
        for rel, text in self.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return root
