import pytest

from nexuskv import parse_bytes


@pytest.mark.parametrize(("text", "n"), [("4GiB", 4 << 30), ("512 MiB", 512 << 20), ("1.5MB", 1_500_000),
                                         ("10", 10), (7, 7), ("2k", 2048), ("3B", 3)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("bad", ["", "GiB", "4 GiBs", "-1", -1, True, "1e3", None])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(bad)
