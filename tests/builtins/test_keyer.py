from nexuskv import BlockKeyer
from nexuskv.builtins.keyer import nexuskv_keyer

SECRET = b"s" * 32


def test_answers_with_the_reference_keyer_unless_another_is_named():
    for config in ({}, {"name": "python"}, {"name": "native"}):  # native: answers last, when no plugin did
        keyer = nexuskv_keyer(SECRET, 16, config)
        assert type(keyer) is BlockKeyer
        assert keyer.page_size == 16
    assert nexuskv_keyer(SECRET, 16, {"name": "other"}) is None
