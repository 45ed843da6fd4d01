"""NexusKV sidecar: the kernel's plan / route / commit / materialize / report over HTTP+JSON, and its clients.

`nexuskv serve CONFIG` runs it; `SidecarClient` is the Python client; `clients/rust` a dependency-free Rust one.
"""

from nexuskv_sidecar._config import SidecarConfig, digest
from nexuskv_sidecar.app import create_app
from nexuskv_sidecar.client import SidecarClient, SidecarError
from nexuskv_sidecar.openapi import openapi
from nexuskv_sidecar.server import Sidecar

__all__ = ["Sidecar", "SidecarClient", "SidecarConfig", "SidecarError", "create_app", "digest", "openapi"]
