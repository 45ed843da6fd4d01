"""The `transformers` connector factory: a connector over a tiny random-weight model, built on demand.

torch and transformers are imported when a connector is made, not when the plugin loads (the CLI stays fast).
"""

from __future__ import annotations

from typing import Any

__all__ = ["connector"]


def connector(kernel: Any, *, model: str = "dense", size: str = "test", **options: Any) -> Any:
    """`TransformersConnector(kernel, build_model(model, size=size), **options)`."""
    from nexuskv_transformers.connector import TransformersConnector
    from nexuskv_transformers.models import build_model

    return TransformersConnector(kernel, build_model(model, size=size), **options)
