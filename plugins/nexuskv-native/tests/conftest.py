import pytest

pytest.importorskip("nexuskv_native._native", reason="the native extension is not built")


@pytest.fixture(autouse=True)
def _deadline(monkeypatch):
    monkeypatch.setenv("NEXUSKV_DEADLINE_MS", "10000")
