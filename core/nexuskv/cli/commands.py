"""The `nexuskv` command line (click). Plugins add subcommands through `nexuskv_register_commands`."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import click

from nexuskv.cli.impact import add_impact_commands
from nexuskv.cli.rollout import add_rollout_commands
from nexuskv.cli.status import add_status_commands
from nexuskv.contracts import CONTRACTS, Request, from_dict, schema
from nexuskv.errors import ContractError, NexusKVError
from nexuskv.logs import configure_logging
from nexuskv.plugins.manager import PluginManager
from nexuskv.resources import shipped

__all__ = ["cli", "main"]

SCHEMA_DIR = shipped("schemas")


def _read_json(path: str) -> Any:
    """A JSON file's value; any problem reading or parsing it is one `ClickException` line naming the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise click.ClickException(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise click.ClickException(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise click.ClickException(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise click.ClickException(f"{path}: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise click.ClickException(f"{path}: JSON nested too deeply") from None


class _Group(click.Group):
    """The command group: whatever a command raises becomes one `Error: ...` line and exit 1, not a traceback.

    Input problems are reported where they are found (file, field, position); this is the net under them.
    At log level debug (`--log-level debug`, or `NEXUSKV_LOG_LEVEL=debug` without `--log-level`) the traceback of
    an unexpected exception is printed to stderr above that line; `NEXUSKV_DEBUG=1` lets the exception through.
    """

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command, turning unexpected exceptions into a one-line error."""
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except RecursionError:
            raise click.ClickException("input nested too deeply") from None
        except Exception as exc:
            if os.environ.get("NEXUSKV_DEBUG"):
                raise
            level = ctx.params.get("log_level") or os.environ.get("NEXUSKV_LOG_LEVEL") or "info"
            if level.lower() == "debug":
                click.echo(traceback.format_exc().rstrip("\n"), err=True)
            first = (str(exc).strip().splitlines() or [""])[0]
            raise click.ClickException(f"{type(exc).__name__}: {first}") from None


@click.group(cls=_Group)
@click.version_option(package_name="nexuskv", prog_name="nexuskv", message="%(prog)s %(version)s")
@click.option("--log-format", type=click.Choice(["auto", "json", "console"]), default="auto", show_default=True)
@click.option("--log-level", default=None, help="debug, info, warning, error (default: NEXUSKV_LOG_LEVEL or info).")
def cli(log_format: str, log_level: str | None) -> None:
    """NexusKV: decide, per request, what model state to reuse, and when reuse pays."""
    configure_logging(json=None if log_format == "auto" else log_format == "json", level=log_level, force=True)


@cli.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins_cmd(as_json: bool) -> None:
    """List loaded plugins with versions and hooks; exit 1 if any plugin had a problem."""
    pm = PluginManager()
    infos = pm.info()
    active = _active(pm)
    if as_json:
        click.echo(json.dumps({
            "plugins": [
                {"name": i.name, "source": i.source, "version": i.version, "hooks": list(i.hooks)} for i in infos
            ],
            "active": active,
            "problems": [{"plugin": p.plugin, "stage": p.stage, "message": p.message} for p in pm.problems],
        }, indent=2))  # fmt: skip
    else:
        for i in infos:
            click.echo(f"{i.name:<20} {i.source} {i.version}")
            for h in i.hooks:
                click.echo(f"    {h}")
        for part, what in active.items():
            click.echo(f"active {part}: {what}")
        for p in pm.problems:
            click.echo(f"PROBLEM {p.plugin} ({p.stage}): {p.message}", err=True)
    if pm.problems:
        sys.exit(1)


def _active(pm: PluginManager) -> dict[str, str]:
    """The keyer and matcher a kernel with the default config would use (class, and its module)."""
    out = {}
    for part, make in (("keyer", lambda: pm.keyer(b"\0" * 16, 16)), ("matcher", pm.matcher)):
        try:
            obj = make()
        except Exception as exc:  # reported as a plugin problem too
            out[part] = f"none ({exc})"
            continue
        out[part] = f"{type(obj).__name__} ({type(obj).__module__})"
    return out


@cli.group("schema")
def schema_grp() -> None:
    """Export, check and apply the versioned JSON Schemas of the contracts."""


def _exported() -> dict[str, type]:
    from nexuskv.policy.model import PolicyFile

    return {**CONTRACTS, PolicyFile.CONTRACT: PolicyFile}


@schema_grp.command("export")
@click.option("--dir", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=SCHEMA_DIR,
              show_default=True, help="Where the *.v1.json files live.")  # fmt: skip
@click.option("--check", is_flag=True, help="Do not write: exit 1 if any file differs from the classes.")
def schema_export(out_dir: Path, check: bool) -> None:
    """Regenerate `schemas/*.v1.json` from the contract classes (or check they are current)."""
    stale = []
    for name, cls in sorted(_exported().items()):
        text = json.dumps(schema.schema_for(cls), indent=2) + "\n"
        version = schema.schema_for(cls)["$id"].rsplit(".", 2)[-2]
        path = out_dir / f"{name}.{version}.json"
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not check:
            out_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            click.echo(f"wrote {path}")
    if check and stale:
        for p in stale:
            click.echo(f"stale: {p}", err=True)
        sys.exit(1)
    if check:
        click.echo(f"{len(_exported())} schemas are current")


@schema_grp.command("validate")
@click.argument("contract", type=click.Choice(sorted(CONTRACTS)))
@click.argument("file", type=click.Path(dir_okay=False))
def schema_validate(contract: str, file: str) -> None:
    """Validate a JSON FILE against a contract; print every problem with its field path."""
    try:
        from_dict(CONTRACTS[contract], _read_json(file))
    except ContractError as exc:
        for path, msg in exc.problems:
            click.echo(f"{file}: {path}: {msg}", err=True)
        sys.exit(1)
    click.echo(f"{file}: valid {contract}")


@cli.group("policy")
def policy_grp() -> None:
    """Check, unit-test and explain policy files."""


def _functions() -> dict[str, Any]:
    from nexuskv.cel import plugin_functions

    decls, problems = plugin_functions(PluginManager().cel_functions())
    for p in problems:
        click.echo(f"warning: {p}", err=True)
    return decls


@policy_grp.command("check")
@click.argument("directory", type=click.Path(file_okay=False))
def policy_check(directory: str) -> None:
    """Load every policy of DIRECTORY; print every problem (file:line:col, rule); exit 1 if any."""
    from nexuskv.policy.loader import Policies

    problems = Policies.check(directory, _functions())
    for p in problems:
        click.echo(str(p), err=True)
    if problems:
        click.echo(f"{len(problems)} problem(s)", err=True)
        sys.exit(1)
    policies = Policies.load(directory, _functions())
    click.echo(f"{len(policies.sets)} policies OK ({', '.join(policies.tenants())}), revision {policies.revision}")


@policy_grp.command("test")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--tests", "tests_path", type=click.Path(), default=None,
              help="A test file or folder (default: DIRECTORY/tests).")  # fmt: skip
@click.option("-v", "--verbose", is_flag=True, help="List passing cases too.")
@click.option("--coverage", "show_coverage", is_flag=True,
              help="Print rule and condition coverage of the policies by the tests.")  # fmt: skip
@click.option("--coverage-json", type=click.Path(dir_okay=False), default=None,
              help="Write the coverage report as JSON to this file.")  # fmt: skip
@click.option("--min-coverage", type=click.FloatRange(0, 100), default=None, metavar="PCT",
              help="Exit 1 when fewer than PCT percent of the conditions are covered.")  # fmt: skip
def policy_test(
    directory: str,
    tests_path: str | None,
    verbose: bool,
    show_coverage: bool,
    coverage_json: str | None,
    min_coverage: float | None,
) -> None:
    """Run policy unit tests (TOML `[[case]]`s with inputs and expected verdicts); exit 1 on any failure."""
    from nexuskv.policy.authoring.coverage import CoverageCollector, render
    from nexuskv.policy.authoring.testing import run_tests
    from nexuskv.policy.loader import Policies, PolicyError

    functions = _functions()
    try:
        policies = Policies.load(directory, functions)
    except PolicyError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)
    where = Path(tests_path) if tests_path else Path(directory) / "tests"
    paths = sorted(where.glob("*.toml")) if where.is_dir() else [where]
    measure = show_coverage or coverage_json is not None or min_coverage is not None
    collector = CoverageCollector(policies, functions) if measure else None
    results = run_tests(policies, paths, observe=collector.observe if collector is not None else None)
    for r in results:
        if not r.passed:
            click.echo(f"FAIL {r.file}: {r.name}")
            for f in r.failures:
                click.echo(f"     {f}")
        elif verbose:
            click.echo(f"ok   {r.file}: {r.name}")
    passed = sum(r.passed for r in results)
    click.echo(f"policy tests: {passed} passed, {len(results) - passed} failed")
    failed = passed != len(results) or not results
    if collector is not None:
        cov = collector.result()
        if show_coverage:
            click.echo("\n" + render(cov))
        if coverage_json is not None:
            try:
                Path(coverage_json).write_text(json.dumps(cov.to_dict(), indent=2) + "\n", encoding="utf-8")
            except OSError as exc:
                raise click.ClickException(f"{coverage_json}: cannot write it: {exc.strerror or exc}") from None
        pct = cov.totals.conditions_pct
        if min_coverage is not None and pct < min_coverage:
            click.echo(f"condition coverage {pct:.1f}% is below --min-coverage {min_coverage:g}%", err=True)
            failed = True
    if failed:
        sys.exit(1)


@policy_grp.command("explain")
@click.argument("file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--input", "input_value", required=True, metavar="JSON|FILE",
              help="The input, inline (a value starting with `{`) or a JSON file: {kind?, state?, request?, match?, "
                   "cost?, tier?, node?, now?, target?} (partial, like policy tests).")
@click.option("--kind", type=click.Choice(["admit", "reuse", "place", "share", "route"]), default=None,
              help="Rule kind (default: the input's `kind`).")  # fmt: skip
def policy_explain(file: Path, input_value: str, kind: str | None) -> None:
    """Which rules of FILE's policy fire for an input, and every sub-expression's value."""
    from nexuskv.policy.authoring.explain import explain, render
    from nexuskv.policy.authoring.testing import build_activation
    from nexuskv.policy.loader import Policies, PolicyError, parse_policy_file

    root = file.parent.parent if file.parent.name == "tenants" else file.parent
    model, problems, _ = parse_policy_file(file)
    if model is None:
        raise click.ClickException("\n".join(str(p) for p in problems))
    data, where = _explain_input(input_value)
    if not isinstance(data, dict):
        raise click.ClickException(f"{where}: expected a JSON object")
    kind = kind or data.pop("kind", None)
    data.pop("kind", None)
    if kind is None:
        raise click.ClickException("no rule kind: pass --kind or put \"kind\" in the input")
    functions = _functions()
    try:
        ps = Policies.load(root, functions).for_tenant(model.name)
        act = build_activation(data, kind=kind)
    except (PolicyError, ContractError) as exc:
        raise click.ClickException(str(exc)) from None
    traces, verdict = explain(ps, kind, act, functions)
    click.echo(render(ps, kind, traces, verdict))


def _explain_input(value: str) -> tuple[Any, str]:
    """`policy explain --input`: inline JSON when the value starts with `{`, else a JSON file; and what to call it."""
    if not value.lstrip().startswith("{"):
        if not Path(value).exists():
            raise click.ClickException(f"--input {value}: no such file (the input is a JSON file, or inline JSON "
                                       "starting with '{')")  # fmt: skip
        return _read_json(value), value
    try:
        return json.loads(value), "--input"
    except json.JSONDecodeError as exc:
        raise click.ClickException(f"--input: inline JSON, line {exc.lineno} column {exc.colno}: {exc.msg} (a value "
                                   "starting with '{' is read as JSON, anything else as a file)") from None
    except RecursionError:
        raise click.ClickException("--input: inline JSON nested too deeply") from None


@cli.command("keys")
@click.option("--request", "request_file", required=True, type=click.Path(dir_okay=False), help="Request JSON.")
@click.option("--page-size", default=16, show_default=True)
def keys_cmd(request_file: str, page_size: int) -> None:
    """Print the block keys of a request (secret from NEXUSKV_SECRET or the persisted secret file)."""
    from nexuskv.state.identity import load_secret

    try:
        req = from_dict(Request, _read_json(request_file))
        keyer = PluginManager().keyer(load_secret(), page_size)
    except NexusKVError as exc:
        raise click.ClickException(str(exc)) from None
    for i, k in enumerate(keyer.request_keys(req)):
        click.echo(f"{i:>6} [{i * page_size}, {(i + 1) * page_size}) {k.hex()}")


@cli.command("plan")
@click.option("--request", "request_file", required=True, type=click.Path(dir_okay=False), help="Request JSON.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Kernel config TOML (default: an embedded kernel with the default profile).")  # fmt: skip
def plan_cmd(request_file: str, config_file: str | None) -> None:
    """Print the plan for a request, and why (against the kernel's current, here empty, index)."""
    from nexuskv.contracts import to_dict
    from nexuskv.kernel import Kernel

    try:
        req = from_dict(Request, _read_json(request_file))
        kernel = Kernel.from_config(config_file) if config_file else Kernel()
    except NexusKVError as exc:
        raise click.ClickException(str(exc)) from None
    with kernel:
        plan = kernel.plan(req)
    click.echo(json.dumps(to_dict(plan), indent=2))
    for r in plan.reasons:
        click.echo(f"why: {r}", err=True)


@cli.command("demo")
@click.option("--turns", default=4, show_default=True, help="Turns of the multi-turn chat session.")
@click.option("--requests", default=300, show_default=True, help="Requests in the replayed generated workload.")
@click.pass_context
def demo_cmd(ctx: click.Context, turns: int, requests: int) -> None:
    """The main job: identity and isolation, restore points, plans with reasons, and a replay vs baselines."""
    import os

    from nexuskv.cli.demo import run_demo

    if ctx.parent is not None and ctx.parent.params.get("log_level") is None and "NEXUSKV_LOG_LEVEL" not in os.environ:
        configure_logging(level="warning", force=True)  # the demo prints its own story; decision logs on request

    run_demo(turns=turns, echo=click.echo, requests=requests)


def with_plugin_commands() -> click.Group:
    """The `nexuskv` group with every installed plugin's commands added (what `main` runs)."""
    pm = PluginManager()
    for impl in reversed(pm.pm.hook.nexuskv_register_commands.get_hookimpls()):
        try:
            impl.function(cli)
        except Exception as exc:  # a broken plugin must not take the CLI down
            click.echo(f"plugin {impl.plugin_name!r} failed to add commands: {exc}", err=True)
    return cli


def main() -> None:
    """Console-script entry point."""
    with_plugin_commands()(prog_name="nexuskv")


add_rollout_commands(policy_grp, _functions)  # publish, rollout-status, rollback (cli/rollout.py)
add_impact_commands(policy_grp, _functions)  # diff (cli/impact.py)
add_status_commands(cli)  # status [--watch] (cli/status.py)
