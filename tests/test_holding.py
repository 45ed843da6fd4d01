from nexuskv import Holding, HoldingCodes, Location

A, B = Location("dram", "n1", 1), Location("disk", "n2", 3)


def test_interning_gives_one_holding_per_content_and_decodes_it():
    codes = HoldingCodes()
    h = codes.intern([(B, 2), (A, 1), (A, 0)])  # zero masks dropped, order irrelevant
    assert isinstance(h, Holding) and h.locations == ((B, 2), (A, 1))  # sorted: disk before dram
    assert codes.intern([(A, 1), (B, 2)]) is h and codes.decode[h.code] is h and codes.decode[None] is None
    assert codes.intern([(A, 0)]) is None
    assert h.mask == 3 and h.mask_at(tier="dram") == 1 and h.mask_at(node="n2") == 2 and h.tiers() == {"dram", "disk"}


def test_prune_makes_a_new_map_and_keeps_codes_growing():
    codes = HoldingCodes()
    a, b = codes.intern([(A, 1)]), codes.intern([(B, 1)])
    old = codes.decode
    codes.prune([a.code])
    assert b.code not in codes.decode and old[b.code] is b  # a reader holding the old map stays consistent
    again = codes.intern([(B, 1)])
    assert again is not b and again.code > b.code  # a code is never reused: no reader can decode it wrongly
