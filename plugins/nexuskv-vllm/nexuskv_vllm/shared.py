"""One kernel per vLLM engine, shared by its scheduler-side and worker-side connectors.

vLLM builds the connector twice, once per role, in the engine-core process when the executor is `uni`. Both must
plan, load and commit through the same kernel (the same index, writer and decision log), so the kernel is looked
up by the engine's `engine_id`. At interpreter exit every kernel is flushed (disk writes land) and closed.
"""

from __future__ import annotations

import atexit
import threading
from pathlib import Path

from nexuskv import Kernel, get_logger

__all__ = ["acquire", "release"]

log = get_logger(__name__)

_lock = threading.Lock()
_kernels: dict[str, tuple[Kernel, int]] = {}


def acquire(engine_id: str, config: str | Path) -> Kernel:
    """The kernel of engine `engine_id` (built from `config` on first use); pair every call with `release`."""
    with _lock:
        kernel, users = _kernels.get(engine_id, (None, 0))
        if kernel is None:
            kernel = Kernel.from_config(config)
            log.info("kernel started for vLLM engine", engine_id=engine_id, config=str(config))
        _kernels[engine_id] = (kernel, users + 1)
        return kernel


def release(engine_id: str, flush_timeout_s: float = 30.0) -> None:
    """Drop one user of the engine's kernel; the last one flushes the writer and closes the kernel."""
    with _lock:
        kernel, users = _kernels.get(engine_id, (None, 0))
        if kernel is None:
            return
        if users > 1:
            _kernels[engine_id] = (kernel, users - 1)
            return
        del _kernels[engine_id]
    kernel.flush(flush_timeout_s)
    kernel.close()


@atexit.register
def _close_all() -> None:
    for engine_id in list(_kernels):
        with _lock:
            entry = _kernels.pop(engine_id, None)
        if entry is not None:
            entry[0].flush(30.0)
            entry[0].close()
