"""`nexuskv status [--watch] URL...`: the state of running kernels, read from their `/status` endpoints.

Each URL is a kernel's metrics endpoint (`metrics_port`: `http://127.0.0.1:PORT`), or `--config F` names a kernel
config with a fixed `metrics_port`. The view (rich, the `status` extra) shows per node its tiers (fill, hit
ratio), links, breakers, writer and prefetch queues, policy revision and last decisions; `--watch` refreshes it
until Ctrl-C; `--json` prints each node's raw document as a JSON line. A node that does not answer is one line,
`unreachable: URL: why`, and the exit status is 1. `cli/commands.py` adds the command with `add_status_commands`.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import click

__all__ = ["add_status_commands", "fetch_status", "status_url"]

_DECIDING = ("reuse ", "recompute", "fail-open", "policy", "shared by")  # the reasons that say why, not what
_BREAKER_STYLE = {"closed": "green", "open": "bold red", "half-open": "yellow"}


def status_url(target: str, sidecar: bool = False) -> str:
    """The `/status` URL of a kernel given as `host:port`, `http://host:port` or the status URL itself.

    `sidecar`: the target is a NexusKV sidecar, whose status is `/v1/status` (an operator token reads it).
    """
    url = target if "://" in target else f"http://{target}"
    url = url.split("?", 1)[0].rstrip("/")  # the query is the view's own (`decisions=`)
    if url.endswith("/status"):
        return url
    return f"{url}/v1/status" if sidecar else f"{url}/status"


def _config_url(path: str) -> str:
    from nexuskv.contracts.config import KernelConfig

    cfg = KernelConfig.from_toml(path)
    if not cfg.metrics_port:
        raise click.UsageError(f"{path}: no fixed metrics_port (0 or unset): pass the kernel's URL instead")
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(cfg.metrics_host, cfg.metrics_host)
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{host}:{cfg.metrics_port}"


def fetch_status(url: str, decisions: int = 10, timeout: float = 2.0,
                 token: str | None = None) -> tuple[dict[str, Any] | None, str]:  # fmt: skip
    """(the node's status document, "") or (None, why it could not be read).

    With `token`, the request carries it (a sidecar's `/v1/status` wants the operator's).
    """
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        req = urllib.request.Request(f"{url}?decisions={decisions}", headers=headers)
        opener = _NO_REDIRECTS if token else urllib.request.urlopen  # a token never follows a redirect elsewhere
        with opener(req, timeout=timeout) as resp:
            return json.loads(resp.read()), ""
    except urllib.error.HTTPError as exc:
        return None, f"HTTP {exc.code} {exc.reason}{_hint(url, exc.code, token, timeout)}"
    except urllib.error.URLError as exc:
        return None, str(exc.reason)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a timeout, a reset, a cut answer, not JSON
        return None, f"{type(exc).__name__}: {exc}"


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Answers a redirect with its own HTTP error instead of following it (with the token) to another URL."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects).open


def _hint(url: str, code: int, token: str | None, timeout: float) -> str:
    """What the URL is, when it is not what was asked for: a sidecar asked for a kernel's status, or a bad token."""
    if code in (401, 403):
        return " (a sidecar's status needs its operator token: --token or NEXUSKV_TOKEN)"
    if code == 404 and token:
        return " (not a sidecar? a kernel's metrics port is read without --token / NEXUSKV_TOKEN)"
    if code != 404:
        return ""
    base = url.removesuffix("/status")
    try:
        with urllib.request.urlopen(f"{base}/healthz", timeout=timeout) as resp:
            doc = json.loads(resp.read(65536))
    except (OSError, ValueError, http.client.HTTPException):
        return " (not a kernel's metrics endpoint: give the kernel's metrics_port URL)"
    if isinstance(doc, dict) and "node" in doc:
        return (" (this is a NexusKV sidecar: read its status with its operator token, --token or NEXUSKV_TOKEN, "
                "or give the kernel's metrics_port URL)")  # fmt: skip
    return " (not a kernel's metrics endpoint: give the kernel's metrics_port URL)"


def _fetch_all(urls: list[str], decisions: int,
               tokens: Mapping[str, str] | None = None) -> list[tuple[str, dict[str, Any] | None, str]]:  # fmt: skip
    """Every URL's status; `tokens[url]` is sent to that URL alone (the sidecars named on the command line)."""
    tokens = tokens or {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(urls), 16)) as pool:
        got = list(pool.map(lambda u: fetch_status(u, decisions, token=tokens.get(u)), urls))
    return [(u, doc, why) for u, (doc, why) in zip(urls, got, strict=True)]


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _node_view(url: str, doc: dict[str, Any]) -> Any:
    """One node's panel: a summary line, then tiers, links, breakers, queues and the last decisions."""
    from functools import partial

    from rich import box
    from rich.columns import Columns
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Column
    from rich.table import Table as RichTable
    from rich.text import Text

    def table(*headers: str, title: str) -> RichTable:  # compact, and cells never wrap
        cols = [Column(h, no_wrap=True, overflow="ellipsis", justify="left" if i == 0 else "right")
                for i, h in enumerate(headers)]  # fmt: skip
        return RichTable(*cols, title=title, box=box.SIMPLE_HEAD, title_justify="left", title_style="bold",
                         padding=(0, 1), show_edge=False)  # fmt: skip

    plans = doc.get("plans", {})
    fail_open = sum(plans.get("fail_open", {}).values())
    reused, recomputed = plans.get("tokens_reused", 0), plans.get("tokens_recomputed", 0)
    head = Text.assemble(
        ("epoch ", "dim"), str(doc.get("epoch")), ("  policy ", "dim"), doc.get("policy_revision") or "(none)",
        ("  control plane ", "dim"), ("ok", "green") if doc.get("control_ok") else ("DOWN", "bold red"),
        ("  plans ", "dim"), str(plans.get("total", 0)), ("  fail-open ", "dim"),
        (str(fail_open), "bold red" if fail_open else ""), ("  reuse lost ", "dim"),
        f"{sum(r.get('lost_gain_ms', 0) for r in doc.get('lost_gain', {}).values()):.0f} ms",
        ("  tokens reused ", "dim"),
        _pct(reused / (reused + recomputed) if reused + recomputed else None))  # fmt: skip
    tiers = table("tier", "capacity", "used", "fill", "hits", "misses", "hit%", "evicted", "bad", title="tiers")
    for name, t in doc.get("tiers", {}).items():
        tiers.add_row(name, _size(t.get("capacity_bytes")), _size(t.get("used_bytes")), _pct(t.get("fill")),
                      str(t.get("hits", 0)), str(t.get("misses", 0)), _pct(t.get("hit_ratio")),
                      str(t.get("evictions", 0)), str(t.get("quarantined", 0)))  # fmt: skip
    links = table("link", "read", "spans", "bandwidth", "latency", title="links")
    for name, ln in doc.get("links", {}).items():
        bw = ln.get("bandwidth_bytes_per_s")
        lat = ln.get("latency_ms")
        links.add_row(name, _size(ln.get("read_bytes")), str(ln.get("transfers", 0)),
                      f"{_size(bw)}/s" if bw is not None else "-", f"{lat:.3f} ms" if lat is not None else "-")
    breakers = table("breaker", "state", "trips", "last error", title="breakers")
    for name, b in doc.get("breakers", {}).items():
        state = b.get("state", "?")
        breakers.add_row(name, Text(state, _BREAKER_STYLE.get(state, "")), str(b.get("trips", 0)),
                         str(b.get("last_error", ""))[:40])  # fmt: skip
    w, p = doc.get("writer", {}), doc.get("prefetch", {})
    queues = table("queue", "depth", "bytes", "fill", "done", "refused", "failed", title="queues")
    queues.add_row("writer", str(w.get("items", 0)), _size(w.get("bytes", 0)), _pct(w.get("fill")),
                   str(w.get("written", 0)), str(w.get("refused", 0)), str(w.get("failed", 0)))
    queues.add_row("prefetch", str(p.get("queued", 0) + p.get("running", 0)),
                   _size(sum(p.get("inflight_bytes", {}).values())),
                   _pct((p.get("queued", 0) + p.get("running", 0)) / p["max_tasks"] if p.get("max_tasks") else None),
                   str(p.get("done", 0)), str(p.get("refused", 0) + p.get("expired", 0)), str(p.get("failed", 0)))
    recent = doc.get("decisions", {}).get("recent", [])
    last = table("request", "tenant", "action", "reused", "plan ms", "rules / why", title="last decisions")
    last.expand, last.columns[-1].justify, last.columns[-1].ratio = True, "left", 1  # the reason takes what is left
    for d in reversed(recent):  # newest first
        reasons = d.get("reasons") or [""]
        why = ", ".join(d.get("rules") or []) or next((r for r in reasons if r.startswith(_DECIDING)), reasons[-1])
        action = Text(d.get("action", "?"), "bold red" if d.get("fallback") else "")
        last.add_row(str(d.get("request_id")), str(d.get("tenant")), action,
                     f"{d.get('tokens_reused', 0)}/{d.get('tokens_total', 0)}", f"{d.get('plan_ms', 0):.3f}",
                     why)  # fmt: skip
    title = f"[bold]{doc.get('node', '?')}[/bold]  {url.removesuffix('/status')}"
    side = partial(Columns, padding=(0, 3))  # side by side where the terminal is wide enough, else one under another
    return Panel(Group(head, side([tiers, links]), side([queues, breakers]), last), title=title, title_align="left")


def _view(results: list[tuple[str, dict[str, Any] | None, str]]) -> Any:
    from rich.console import Group
    from rich.text import Text

    parts = [(_node_view(url, doc) if doc is not None else Text(f"unreachable: {url}: {why}", style="bold red"))
             for url, doc, why in results]  # fmt: skip
    parts.append(Text(time.strftime("updated %H:%M:%S"), style="dim"))
    return Group(*parts)


def add_status_commands(cli: click.Group) -> None:
    """Add `nexuskv status` to the command line."""

    @cli.command("status")
    @click.argument("urls", nargs=-1, metavar="URL...")
    @click.option("--config", "configs", multiple=True, type=click.Path(dir_okay=False, exists=True),
                  help="A kernel config with a fixed metrics_port (repeatable).")
    @click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
    @click.option("--interval", type=click.FloatRange(min=0.05), default=2.0, show_default=True,
                  help="Seconds between refreshes with --watch.")
    @click.option("--count", type=click.IntRange(min=1), default=None,
                  help="With --watch: stop after this many refreshes.")
    @click.option("--decisions", type=click.IntRange(min=0), default=8, show_default=True,
                  help="How many of the last decisions to show.")
    @click.option("--json", "as_json", is_flag=True, help="Print each node's raw /status document (JSON lines).")
    @click.option("--token", envvar="NEXUSKV_TOKEN", default=None,
                  help="A sidecar's operator token: URL is then a sidecar, read at /v1/status (env NEXUSKV_TOKEN).")
    def status_cmd(urls: tuple[str, ...], configs: tuple[str, ...], watch: bool, interval: float, count: int | None,
                   decisions: int, as_json: bool, token: str | None) -> None:  # fmt: skip
        """Show running kernels: tiers, links, breakers, queues, policy revision, last decisions.

        URL is a kernel's metrics endpoint, e.g. http://127.0.0.1:9400 (the kernel's `metrics_port`), or with
        --token a sidecar's URL (`nexuskv serve`).
        """
        named = [status_url(u, sidecar=bool(token)) for u in urls]
        targets = named + [status_url(_config_url(c)) for c in configs]
        tokens = dict.fromkeys(named, token) if token else {}  # a kernel from --config never gets the token
        if not targets:
            raise click.UsageError("name at least one kernel: URL (http://127.0.0.1:PORT) or --config FILE")
        if as_json:
            ok = True
            try:
                for i in range((count or sys.maxsize) if watch else 1):
                    if i:
                        time.sleep(interval)
                    for url, doc, why in _fetch_all(targets, decisions, tokens):
                        ok = ok and doc is not None
                        if doc is None:
                            click.echo(f"unreachable: {url}: {why}", err=True)
                        else:
                            click.echo(json.dumps(doc))
            except KeyboardInterrupt:
                return
            sys.exit(0 if ok or watch else 1)
        try:
            from rich.console import Console
            from rich.live import Live
        except ImportError:
            raise click.ClickException("nexuskv status needs rich: pip install 'nexuskv[status]'") from None
        console = Console()
        if not watch:
            results = _fetch_all(targets, decisions, tokens)
            console.print(_view(results))
            sys.exit(0 if all(doc is not None for _, doc, _ in results) else 1)
        shown = 0
        try:
            with Live(_view(_fetch_all(targets, decisions, tokens)), console=console, auto_refresh=False) as live:
                shown = 1
                while count is None or shown < count:
                    time.sleep(interval)
                    live.update(_view(_fetch_all(targets, decisions, tokens)), refresh=True)
                    shown += 1
        except KeyboardInterrupt:
            pass
