"""NexusKV shared-memory transport: payloads moved between processes of one host through POSIX shm, zero-copy.

`ShmStore` is the host-wide tier (segments owned by leases, reclaimed when their owner dies); `ShmTransport`
maps them into the reading process. `as_array` views a payload as a numpy array without copying.
"""

from __future__ import annotations

from typing import Any

from nexuskv_transport_shm.store import ShmStore
from nexuskv_transport_shm.transport import ShmTransport

__all__ = ["ShmStore", "ShmTransport", "as_array"]


def as_array(payload: memoryview | bytes, dtype: Any = "uint8", shape: tuple[int, ...] | None = None) -> Any:
    """A read-only numpy array over `payload` (no copy; needs numpy): a tensor view of a mapped segment."""
    import numpy as np

    arr = np.frombuffer(payload, dtype=dtype)
    return arr.reshape(shape) if shape is not None else arr
