from nexuskv import DictIndex
from nexuskv.builtins.matcher import nexuskv_matcher


def test_answers_for_dict_or_default_only():
    assert isinstance(nexuskv_matcher({}), DictIndex)
    assert isinstance(nexuskv_matcher({"name": "dict"}), DictIndex)
    assert nexuskv_matcher({"name": "native"}) is None
