import json

import pytest

from nexuskv import ContractError
from nexuskv_sim.trace import BLOCK_TOKENS, TraceRecord, generate, generate_mixed, read_trace, scale, write_trace


def test_round_trip_keeps_models_and_tenants(tmp_path):
    recs = [TraceRecord(0, 600, 5, [1, 2]), TraceRecord(10, 512, 1, [3], "llama-70b", "acme")]
    path = tmp_path / "t.jsonl"
    assert write_trace(recs, path) == 2
    assert list(read_trace(path)) == recs
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert "model" not in first and "tenant" not in first
    assert (second["model"], second["tenant"]) == ("llama-70b", "acme")


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("not json", "JSONDecodeError"),
        ('{"timestamp": 0, "input_length": 10}', "KeyError"),
        ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}', "do not cover"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}', "negative"),
    ],
)
def test_read_errors_name_file_and_line(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ContractError) as err:
        list(read_trace(path))
    where, msg = err.value.problems[0]
    assert where == f"{path}:3"
    assert needle in msg


def test_generate_is_deterministic_and_covers_input():
    a, b = generate(200, seed=3), generate(200, seed=3)
    assert a == b and a != generate(200, seed=4)
    for r in a:
        assert len(r.hash_ids) == -(-r.input_length // BLOCK_TOKENS)
    assert [r.timestamp for r in a] == sorted(r.timestamp for r in a)


def test_generate_mixed_has_models_tenants_and_per_tenant_prefixes(tmp_path):
    recs = generate_mixed(600, seed=1)
    models = {r.model for r in recs}
    tenants = {r.tenant for r in recs}
    assert models == {"llama-8b", "llama-70b", "qwen-moe-30b"}
    assert len(tenants) == 4
    counts = {m: sum(r.model == m for r in recs) for m in models}
    assert counts["llama-8b"] > counts["qwen-moe-30b"] > counts["llama-70b"]
    # shared prefixes never cross (tenant, model): the first block id identifies its owner
    owner: dict[int, tuple[str, str]] = {}
    for r in recs:
        assert owner.setdefault(r.hash_ids[0], (r.tenant, r.model)) == (r.tenant, r.model)
    # the expensive model reuses more: its share of repeated first blocks is higher than the flood's
    def repeat_share(model):
        firsts = [r.hash_ids[0] for r in recs if r.model == model]
        return 1 - len(set(firsts)) / len(firsts)

    assert repeat_share("llama-70b") > repeat_share("llama-8b")
    path = tmp_path / "m.jsonl"
    write_trace(recs, path)
    assert list(read_trace(path)) == recs


def test_token_ids_follow_the_hash_ids_block_by_block():
    from nexuskv_sim.trace import token_ids

    a = token_ids([1, 2, 3], 2 * 512 + 10)
    b = token_ids([1, 2, 4], 3 * 512)
    assert len(a) == 1034 and len(b) == 1536
    assert a[:1024] == b[:1024] and a[1024:] != b[1024:1034]  # equal prefix ids, equal tokens; then they differ
    assert a[:3] == [512, 513, 514]


def test_scale_copies_each_record_with_its_own_tenant_and_prefixes():
    recs = [TraceRecord(0.0, 2 * BLOCK_TOKENS, 3, [0, 1]), TraceRecord(10.0, BLOCK_TOKENS, 1, [0]),
            TraceRecord(5000.0, BLOCK_TOKENS, 1, [7])]  # fmt: skip
    got = scale(recs, 3, window_ms=100.0)
    assert [r.timestamp for r in got] == [0.0, 0.0, 0.0, 10.0, 10.0, 10.0]
    assert [r.tenant for r in got[:3]] == ["default.0", "default.1", "default.2"]
    assert [r.hash_ids for r in got[:3]] == [(0, 1), (2, 3), (4, 5)]  # ids offset by (largest id + 1) per copy
    assert [r.hash_ids for r in got[3:]] == [(0,), (2,), (4,)]  # the same session, within its own copy
    assert {(r.input_length, r.output_length) for r in got[:3]} == {(2 * BLOCK_TOKENS, 3)}
    assert scale(recs, 1) == recs
    with pytest.raises(ValueError, match="copies"):
        scale(recs, 0)
