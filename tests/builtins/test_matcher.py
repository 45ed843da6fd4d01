from nexuskv import DictIndex
from nexuskv.builtins.matcher import nexuskv_matcher


def test_answers_for_dict_default_or_native_when_no_native_plugin_answered():
    assert isinstance(nexuskv_matcher({}), DictIndex)
    assert isinstance(nexuskv_matcher({"name": "dict"}), DictIndex)
    assert isinstance(nexuskv_matcher({"name": "native"}), DictIndex)  # answers last: the plugin passed or is absent
    assert nexuskv_matcher({"name": "other"}) is None
