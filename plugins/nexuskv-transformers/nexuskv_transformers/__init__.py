"""NexusKV's reference engine: tiny random-weight transformers models on CPU behind a kernel connector.

`build_model(kind)` makes a model of any state kind, `TransformersConnector(kernel, model)` serves requests
through a kernel (plan, restore, prefill the rest, commit), `calibrate` fits a cost profile on this machine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nexuskv_transformers.calibrate import CalibrationReport, calibrate
    from nexuskv_transformers.connector import MODES, Outcome, TransformersConnector
    from nexuskv_transformers.engine import Engine, Prefill
    from nexuskv_transformers.models import KINDS, SIZES, ReferenceModel, build_model
    from nexuskv_transformers.state import StateCodec, StateMismatch

# Imported on first use (PEP 562): loading the plugin (every `nexuskv` command, every kernel) must not import
# torch; only using the engine does.
_WHERE = {"CalibrationReport": "calibrate", "calibrate": "calibrate", "MODES": "connector", "Outcome": "connector",
          "TransformersConnector": "connector", "Engine": "engine", "Prefill": "engine", "KINDS": "models",
          "SIZES": "models", "ReferenceModel": "models", "build_model": "models", "StateCodec": "state",
          "StateMismatch": "state"}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'nexuskv_transformers' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"nexuskv_transformers.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "KINDS",
    "MODES",
    "SIZES",
    "CalibrationReport",
    "Engine",
    "Outcome",
    "Prefill",
    "ReferenceModel",
    "StateCodec",
    "StateMismatch",
    "TransformersConnector",
    "build_model",
    "calibrate",
]
