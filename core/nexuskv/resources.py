"""The files shipped beside the code (`policies/`, `schemas/`): in a checkout, or inside an installed wheel.

A checkout keeps them at the repository's root; the wheel carries copies as `nexuskv/_shipped/<name>` (the
`force-include` of pyproject.toml), so `nexuskv demo`, `nexuskv stress` and `nexuskv schema export --check` work
from an installed release as they do from the repository.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHIPPED", "shipped"]

SHIPPED = ("policies", "schemas")
"""What the wheel carries beside the package (the directory names at the repository's root)."""

_PACKAGE = Path(__file__).resolve().parent


def shipped(name: str) -> Path:
    """The directory `name` (one of `SHIPPED`): the wheel's copy when installed, the repository's in a checkout."""
    if name not in SHIPPED:
        raise ValueError(f"{name!r} is not shipped with nexuskv (shipped: {', '.join(SHIPPED)})")
    inside = _PACKAGE / "_shipped" / name
    if inside.is_dir():
        return inside
    checkout = _PACKAGE.parents[1] / name  # core/nexuskv -> the repository's root
    if _PACKAGE.parent.name == "core" and checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"nexuskv's {name}/ is neither in the installed package ({inside}) nor in a checkout")
