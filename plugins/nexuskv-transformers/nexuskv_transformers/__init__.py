"""NexusKV's reference engine: tiny random-weight transformers models on CPU behind a kernel connector.

`build_model(kind)` makes a model of any state kind, `TransformersConnector(kernel, model)` serves requests
through a kernel (plan, restore, prefill the rest, commit), `calibrate` fits a cost profile on this machine.
"""

from __future__ import annotations

from nexuskv_transformers.calibrate import CalibrationReport, calibrate
from nexuskv_transformers.connector import MODES, Outcome, TransformersConnector
from nexuskv_transformers.engine import Engine, Prefill
from nexuskv_transformers.models import KINDS, SIZES, ReferenceModel, build_model
from nexuskv_transformers.state import StateCodec, StateMismatch

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
