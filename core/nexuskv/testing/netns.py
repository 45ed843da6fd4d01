"""`NetNS`: a network namespace joined to this one by a veth pair whose outgoing rate a tbf qdisc limits.

A real shaped link for tests and benches on one machine: a process started with `prefix()` runs inside the
namespace and reaches (and is reached from) this one over the veth pair; `shape(rate)` limits what leaves the
namespace. Needs root and iproute2 (`NetNS.available()` says why not).
"""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["NetNS"]


class NetNS:
    """A network namespace joined to this one by a veth pair: `host_ip` here, `ns_ip` inside; `shape` limits it."""

    def __init__(self, name: str = "nxkv", subnet: str = "10.231.7") -> None:
        self.name, self.host_if, self.ns_if = name, f"{name}-h", f"{name}-n"
        self.host_ip, self.ns_ip = f"{subnet}.1", f"{subnet}.2"
        self.close()  # leftovers of an interrupted run
        for cmd in (["ip", "netns", "add", name],
                    ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
                    ["ip", "link", "set", self.ns_if, "netns", name],
                    ["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if],
                    ["ip", "link", "set", self.host_if, "up"],
                    ["ip", "netns", "exec", name, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if],
                    ["ip", "netns", "exec", name, "ip", "link", "set", self.ns_if, "up"],
                    ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"]):  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)

    @staticmethod
    def available() -> str:
        """"" when namespaces, veth and tbf can be used here, else why not."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "iproute2 (ip, tc) is not installed"
        probe = subprocess.run(["ip", "netns", "add", "nxkv-probe"], capture_output=True, text=True)
        if probe.returncode:
            return f"ip netns add failed: {probe.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", "nxkv-probe"], capture_output=True)
        return ""

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def shape(self, rate: str | None) -> None:
        """Limit what leaves the namespace to `rate` (tc syntax, e.g. "20mbit") with a tbf qdisc; None: no limit."""
        base = [*self.prefix(), "tc", "qdisc"]
        if rate is None:
            subprocess.run([*base, "del", "dev", self.ns_if, "root"], capture_output=True)
            return
        subprocess.run([*base, "replace", "dev", self.ns_if, "root", "tbf", "rate", rate, "burst", "64kb",
                        "latency", "400ms"], check=True, capture_output=True)  # fmt: skip

    def close(self) -> None:
        """Remove the namespace and the veth pair (either may already be gone)."""
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
