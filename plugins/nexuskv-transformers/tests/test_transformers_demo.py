"""The engine demo tells the truth (issue 30, build 4): a fallback is a FALLBACK, wrong state is a FAIL that
makes the command exit 1, and the results say where NexusKV and always-reuse decided differently."""

from __future__ import annotations

from click.testing import CliRunner

from nexuskv.cli import with_plugin_commands
from nexuskv_transformers.connector import TransformersConnector
from nexuskv_transformers.demo import FAIL, FALLBACK, PASS, safety_checks
from nexuskv_transformers.state import StateCodec


class FallingBack(TransformersConnector):
    """A connector whose every load fell back (what a busy machine did to the demo): answers right, nothing reused."""

    def _restore(self, plan, request, keys):  # type: ignore[no-untyped-def]
        return None, 0, "dram", "fail-open: load timed out (injected); recompute"


def _corrupting(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every restore hands the engine wrong state: each payload's bytes flipped after the kernel verified them."""
    real = StateCodec.restore

    def restore(self, states, blocks):  # type: ignore[no-untyped-def]
        flipped = {k: (bytes(b ^ 0x5A for b in bytes(p)), d) for k, (p, d) in states.items()}
        return real(self, flipped, blocks)

    monkeypatch.setattr(StateCodec, "restore", restore)


def test_a_load_that_fell_back_is_a_fallback_never_a_failure():
    rows = safety_checks(kinds=("dense",), connector=FallingBack)
    verdicts = {check: (verdict, detail) for _, check, verdict, detail in rows}
    verdict, detail = verdicts["restore + suffix == full prefill (cuts 16/48/96)"]
    assert verdict == FALLBACK and "cut 16: reused 0 (fail-open: load timed out (injected)" in detail
    for check in ("other weights refused", "other tenant refused"):  # nothing reused above: nothing proven
        assert verdicts[check][0] == FALLBACK and "inconclusive" in verdicts[check][1]


def test_the_safety_checks_pass_when_the_state_is_right():
    rows = safety_checks(kinds=("dense",))
    assert [verdict for _, _, verdict, _ in rows] == [PASS, PASS, PASS], rows


def test_a_wrong_restore_is_a_fail_that_says_which_condition(monkeypatch):
    _corrupting(monkeypatch)
    rows = safety_checks(kinds=("dense",))
    verdict, detail = next((v, d) for _, c, v, d in rows if c.startswith("restore"))
    assert verdict == FAIL and ("argmax differs" in detail or "over 0.0001" in detail)


def test_engine_demo_passes_and_exits_1_when_a_wrong_restore_is_injected(monkeypatch):
    runner = CliRunner()
    ok = runner.invoke(with_plugin_commands(), ["engine-demo", "--smoke", "--quiet"])
    assert ok.exit_code == 0, ok.output
    assert "FAIL" not in ok.output and "reused the same tokens on" in ok.output
    _corrupting(monkeypatch)
    bad = runner.invoke(with_plugin_commands(), ["engine-demo", "--smoke", "--quiet"])
    assert bad.exit_code == 1, bad.output
    assert "FAIL" in bad.output and "safety failure(s)" in bad.output
