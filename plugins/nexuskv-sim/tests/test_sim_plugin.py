import json
import subprocess
import sys

from click.testing import CliRunner

from nexuskv_sim.commands import gen_trace_command, simulate_command
from nexuskv_sim.trace import read_trace


def test_gen_trace_then_simulate(tmp_path):
    runner = CliRunner()
    trace = tmp_path / "t.jsonl"
    got = runner.invoke(gen_trace_command, [str(trace), "--requests", "60", "--seed", "1", "--mixed"])
    assert got.exit_code == 0, got.output
    assert {r.model for r in read_trace(trace)} == {"llama-8b", "llama-70b", "qwen-moe-30b"}
    out_json, plot = tmp_path / "r.json", tmp_path / "r.png"
    got = runner.invoke(simulate_command, [str(trace), "--nodes", "3", "--strategies", "never,sglang",
                                           "--limit", "40", "--json", str(out_json), "--plot", str(plot)])  # fmt: skip
    assert got.exit_code == 0, got.output
    lines = got.stdout.splitlines()  # the table; log lines (stderr) are mixed into `output`
    assert lines[0] == "t.jsonl: 3 nodes" and lines[2].split()[:3] == ["never", "40", "40"]
    doc = json.loads(out_json.read_text())
    assert [r["strategy"] for r in doc["results"]] == ["never", "sglang"]
    assert plot.stat().st_size > 0


def test_unknown_strategy_is_a_usage_error(tmp_path):
    trace = tmp_path / "t.jsonl"
    CliRunner().invoke(gen_trace_command, [str(trace), "--requests", "5"])
    got = CliRunner().invoke(simulate_command, [str(trace), "--strategies", "oracle"])
    assert got.exit_code == 2 and "oracle" in got.output


def test_commands_are_registered_through_the_plugin_hook(tmp_path):
    out = subprocess.run([sys.executable, "-c", "from nexuskv.cli import main; main()", "--help"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0
    assert "simulate" in out.stdout and "gen-trace" in out.stdout


def test_simulate_scales_the_trace_to_a_fleet(tmp_path):
    trace = tmp_path / "t.jsonl"
    CliRunner().invoke(gen_trace_command, [str(trace), "--requests", "30", "--seed", "2", "--rate", "2"])
    window = sum(1 for r in read_trace(trace) if r.timestamp < 5000)
    got = CliRunner().invoke(simulate_command, [str(trace), "--nodes", "6", "--strategies", "never,nexuskv",
                                                "--scale", "3", "--window-s", "5"])  # fmt: skip
    assert got.exit_code == 0, got.output
    lines = got.stdout.splitlines()  # the table; log lines (stderr) are mixed into `output`
    assert lines[0] == "t.jsonl, x3, first 5 s: 6 nodes"
    assert lines[2].split()[:3] == ["never", str(3 * window), str(3 * window)]
