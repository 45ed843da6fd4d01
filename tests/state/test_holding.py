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


def test_plus_minus_and_without_make_the_interned_holdings_of_the_result():
    codes = HoldingCodes()
    ab = codes.plus(codes.plus(None, A, 1), B, 2)
    assert ab is codes.intern([(A, 1), (B, 2)]) and ab.at(A) == 1 and ab.at(B) == 2 and ab.at(Location("x", "y")) == 0
    assert codes.plus(ab, A, 2).at(A) == 3
    assert codes.minus(ab, A, 2) is None  # group 2 was not held at A: nothing changes
    assert codes.minus(ab, Location("x", "y"), None) is None
    assert codes.minus(ab, A, 1) == (codes.intern([(B, 2)]), [A])
    assert codes.minus(ab, None, None) == (None, [B, A])  # every location, in the holding's order
    three = codes.plus(ab, A, 2)
    assert codes.minus(three, A, 1) == (codes.intern([(A, 2), (B, 2)]), [])  # A keeps group 2
    assert codes.without(ab, B) is codes.intern([(A, 1)]) and codes.without(codes.intern([(A, 1)]), A) is None
