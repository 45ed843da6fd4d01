"""One kernel per vLLM engine and process, shared by the connectors of that process.

vLLM builds the connector twice, once per role. With the `uni` executor both live in the engine-core process and
must plan, load and commit through the same kernel (the same index, writer and decision log), so the kernel is
looked up by the engine's `engine_id`. With `mp` the scheduler side lives in the engine-core process and each
worker rank in a process of its own: each builds its own kernel, and `process_config` gives each process tier
directories of its own (`<path>/scheduler`, `<path>/rank-<r>-of-<n>`): a disk tier's directory belongs to one
process (its start-up scan deletes what an interrupted writer left). At interpreter exit every kernel is flushed
(disk writes land) and closed.
"""

from __future__ import annotations

import atexit
import threading
from pathlib import Path

from attrs import evolve

from nexuskv import ConfigError, Kernel, KernelConfig, get_logger

__all__ = ["acquire", "process_config", "release"]

log = get_logger(__name__)

_lock = threading.Lock()
_kernels: dict[str, tuple[Kernel, int]] = {}


def process_config(config: str | Path, part: str | None) -> KernelConfig:
    """The kernel config of one process of an engine.

    `config`, with each tier's data directory (`path`, `*_dir`) in a subdirectory `part` of its own (None: as
    configured, for the `uni` executor's single process).
    """
    cfg = KernelConfig.from_toml(config)
    if part is None:
        return cfg
    tiers = {name: {k: str(Path(v) / part) if isinstance(v, str) and (k == "path" or k.endswith("_dir")) else v
                    for k, v in opts.items()} for name, opts in cfg.tiers.items()}  # fmt: skip
    return evolve(cfg, tiers=tiers)


def acquire(engine_id: str, config: str | Path, part: str | None = None) -> Kernel:
    """The kernel of engine `engine_id` in this process; pair every call with `release`.

    Built on first use from `config`, its tier directories in `part` (see `process_config`).
    """
    with _lock:
        kernel, users = _kernels.get(engine_id, (None, 0))
        if kernel is None:
            try:
                kernel = Kernel(process_config(config, part))
            except ConfigError as exc:
                raise exc if str(exc).startswith(f"{config}:") else ConfigError(f"{config}: {exc}") from None
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
