"""`nexuskv policy publish | rollout-status | rollback`: a fleet's policy rollout from the command line.

Each command talks to one policy channel: a shared directory (`--to DIR`) or etcd (`--etcd HOST:PORT`, with
the `nexuskv-etcd` plugin). `cli/commands.py` adds them to its `policy` group with `add_rollout_commands`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import click

from nexuskv.policy.bundle import BundleError, PolicyBundle
from nexuskv.policy.loader import Policies
from nexuskv.policy.serving.rollout import DirectoryChannel, PolicyChannel, describe

__all__ = ["add_rollout_commands"]


def _channel_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--prefix", default="nexuskv/", show_default=True,
                      help="With --etcd: the key prefix of the fleet (its control plane's `prefix`).")(fn)  # fmt: skip
    fn = click.option("--etcd", "etcd", metavar="HOST:PORT", default=None,
                      help="The channel is etcd (the fleet's control plane; needs nexuskv-etcd).")(fn)  # fmt: skip
    return click.option("--to", "to", metavar="SHARED_DIR", default=None, type=click.Path(file_okay=False),
                        help="The channel is a shared directory (a volume every node mounts).")(fn)  # fmt: skip


@contextmanager
def _channel(to: str | None, etcd: str | None, prefix: str, create: bool = False) -> Iterator[PolicyChannel]:
    if (to is None) == (etcd is None):
        raise click.UsageError("name the channel: --to SHARED_DIR or --etcd HOST:PORT (one of them)")
    if to is not None:
        channel: PolicyChannel = DirectoryChannel(to, create=create)
    else:
        try:
            from nexuskv_etcd.policy import EtcdPolicyChannel
        except ImportError as exc:
            raise click.ClickException(f"--etcd needs the etcd plugin: pip install nexuskv-etcd ({exc})") from None
        try:
            channel = EtcdPolicyChannel.connect(str(etcd), prefix=prefix)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    try:
        yield channel
    except (click.ClickException, BundleError):
        raise
    except Exception as exc:  # etcd not answering, a volume not mounted: one line, not a traceback
        raise click.ClickException(f"policy channel {_where(to, etcd, prefix)}: {describe(exc)}") from None
    finally:
        channel.close()


def _where(to: str | None, etcd: str | None, prefix: str) -> str:
    return str(to) if to is not None else f"etcd {etcd} {prefix}policy/"


def _age(seconds: float) -> str:
    s = max(0.0, seconds)
    return f"{s:.1f}s" if s < 60 else f"{s / 60:.0f}m" if s < 3600 else f"{s / 3600:.1f}h"


def add_rollout_commands(group: click.Group, functions: Callable[[], dict[str, Any]]) -> None:
    """Add `publish`, `rollout-status` and `rollback` to `group` (`functions()`: the plugins' CEL functions)."""

    def refuse_unless_loads(bundle: PolicyBundle, force: bool, directory: str | None = None) -> None:
        _, problems = Policies.check_bundle(bundle, functions())
        for p in problems:  # problems name `bundle:<revision>/<file>`: from a directory, name its files
            text = str(p)
            if directory is not None:
                text = text.replace(f"bundle:{bundle.revision}/", f"{Path(directory).as_posix()}/", 1)
            click.echo(text, err=True)
        if problems and not force:
            raise click.ClickException(f"revision {bundle.revision} does not load here ({len(problems)} problem(s)): "
                                       "not published (--force publishes it anyway)")  # fmt: skip
        if problems:
            click.echo(f"warning: publishing revision {bundle.revision} with {len(problems)} problem(s) (--force)",
                       err=True)  # fmt: skip

    def publish(channel: PolicyChannel, bundle: PolicyBundle, where: str) -> None:
        before = channel.current()
        if before == bundle.revision:
            click.echo(f"revision {bundle.revision} is already current in {where}: nothing published", err=True)
        else:
            channel.publish(bundle)
            click.echo(f"published {bundle.revision} ({len(bundle.files)} files) to {where}; "
                       f"previous: {before or 'none'}", err=True)  # fmt: skip
        click.echo(bundle.revision)

    @group.command("publish")
    @click.argument("directory", type=click.Path(file_okay=False))
    @_channel_options
    @click.option("--note", default="", help="What this revision is (a commit message); kept in the history.")
    @click.option("--force", is_flag=True, help="Publish even if the bundle does not load here.")
    def policy_publish(directory: str, to: str | None, etcd: str | None, prefix: str, note: str, force: bool) -> None:
        """Publish the policies of DIRECTORY to a fleet: every node applies them, or refuses and reports why.

        The bundle is compiled here first (with this machine's plugins' CEL functions) and not published if it
        does not load, unless --force. Prints the revision.
        """
        try:
            bundle = PolicyBundle.from_directory(directory, note=note)
        except BundleError as exc:
            raise click.ClickException(str(exc)) from None
        refuse_unless_loads(bundle, force, directory)
        with _channel(to, etcd, prefix, create=True) as channel:
            try:
                publish(channel, bundle, _where(to, etcd, prefix))
            except BundleError as exc:
                raise click.ClickException(str(exc)) from None

    @group.command("rollout-status")
    @_channel_options
    @click.option("--json", "as_json", is_flag=True, help="Print JSON: the current revision and every report.")
    @click.option("--wait", "wait_s", type=float, default=0.0, metavar="SECONDS",
                  help="Wait up to SECONDS for every reporting node to report on the current revision; exit 2 if "
                       "some have not by then (a deploy pipeline's gate).")  # fmt: skip
    @click.option("--stale", "stale_s", type=float, default=None, metavar="SECONDS",
                  help="With --wait: do not wait for nodes whose last report is older than SECONDS (a node that "
                       "died keeps its last report).")  # fmt: skip
    def policy_rollout_status(to: str | None, etcd: str | None, prefix: str, as_json: bool, wait_s: float,
                              stale_s: float | None) -> None:  # fmt: skip
        """The current revision and, per node, what it serves; exit 1 if a node failed to load the current one."""
        end = time.monotonic() + wait_s
        with _channel(to, etcd, prefix) as channel:
            while True:
                current = channel.current()
                history = channel.history()
                reports = channel.reports()
                fresh = {n: r for n, r in reports.items()
                         if stale_s is None or time.time() - float(r.get("at") or 0) <= stale_s}  # fmt: skip
                pending = sorted(n for n, r in fresh.items() if r.get("wanted") != current)
                if not pending or time.monotonic() >= end:
                    break
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        failed = sorted(n for n, r in reports.items() if r.get("status") == "failed" and r.get("wanted") == current)
        if as_json:
            out = {"current": current, "nodes": reports, "failed": failed, "pending": pending}
            click.echo(json.dumps(out, indent=2, sort_keys=True))
        else:
            last = next((h for h in reversed(history) if h[0] == current), None)
            when = f", published {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(last[1]))}" if last else ""
            note = f": {last[2]}" if last and last[2] else ""
            click.echo(f"current: {current or 'none (nothing published)'}{when}{note}")
            width = max([len(n) for n in reports] + [4])
            click.echo(f"{'node':<{width}}  {'serving':<16}  {'wanted':<16}  {'status':<11}  age")
            now = time.time()
            for node, r in sorted(reports.items()):
                click.echo(f"{node:<{width}}  {r.get('serving') or '-':<16}  {r.get('wanted') or '-':<16}  "
                           f"{r.get('status', '?'):<11}  {_age(now - float(r.get('at') or 0))}")  # fmt: skip
                for p in [*r.get("problems", []), *([r["error"]] if r.get("error") else [])]:
                    click.echo(f"    {p}")
            on = sum(r.get("serving") == current for r in reports.values())
            click.echo(f"{on}/{len(reports)} nodes serve the current revision; {len(failed)} failed to load it"
                       + (f"; {len(pending)} not reported on it yet ({', '.join(pending)})" if pending else ""))
        if failed:
            sys.exit(1)
        if pending and wait_s:
            sys.exit(2)

    @group.command("rollback")
    @click.argument("revision", required=False)
    @_channel_options
    @click.option("--note", default=None, help="Kept in the history (default: `rollback from <current>`).")
    @click.option("--force", is_flag=True, help="Publish even if that revision does not load here.")
    def policy_rollback(revision: str | None, to: str | None, etcd: str | None, prefix: str, note: str | None,
                        force: bool) -> None:  # fmt: skip
        """Publish again REVISION, or the revision published before the current one: a rollback is a publish."""
        with _channel(to, etcd, prefix) as channel:
            current = channel.current()
            history = [h[0] for h in channel.history()]
            if revision is None:
                last = max((i for i, r in enumerate(history) if r == current), default=None)
                earlier = [r for r in history[:last] if r != current] if last is not None else []
                if not earlier:
                    raise click.ClickException(f"no revision before {current or 'none'} in the history to roll "
                                               "back to")  # fmt: skip
                revision = earlier[-1]
            else:
                known = sorted({r for r in history if r.startswith(revision)})
                if len(known) > 1:
                    raise click.ClickException(f"{revision!r} names several revisions: {', '.join(known)}")
                revision = known[0] if known else revision
            try:
                bundle = channel.fetch(revision)
            except BundleError as exc:
                raise click.ClickException(str(exc)) from None
            bundle = attrs.evolve(bundle, note=note if note is not None else f"rollback from {current or 'none'}")
            refuse_unless_loads(bundle, force)
            publish(channel, bundle, _where(to, etcd, prefix))
