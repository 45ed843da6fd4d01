"""`nexuskv policy diff OLD NEW --decisions LOG`: what a policy change would do to decisions already made.

Replays decision records that carry their inputs (a kernel's `decision_file`, with `decision_inputs` naming the
tenants) through both revisions and prints which decisions change, how often, and which rules cause it.
`cli/commands.py` adds it to its `policy` group with `add_impact_commands`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import click

from nexuskv.ops.shadow import RuleDiff, ShadowReport, impact
from nexuskv.policy.bundle import BundleError, PolicyBundle
from nexuskv.policy.loader import Policies, PolicyError

__all__ = ["add_impact_commands", "render_report"]


def _load(source: str, functions: Mapping[str, Any]) -> Policies:
    """A policy directory, or a bundle file (`*.json`, as `policy publish` ships them)."""
    path = Path(source)
    try:
        if path.is_file():
            return Policies.from_bundle(PolicyBundle.from_json(path.read_bytes()), functions)
        return Policies.load(path, functions)
    except (PolicyError, BundleError) as exc:
        raise click.ClickException(f"{source}: {exc}") from None


def _records(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:  # a torn line (a crash mid-write): skipped, counted, named
                click.echo(f"warning: {path}:{n}: not a JSON line ({exc.msg}); skipped", err=True)
                yield {"record": "unreadable", "line": n}
                continue
            if isinstance(rec, dict):
                rec.setdefault("line", n)
                yield rec


def render_report(report: ShadowReport, skipped: Mapping[str, int] | None = None) -> str:
    """The report as the terminal shows it (`policy diff`, and the shadow section of the docs)."""
    n, d = report.compared, report.disagreed
    pct = f" ({100 * d / n:.1f}%)" if n else ""
    lines = [f"revision {report.baseline or '-'} -> {report.candidate}: {n} decisions replayed, {d} change{pct}"]
    if skipped:
        lines.append("skipped: " + ", ".join(f"{v} {k}" for k, v in sorted(skipped.items())))
    if report.incomplete:
        lines.append(f"{report.incomplete} decisions read a shared scope the record did not capture (planned as empty)")
    if report.failed:
        lines.append(f"{report.failed} decisions could not be replayed (see the log)")
    if report.transitions:
        lines.append("actions:")
        lines.extend(f"  {k}: {v}" for k, v in report.transitions.items())
    if report.by_change:
        lines.append("what changes: " + ", ".join(f"{k} {v}" for k, v in sorted(report.by_change.items())))
    if report.by_rule:
        lines.append("rules deciding differently:")
        lines.extend(f"  {rule}: {v} decisions" for rule, v in report.by_rule.items())
    if report.examples:
        lines.append("examples:")
        lines.extend(f"  {e['decision_id']} ({e['tenant']}): {e['before']}  ->  {e['after']}" for e in report.examples)
    return "\n".join(lines)


def add_impact_commands(group: click.Group, functions: Callable[[], Mapping[str, Any]]) -> None:
    """Add `diff` to the `policy` group (`functions()` gives the plugins' CEL functions)."""

    @group.command("diff")
    @click.argument("old")
    @click.argument("new")
    @click.option("--decisions", "log_file", required=True, type=click.Path(dir_okay=False, exists=True),
                  help="A decision file (kernel config `decision_file`) whose records carry inputs.")  # fmt: skip
    @click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
    @click.option("--examples", default=10, show_default=True, help="How many changed decisions to show.")
    def policy_diff(old: str, new: str, log_file: str, as_json: bool, examples: int) -> None:
        """Replay recorded decisions through OLD and NEW (policy directories or bundle files); print what changes.

        Exit 0 when nothing changes, 1 when some decisions change or admit / place / route rules (which recorded
        plans cannot show) differ: a CI gate can require a reviewed diff.
        """
        fns = functions()
        before, after = _load(old, fns), _load(new, fns)
        report, skipped = impact(_records(log_file), before, after, max_examples=examples)
        unseen = RuleDiff(before, after).not_replayed()
        if as_json:
            click.echo(json.dumps({**report.to_dict(), "skipped": skipped, "not_replayed": unseen}, indent=2))
        else:
            click.echo(render_report(report, skipped))
            if unseen:
                click.echo(f"not replayed ({len(unseen)}): decisions are plans; these admit, place and route "
                           "rules differ and their effect is not shown: " + ", ".join(unseen))  # fmt: skip
        if not report.compared:
            click.echo("no decision with inputs to replay (set decision_file and decision_inputs in the kernel "
                       "config)", err=True)  # fmt: skip
        sys.exit(1 if report.disagreed or unseen else 0)
