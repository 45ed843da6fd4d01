"""The sidecar's commands: `nexuskv serve CONFIG` and `nexuskv serve-token TENANT`."""

from __future__ import annotations

import json
import re
import secrets

import click

from nexuskv import ConfigError

__all__ = ["serve", "serve_token"]


@click.command("serve")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--host", default=None, help="Listen address (default: the config's, else 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Listen port (default: the config's, else 8470; 0: a free one).")
@click.option("--workers", type=click.IntRange(1, 64), default=None,
              help="HTTP worker processes (default: the config's, else 1; above 1 the kernel answers them).")
def serve(config: str, host: str | None, port: int | None, workers: int | None) -> None:
    """Serve a kernel's plan / route / commit / materialize / report over HTTP+JSON (see docs/sidecar.md)."""
    import attrs

    from nexuskv_sidecar._config import SidecarConfig
    from nexuskv_sidecar.server import Sidecar

    try:
        cfg = SidecarConfig.from_toml(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if not cfg.tokens:
        raise click.ClickException(f"{config}: [auth] names no tokens: no caller could use the sidecar")
    cfg = attrs.evolve(cfg, host=host or cfg.host, port=cfg.port if port is None else port,
                       workers=cfg.workers if workers is None else workers)  # fmt: skip
    try:
        sidecar = Sidecar(cfg)
    except OSError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"serving {sidecar.url}", err=True)
    sidecar.serve_forever()


@click.command("serve-token")
@click.argument("tenant")
def serve_token(tenant: str) -> None:
    """Make a new random token for TENANT ("*": the operator): the token, and the config lines to paste."""
    from nexuskv_sidecar._config import digest

    token = secrets.token_urlsafe(32)
    click.echo(f"token: {token}")
    click.echo("paste into the sidecar's config file (add the line to its [auth] table if it has one):")
    click.echo("[auth]")
    click.echo(f'{toml_key(tenant)} = ["sha256:{digest(token).hex()}"]')


def toml_key(name: str) -> str:
    """`name` as a TOML key: bare when TOML allows it, else quoted (`"*"`, `"a.b"`)."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name)
