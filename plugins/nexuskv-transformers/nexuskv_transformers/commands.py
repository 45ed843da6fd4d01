"""The reference engine's commands: `nexuskv calibrate` and `nexuskv engine-demo`."""

from __future__ import annotations

from pathlib import Path

import click

__all__ = ["calibrate_command", "engine_demo_command"]


@click.command("calibrate")
@click.option("--engine", type=click.Choice(["transformers"]), default="transformers", show_default=True,
              help="Engine connector to calibrate.")
@click.option("--model", "kind", type=click.Choice(["dense", "latent", "windowed", "recurrent", "hybrid"]),
              default="dense", show_default=True, help="Reference model kind.")
@click.option("--size", type=click.Choice(["test", "demo"]), default="demo", show_default=True)
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Kernel config whose tiers to measure (default: the demo's DRAM + shaped remote link).")
@click.option("--out", type=click.Path(dir_okay=False), default="profiles/transformers-dense-cpu.json",
              show_default=True, help="Where to write the fitted profile.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default="docs/img/calibration-dense.png",
              show_default=True, help="Where to write the PNG plot ('' for none).")
@click.option("--quick", is_flag=True, help="Fewer lengths and repeats (about 15 s).")
def calibrate_command(engine: str, kind: str, size: str, config_path: str | None, out: str, plot_path: str,
                      quick: bool) -> None:  # fmt: skip
    """Measure prefill and tier costs on this machine, fit a cost profile, write it and plot it."""
    import torch
    from tqdm import tqdm

    from nexuskv import Kernel, KernelConfig
    from nexuskv_transformers.calibrate import calibrate, measurable, plot, save
    from nexuskv_transformers.connector import TransformersConnector
    from nexuskv_transformers.demo import SECRET, demo_config
    from nexuskv_transformers.models import build_model

    torch.set_grad_enabled(False)
    cfg = KernelConfig.from_toml(config_path) if config_path else demo_config(None)
    command = f"nexuskv calibrate --engine {engine} --model {kind} --size {size}" + (" --quick" if quick else "")
    with measurable(cfg) as cfg, Kernel(cfg, secret=SECRET) as k, tqdm(desc="calibrating", unit="step",
                                                                        leave=False) as bar:  # fmt: skip
        report = calibrate(TransformersConnector(k, build_model(kind, size=size)), quick=quick,
                           progress=lambda: bar.update(1), command=command)  # fmt: skip
    save(report, out)
    click.echo(report.summary())
    click.echo(f"profile written to {out}")
    if plot_path:
        click.echo(f"plot written to {plot(report, Path(plot_path))}")


@click.command("engine-demo")
@click.option("--full-calibration", is_flag=True, help="Calibrate with every length (slower).")
@click.option("--quiet", is_flag=True, help="Do not print one line per request.")
@click.option("--smoke", is_flag=True, hidden=True, help="The smallest whole demo (tests).")
def engine_demo_command(full_calibration: bool, quiet: bool, smoke: bool) -> None:
    """Run the mixed workload on the real CPU engine: NexusKV vs never-reuse vs always-reuse.

    Exits 1 when a safety check or an answer check FAILs (wrong state); a FALLBACK (less reused than expected,
    the answers right) is reported, never a failure.
    """
    from nexuskv import configure_logging
    from nexuskv_transformers.demo import run_demo

    configure_logging(level="warning", force=True)
    result = run_demo(quick=not full_calibration, show_requests=not quiet, smoke=smoke)
    if result.failures:
        click.echo(f"engine-demo: {len(result.failures)} safety failure(s):", err=True)
        for failure in result.failures:
            click.echo(f"  {failure}", err=True)
        raise SystemExit(1)
