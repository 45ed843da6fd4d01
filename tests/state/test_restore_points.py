from hypothesis import given
from hypothesis import strategies as st

from nexuskv import Layout, StateGroup, longest_restore_point, valid_restore_point
from nexuskv.state.restore_points import group_masks

KINDS = ["dense", "latent", "windowed", "recurrent"]
layouts = st.lists(st.sampled_from(KINDS), min_size=1, max_size=4).map(
    lambda ks: Layout(groups=[StateGroup(kind=k, layers=1) for k in ks])
)


def brute_force(layout, masks):
    """Reference: the largest cut whose every group is restorable, by the definitions in DESIGN.md."""
    best = 0
    for cut in range(1, len(masks) + 1):
        ok = True
        for g, group in enumerate(layout.groups):
            bit = 1 << g
            if group.kind.checkpointed:
                ok &= bool(masks[cut - 1] & bit)  # a checkpoint exactly at the cut
            else:
                ok &= all(m & bit for m in masks[:cut])  # every page of the prefix
        if ok:
            best = cut
    return best


@given(layouts, st.data())
def test_longest_restore_point_matches_brute_force(layout, data):
    masks = data.draw(st.lists(st.integers(0, layout.group_mask), max_size=40))
    got = longest_restore_point(layout, masks)
    assert got == brute_force(layout, masks)
    assert valid_restore_point(layout, masks, got)
    assert all(not valid_restore_point(layout, masks, b) for b in range(got + 1, len(masks) + 1))


def test_dense_and_latent_restore_at_any_page():
    for kind in ("dense", "latent"):
        lay = Layout(groups=[StateGroup(kind=kind, layers=1)])
        assert longest_restore_point(lay, [1, 1, 1, 0, 1]) == 3


def test_windowed_and_recurrent_restore_only_at_checkpoints():
    for kind in ("windowed", "recurrent"):
        lay = Layout(groups=[StateGroup(kind=kind, layers=1)])
        assert longest_restore_point(lay, [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]) == 8
        assert longest_restore_point(lay, [1, 1, 0]) == 2
        assert not valid_restore_point(lay, [0, 0, 0, 1], 3)


def test_hybrid_cut_needs_every_group():
    lay = Layout(groups=[StateGroup(kind="dense", layers=1), StateGroup(kind="recurrent", layers=1)])
    # pages for blocks 0..5, recurrent checkpoints after blocks 3 and 7 -> 4 (7 lacks pages)
    masks = [1, 1, 1, 3, 1, 1, 0, 2]
    assert longest_restore_point(lay, masks) == 4
    assert group_masks(lay.groups) == (1, 2)


def test_zero_is_always_valid():
    lay = Layout(groups=[StateGroup(kind="recurrent", layers=1)])
    assert valid_restore_point(lay, [], 0)
    assert longest_restore_point(lay, []) == 0
