import pytest

from nexuskv import slot_of


def test_slot_is_key_plus_group_byte():
    assert slot_of(b"k" * 16) == b"k" * 16 + b"\x00"
    assert slot_of(b"k" * 16, 3)[-1] == 3


@pytest.mark.parametrize("g", [-1, 256])
def test_bad_group(g):
    with pytest.raises(ValueError):
        slot_of(b"k" * 16, g)
