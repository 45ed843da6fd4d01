"""DescriptorParser: the same answers as the schema's full check, faster, from many threads."""

from __future__ import annotations

import json
import threading

import attrs
import pytest

from nexuskv import ContractError, DescriptorParser, Placement, from_dict, to_dict
from nexuskv.contracts import StateDescriptor
from nexuskv.testing import chain


def raw(desc: StateDescriptor) -> bytes:
    return json.dumps(to_dict(desc)).encode()


def test_it_gives_what_the_full_check_gives_for_a_chain_of_blocks():
    parser = DescriptorParser()
    blocks = chain(50, tenant="acme")
    for _, _, desc in blocks:
        assert parser.parse(raw(desc)) == from_dict(StateDescriptor, to_dict(desc)) == desc
    assert parser.parse(raw(blocks[3][2]).decode()) == blocks[3][2]  # str works too


@pytest.mark.parametrize("change", [
    {"key": "XYZ"}, {"checksum": "no checksum"}, {"nbytes": -1}, {"span": {"start": 0}},
    {"placement": {"tier": "bad name!", "node": "n", "epoch": 0}}, {"group": "0"},
])  # fmt: skip
def test_a_bad_field_after_the_template_is_refused_as_the_schema_would(change):
    parser = DescriptorParser()
    blocks = chain(2)
    parser.parse(raw(blocks[0][2]))  # the shape's template exists now
    data = {**to_dict(blocks[1][2]), **change}
    with pytest.raises(ContractError):
        parser.parse(json.dumps(data).encode())


def test_not_json_and_not_a_descriptor_are_errors():
    parser = DescriptorParser()
    with pytest.raises(ValueError):
        parser.parse(b"{not json")
    with pytest.raises(ContractError):
        parser.parse(b'{"key": "00"}')


def test_caches_are_bounded():
    parser = DescriptorParser(entries=8)
    for _, _, desc in chain(40):
        parser.parse(raw(desc))
    assert len(parser._exact) <= 8 and len(parser._templates) <= 8


def test_many_threads_parse_at_once_and_agree():
    parser = DescriptorParser(entries=64)
    blocks = [d for t in ("a", "b", "c") for _, _, d in chain(30, tenant=t)]
    blocks += [attrs.evolve(d, placement=Placement("dram", "n2", 7)) for d in blocks[:20]]
    wrong: list[str] = []

    def worker(seed: int) -> None:
        for i in range(400):
            d = blocks[(seed * 31 + i) % len(blocks)]
            if parser.parse(raw(d)) != d:
                wrong.append(d.key)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_the_encoder_says_what_to_dict_says_for_every_block():
    from nexuskv import DescriptorEncoder, Usage

    enc, parser = DescriptorEncoder(entries=4), DescriptorParser()
    blocks = [d for t in ("a", "b") for _, _, d in chain(20, tenant=t)]
    blocks += [attrs.evolve(d, usage=Usage(1.5, 2.25, 3), placement=Placement("disk", "n9", 4)) for d in blocks[:5]]
    for d in blocks:
        assert json.loads(enc.encode(d)) == to_dict(d)
        assert parser.parse(enc.encode(d)) == d
    assert len(enc._shapes) <= 4
