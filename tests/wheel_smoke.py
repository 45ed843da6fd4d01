"""The released wheels at work: run by `make test-dist` with a venv's python that holds only what `make dist` built.

That venv was made without a compiler on PATH and holds the kernel, the native plugin, the disk tier and the
sidecar as installed wheels (no editable install, no checkout on `sys.path`: this script is run by path from a
scratch directory). It checks what a user of the release relies on first:

1. `nexuskv --version` is the release's version; `nexuskv plugins` lists the native keyer and matcher (active),
   the disk tier and the sidecar, with no plugin problem.
2. `nexuskv demo` runs on the policies the wheel ships.
3. State one kernel commits to the disk tier is planned, loaded and verified by the next kernel on that directory,
   and refused under another secret.
4. `nexuskv serve` answers a tenant's plan over HTTP and stops on SIGTERM.

Usage: `python -P wheel_smoke.py VERSION PYTHON` (`-P`: this script's folder, tests/, stays off `sys.path`); exit
0 when all hold, the failing check's message otherwise.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent
NEXUSKV = str(BIN / "nexuskv")
SECRET = bytes(range(32))


def check(ok: bool, what: str) -> None:
    """Stop with `what` when a check fails; print it when it holds."""
    if not ok:
        sys.exit(f"wheel smoke test FAILED: {what}")
    print(f"ok   {what}")


def run(*args: str) -> str:
    """A `nexuskv` command's stdout; its stderr in the failure message when it exits non-zero."""
    res = subprocess.run([NEXUSKV, "--log-level", "warning", *args], capture_output=True, text=True, timeout=300)
    check(res.returncode == 0, f"nexuskv {' '.join(args)} exits 0 (stderr: {res.stderr.strip()[-2000:]})")
    return res.stdout


def installed_from_wheels(version: str) -> None:
    import nexuskv
    import nexuskv_native

    check(nexuskv.__version__ == version, f"nexuskv.__version__ is {version} (got {nexuskv.__version__})")
    check(run("--version").split()[-1] == version, f"nexuskv --version says {version}")
    for module in (nexuskv, nexuskv_native):
        where = Path(module.__file__).resolve()
        check("site-packages" in where.parts, f"{module.__name__} is imported from the venv, not a checkout: {where}")
    native = list(Path(nexuskv_native.__file__).parent.glob("_native.*.so"))
    check(len(native) == 1, f"the native plugin's compiled module came in its wheel: {[p.name for p in native]}")


def plugins_listed() -> None:
    listed = json.loads(run("plugins", "--json"))
    by_name = {p["name"]: p for p in listed["plugins"]}
    hooks = set(by_name.get("native", {}).get("hooks", ()))
    check({"nexuskv_keyer", "nexuskv_matcher"} <= hooks, f"nexuskv plugins lists the native keyer and matcher: {hooks}")
    check(listed["active"]["keyer"].startswith("NativeKeyer") and listed["active"]["matcher"].startswith("NativeIndex"),
          f"the native keyer and matcher are the active ones: {listed['active']}")
    check({"disk", "sidecar"} <= set(by_name), f"nexuskv plugins lists the disk tier and sidecar: {sorted(by_name)}")
    check(not listed["problems"], f"no plugin problem: {listed['problems']}")
    print(run("plugins"))


def request(request_id: str, tokens: list[int]):
    """A chat tenant's request for a tiny dense model, pages of 16 tokens."""
    from nexuskv import Layout, ModelIdentity, Request, StateGroup, StateKind, TokenizerIdentity

    layout = Layout(groups=[StateGroup(kind=StateKind.DENSE, layers=2, kv_heads=2, head_dim=64)], page_size=16)
    return Request(request_id=request_id, tenant="chat", model=ModelIdentity(name="tiny", revision="r1"),
                   tokenizer=TokenizerIdentity(name="tiny-bpe"), layout=layout, token_ids=tokens)


def state_survives_on_disk(tmp: Path) -> None:
    from nexuskv import Kernel, KernelConfig, PlanAction

    def kernel(secret: bytes) -> Kernel:
        tier = {"store": "disk", "path": str(tmp / "tier"), "capacity_bytes": "64MiB"}
        return Kernel(KernelConfig(node="wheel", tiers={"disk": tier}, deadline_ms=1000.0), secret=secret)

    rng = random.Random(7)
    req = request("r1", [rng.randrange(32000) for _ in range(16 * 64)])
    with kernel(SECRET) as k:
        keys = k.keys(req)
        payloads = [rng.randbytes(16 * 1024) for _ in keys]
        k.commit(req, payloads, keys=keys)
        check(k.flush(30), "the first kernel writes every block to the disk tier")
    with kernel(SECRET) as k:
        plan = k.plan(req)
        check(plan.action is PlanAction.MATERIALIZE and plan.tokens_reused > 0,
              f"the next kernel plans a load from disk: {plan.action.value} {plan.tokens_reused} tokens {plan.reasons}")
        got = k.materialize(plan, req)
        blocks = plan.tokens_reused // 16
        check(got.complete and all(bytes(got.states[(b, 0)].payload) == payloads[b] for b in range(blocks)),
              f"it loads the {blocks} blocks it planned, byte for byte, verified")
    with kernel(bytes(32)) as k:
        plan = k.plan(req)
        check(plan.tokens_reused == 0, f"a kernel under another secret reuses nothing: {plan.action.value}")


def sidecar_serves(tmp: Path) -> None:
    from nexuskv import PlanAction
    from nexuskv_sidecar import SidecarClient

    out = run("serve-token", "chat")
    token = re.search(r"token: (\S+)", out).group(1)
    (tmp / "kernel.toml").write_text('node = "side"\ndeadline_ms = 1000.0\n')
    (tmp / "sidecar.toml").write_text('kernel = "kernel.toml"\nport = 0\n' + out[out.index("\n[auth]\n") + 1:])
    proc = subprocess.Popen([NEXUSKV, "--log-format", "json", "serve", str(tmp / "sidecar.toml")],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "NEXUSKV_SECRET": "ab" * 32})
    try:
        url = next((m.group(1) for line in proc.stderr if (m := re.match(r"serving (http://\S+)", line))), None)
        check(url is not None, "nexuskv serve says where it serves")
        with SidecarClient(url, token, timeout_s=30) as client:
            plan = client.plan(request("s1", list(range(64))))
        check(plan.action in (PlanAction.RECOMPUTE, PlanAction.SKIP) and plan.tokens_total == 64
              and client.fail_opens == 0, f"the sidecar plans a tenant's request: {plan.action.value}")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        proc.stderr.close()
    check(code == 0, f"nexuskv serve stops on SIGTERM with exit 0 (got {code})")


def main() -> None:
    from nexuskv import configure_logging

    configure_logging(level="error")  # a kernel under another secret warns of every file it discards
    version, python = sys.argv[1:3]
    running = "{}.{}".format(*sys.version_info[:2])
    check(running == python, f"this is Python {python} ({sys.version.split()[0]})")
    check(not any(Path(p).resolve() == Path(__file__).resolve().parent for p in sys.path if p),
          "the checkout's tests/ is not on sys.path")
    installed_from_wheels(version)
    plugins_listed()
    demo = run("demo")
    check("== 6. Plans" in demo, "nexuskv demo runs on the policies the wheel ships")
    with tempfile.TemporaryDirectory() as tmp:
        state_survives_on_disk(Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        sidecar_serves(Path(tmp))
    print(f"the wheels of nexuskv {version} work on Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
