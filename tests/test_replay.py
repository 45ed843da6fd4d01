import collections
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv import ContractError
from nexuskv.cli import cli
from nexuskv.replay import (
    BLOCK_TOKENS,
    STRATEGIES,
    ReplayResult,
    TraceRecord,
    generate,
    read_trace,
    replay,
    summary,
    write_trace,
)

ROOT = Path(__file__).resolve().parents[1]
PROFILE = str(ROOT / "profiles" / "replay-llama-8b-gpu.json")
SMALL_TIERS = {"dram": 50, "disk": 500, "redis": 2000}
CONGESTED = {"disk": 0.01, "redis": 0.01}


def line(**kw):
    d = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    d.update(kw)
    return json.dumps({k: v for k, v in d.items() if v is not ...})


def write_lines(tmp_path, *lines, name="trace.jsonl"):
    p = tmp_path / name
    p.write_text("".join(x + "\n" for x in lines))
    return p


def covers(rec: TraceRecord) -> bool:
    return len(rec.hash_ids) == -(-rec.input_length // BLOCK_TOKENS)


@pytest.fixture(scope="module")
def trace60():
    return generate(60, seed=1)


@pytest.fixture(scope="module")
def plain_results(trace60):
    return replay(trace60, profile_path=PROFILE, tier_blocks=SMALL_TIERS)


@pytest.fixture(scope="module")
def congested_results(trace60):
    return replay(trace60, profile_path=PROFILE, tier_blocks={"dram": 2, "disk": 500, "redis": 2000},
                  bandwidth_scale=CONGESTED)  # fmt: skip


# ------------------------------------------------------------------------------------------------ read / write


def test_read_trace_small_valid_file(tmp_path):
    p = write_lines(tmp_path,
                    line(timestamp=0, input_length=512, hash_ids=[7]),
                    "",  # blank lines are skipped
                    line(timestamp=12.5, input_length=1025, output_length=..., hash_ids=[7, 8, 9]))  # fmt: skip
    recs = list(read_trace(p))
    assert recs == [TraceRecord(0.0, 512, 5, (7,)), TraceRecord(12.5, 1025, 0, (7, 8, 9))]
    assert isinstance(recs[0].hash_ids, tuple)


@pytest.mark.parametrize(("bad", "what"), [
    ("{not json", "JSONDecodeError"),
    (line(hash_ids=...), "KeyError"),
    (line(input_length=...), "KeyError"),
    (line(timestamp=...), "KeyError"),
    (line(input_length="many"), "ValueError"),
    (line(hash_ids=5), "TypeError"),
    (line(input_length=600, hash_ids=[1]), "do not cover input_length 600"),
    (line(input_length=600, hash_ids=[1, 2, 3]), "do not cover input_length 600"),
    (line(input_length=0, hash_ids=[]), "do not cover input_length 0"),
])  # fmt: skip
def test_read_trace_malformed_line_names_file_and_line(tmp_path, bad, what):
    p = write_lines(tmp_path, line(), line(), bad, line())
    it = read_trace(p)
    assert next(it) == next(it)  # the good lines before it are read
    with pytest.raises(ContractError) as ei:
        next(it)
    assert ei.value.contract == "trace"
    where, msg = ei.value.problems[0]
    assert where == f"{p}:3"
    assert what in msg
    assert f"{p}:3" in str(ei.value)


def test_write_read_roundtrip(tmp_path, trace60):
    p = tmp_path / "t.jsonl"
    assert write_trace(trace60, p) == 60
    assert list(read_trace(p)) == trace60
    assert write_trace([], tmp_path / "empty.jsonl") == 0
    assert list(read_trace(tmp_path / "empty.jsonl")) == []


# ------------------------------------------------------------------------------------------------ generate


def test_generate_is_deterministic_per_seed():
    assert generate(80, seed=5) == generate(80, seed=5)
    assert generate(80, seed=5) != generate(80, seed=6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 120), st.integers(0, 2**32 - 1), st.floats(0.5, 50.0))
def test_generate_shape(n, seed, rate):
    recs = generate(n, seed=seed, rate_per_s=rate)
    assert len(recs) == n
    stamps = [r.timestamp for r in recs]
    assert stamps == sorted(stamps) and all(t >= 0 for t in stamps)
    for r in recs:
        assert covers(r)
        assert r.input_length > 0 and r.output_length > 0
        assert len(set(r.hash_ids)) == len(r.hash_ids)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_chat_sessions_grow(seed):
    recs = generate(60, seed=seed, mix={"chat": 1.0})
    seen: set[int] = set()
    earlier: set[tuple[int, ...]] = set()
    extended = 0
    for r in recs:
        ids = r.hash_ids
        if ids[0] in seen:
            # a later turn: an earlier record's whole prompt plus one or two new blocks
            parents = [ids[:k] for k in (len(ids) - 1, len(ids) - 2) if ids[:k] in earlier]
            assert parents, f"turn {ids} extends no earlier record"
            assert not set(ids[len(parents[0]):]) & seen
            extended += 1
        else:
            assert not set(ids) & seen  # a new session shares nothing
        seen |= set(ids)
        earlier.add(ids)
    assert extended > 0


def test_rag_documents_are_shared():
    recs = generate(100, seed=3, mix={"rag": 1.0})
    docs = collections.Counter(r.hash_ids[:-1] for r in recs)
    assert len(docs) <= 20  # 20 shared documents
    assert max(docs.values()) >= 2
    assert all(4 <= len(d) <= 16 for d in docs)
    questions = [r.hash_ids[-1] for r in recs]
    assert len(set(questions)) == len(questions)  # each question is unique


def test_unique_prompts_share_nothing():
    recs = generate(50, seed=2, mix={"unique": 1.0})
    ids = [h for r in recs for h in r.hash_ids]
    assert len(set(ids)) == len(ids)


def test_agents_share_the_tool_prompt():
    recs = generate(40, seed=4, mix={"agent": 1.0})
    assert len({r.hash_ids[:12] for r in recs}) == 1


# ------------------------------------------------------------------------------------------------ replay


def test_replay_returns_the_three_strategies(trace60, plain_results):
    res = plain_results
    assert list(res) == list(STRATEGIES) == ["nexuskv", "never", "always"]
    total = sum(r.input_length for r in trace60)
    for name, r in res.items():
        assert r.strategy == name
        assert len(r.ttft_ms) == 60 and all(t > 0 for t in r.ttft_ms)
        assert r.tokens_total == total
        assert 0.0 <= r.hit_ratio <= 1.0
    assert sum(res["nexuskv"].actions.values()) == 60


def test_never_reuse_reuses_nothing(plain_results):
    never = plain_results["never"]
    assert never.hit_ratio == 0.0 and never.tokens_reused == 0 and never.bytes_moved == 0.0


def test_always_reuses_at_least_as_much_as_nexuskv(plain_results):
    assert plain_results["always"].hit_ratio >= plain_results["nexuskv"].hit_ratio
    assert plain_results["always"].hit_ratio > 0  # the workload does share prefixes


def test_nexuskv_is_no_slower_than_never(plain_results):
    assert plain_results["nexuskv"].mean_ttft_ms <= plain_results["never"].mean_ttft_ms


def test_congested_slow_tiers_hurt_always_reuse_but_not_nexuskv(congested_results):
    res = congested_results
    assert res["always"].mean_ttft_ms > res["never"].mean_ttft_ms
    assert res["nexuskv"].mean_ttft_ms <= res["never"].mean_ttft_ms
    assert res["always"].hit_ratio >= res["nexuskv"].hit_ratio


def test_replay_is_deterministic(trace60, plain_results):
    again = replay(trace60, profile_path=PROFILE, tier_blocks=SMALL_TIERS, strategies=("nexuskv",))
    assert list(again) == ["nexuskv"]
    assert again["nexuskv"].ttft_ms == plain_results["nexuskv"].ttft_ms
    assert again["nexuskv"].actions == plain_results["nexuskv"].actions


def test_result_properties():
    empty = ReplayResult("x")
    assert empty.mean_ttft_ms == 0.0 and empty.p90_ttft_ms == 0.0 and empty.hit_ratio == 0.0
    few = ReplayResult("x", ttft_ms=[1.0, 2.0, 3.0], tokens_total=10, tokens_reused=4)
    assert few.mean_ttft_ms == 2.0 and few.p90_ttft_ms == 2.0 and few.hit_ratio == 0.4
    many = ReplayResult("x", ttft_ms=[float(i) for i in range(1, 101)])
    assert 89.0 <= many.p90_ttft_ms <= 91.0


def test_summary_table(plain_results):
    text = summary(plain_results)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["strategy", "requests", "hit"]
    assert [ln.split()[0] for ln in lines[1:]] == ["nexuskv", "never", "always"]
    assert all(ln.split()[1] == "60" for ln in lines[1:])


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, ["--log-level", "warning", *args])

    return invoke


def test_cli_gen_trace_writes_a_file(run, tmp_path):
    out = tmp_path / "gen.jsonl"
    res = run("gen-trace", str(out), "-n", "30", "--seed", "3")
    assert res.exit_code == 0, res.output
    assert f"wrote 30 requests to {out}" in res.output
    assert list(read_trace(out)) == generate(30, seed=3)
    res = run("gen-trace", str(tmp_path / "chat.jsonl"), "-n", "10", "--mix", "chat=1")
    assert res.exit_code == 0
    assert list(read_trace(tmp_path / "chat.jsonl")) == generate(10, mix={"chat": 1.0})


@pytest.mark.parametrize("mix", ["bogus=1", "chat", "chat=0", "chat=x"])
def test_cli_gen_trace_bad_mix_is_a_usage_error(run, tmp_path, mix):
    res = run("gen-trace", str(tmp_path / "x.jsonl"), "--mix", mix)
    assert res.exit_code == 2, res.output
    assert not (tmp_path / "x.jsonl").exists()


def test_cli_replay_prints_the_table(run, tmp_path, trace60):
    p = tmp_path / "t.jsonl"
    write_trace(trace60, p)
    res = run("replay", str(p), "--limit", "40", "--dram-blocks", "50", "--disk-blocks", "500",
              "--scale-bandwidth", "disk=0.5")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"40 requests from {p}" in res.output
    assert "'disk': 0.5" in res.output
    rows = {ln.split()[0]: ln for ln in res.output.splitlines() if ln.split()}
    assert {"strategy", "nexuskv", "never", "always"} <= set(rows)
    assert rows["never"].split()[1] == "40"
    assert "NexusKV mean TTFT / best baseline:" in res.output


@pytest.mark.parametrize("bad", ["x", "disk", "disk=fast", "disk=0", "disk=-1"])
def test_cli_replay_bad_scale_bandwidth_is_a_usage_error(run, tmp_path, bad):
    p = tmp_path / "t.jsonl"
    write_trace(generate(3, seed=0), p)
    res = run("replay", str(p), "--scale-bandwidth", bad)
    assert res.exit_code == 2, res.output
    assert "TIER=FACTOR" in res.output


def test_cli_replay_malformed_trace_is_a_clean_error(run, tmp_path):
    p = write_lines(tmp_path, line(), "{oops")
    res = run("replay", str(p))
    assert res.exit_code == 1
    assert isinstance(res.exception, SystemExit)  # a ClickException, not a traceback
    assert f"{p}:2" in res.output


def test_cli_replay_empty_trace(run, tmp_path):
    p = write_lines(tmp_path)
    res = run("replay", str(p))
    assert res.exit_code == 0, repr(res.exception)


def test_cli_replay_invalid_profile_is_a_clean_error(run, tmp_path):
    d = json.loads(Path(PROFILE).read_text())
    d["tiers"]["disk"]["bandwidth_bytes_per_s"] = 0
    prof = tmp_path / "bad-profile.json"
    prof.write_text(json.dumps(d))
    p = tmp_path / "t.jsonl"
    write_trace(generate(3, seed=0), p)
    res = run("replay", str(p), "--profile", str(prof))
    assert res.exit_code == 1
    assert isinstance(res.exception, SystemExit), repr(res.exception)
    assert "tiers.disk.bandwidth_bytes_per_s" in res.output
