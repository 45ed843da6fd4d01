import json

import pytest
from click.testing import CliRunner

from nexuskv import to_dict
from nexuskv.cli import cli
from tests.conftest import make_request
from tests.plugins.test_manager import GOOD, install_dist


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, ["--log-level", "warning", *args], catch_exceptions=False)

    return invoke


def test_plugins_lists_builtins_with_hooks(run):
    res = run("plugins")
    assert res.exit_code == 0
    assert "dram" in res.output and "nexuskv_register_tier_stores" in res.output


def test_plugins_json_and_problem_exit_code(run, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    install_dist(tmp_path, "nexuskv-broken", {"broken": "raise ImportError('no such lib')\n"})
    install_dist(tmp_path, "nexuskv-null", {"null": GOOD})
    res = run("plugins", "--json")
    assert res.exit_code == 1
    data = json.loads(res.stdout)
    assert {p["name"] for p in data["plugins"]} >= {"dram", "null"}
    assert data["problems"][0]["plugin"] == "broken"


def test_schema_check_and_export(run, tmp_path):
    assert run("schema", "export", "--check").exit_code == 0
    res = run("schema", "export", "--dir", str(tmp_path))
    assert res.exit_code == 0 and len(list(tmp_path.glob("*.v1.json"))) == 5
    (tmp_path / "plan.v1.json").write_text("{}")
    res = run("schema", "export", "--dir", str(tmp_path), "--check")
    assert res.exit_code == 1 and "plan.v1.json" in res.output


def test_schema_validate(run, tmp_path):
    good = tmp_path / "req.json"
    good.write_text(json.dumps(to_dict(make_request(range(40)))))
    assert run("schema", "validate", "request", str(good)).exit_code == 0
    bad = tmp_path / "bad.json"
    d = to_dict(make_request(range(40)))
    d["token_ids"][3] = "x"
    bad.write_text(json.dumps(d))
    res = run("schema", "validate", "request", str(bad))
    assert res.exit_code == 1 and "token_ids[3]: expected integer, got string" in res.output
    broken = tmp_path / "broken.json"
    broken.write_text("{\n  'x': 1}")
    res = CliRunner().invoke(cli, ["schema", "validate", "request", str(broken)])
    assert res.exit_code == 1 and "line 2 column 3" in res.output


def test_keys(run, tmp_path):
    f = tmp_path / "req.json"
    f.write_text(json.dumps(to_dict(make_request(range(40)))))
    res = run("keys", "--request", str(f))
    assert res.exit_code == 0
    assert len(res.output.splitlines()) == 2 and "[16, 32)" in res.output


def test_demo_runs_and_shows_isolation(run):
    res = run("demo", "--turns", "3", "--requests", "40")
    assert res.exit_code == 0, res.output
    assert "tenant globex              reusable tokens: 0" in res.output
    assert "hybrid dense+recurrent" in res.output


def test_demo_numbers():
    from nexuskv.cli.demo import run_demo

    out = run_demo(turns=3, echo=lambda *_: None, requests=100)
    assert out["turn1_reused"] == 0 and out["turn2_reused"] > 0 and out["turn3_reused"] > out["turn2_reused"]
    assert out["tenant globex"] == out["model revision r2"] == out["cache salt 'x'"] == 0
    assert out["same tenant, same model"] > 0
    assert out["recurrent (ckpt every 16)"] % 16 == 0
    for label in ("equal priorities", "deeper blocks first"):  # a full tier refuses the tail, keeps the head
        assert out[f"evictions {label}"] == 0 and out[f"refused {label}"] == 16
        assert out[f"indexed {label}"] == 24 and out[f"longest {label}"] == 24
    assert out["plan chat"] == out["plan strict"] == out["plan rag"] == 1024
    assert out["plan congested"] == 0  # loading from the congested disk would lose: recompute
    assert out["shared to chat"] == 1024 and out["shared to globex"] == 0  # rag shares its documents with chat
    assert out["sim congested NIC and disk (5% bandwidth)"] < 1000  # beats every other router
    assert out["sim normal links"] <= 1000  # never worse than the best of them


def test_plan_prints_the_plan_and_why(run, tmp_path):
    f = tmp_path / "req.json"
    f.write_text(json.dumps(to_dict(make_request(range(100)))))
    res = CliRunner().invoke(cli, ["--log-level", "warning", "plan", "--request", str(f)])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert plan["action"] == "recompute" and plan["tokens_total"] == 100
    assert "why: match: nothing reusable" in res.stderr


# ------------------------------------------------------------------------------------------ hostile input

from pathlib import Path  # noqa: E402

from hypothesis import given  # noqa: E402
from hypothesis import settings as hsettings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

POLICY_FILE = str(Path(__file__).resolve().parents[2] / "policies" / "tenants" / "chat.toml")
JSON_INPUT = ["keys", "--request"], ["plan", "--request"], ["schema", "validate", "request"], \
    ["schema", "validate", "plan"], ["policy", "explain", POLICY_FILE, "--input"]  # fmt: skip

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)
valid_request = to_dict(make_request(range(40)))


def _mutations():
    """Valid requests with one field replaced by something hostile, and arbitrary JSON documents."""
    fields = sorted(valid_request)
    return st.one_of(
        json_values.map(json.dumps),
        st.tuples(st.sampled_from(fields), json_values).map(lambda fv: json.dumps({**valid_request, fv[0]: fv[1]})),
        st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
        st.integers(1, 200_000).map(lambda n: "[" * n + "]" * n),
        st.integers(1, 200_000).map(lambda n: '{"model": ' * n + "1" + "}" * n),
    )


def _invoke_raw(args, tmp_path, text):
    p = tmp_path / "input.json"
    p.write_text(text, encoding="latin-1" if not text.isascii() else "utf-8")
    runner = CliRunner()
    return runner.invoke(cli, ["--log-level", "error", *args, str(p)], env={"NEXUSKV_SECRET": "ab" * 16}), p


@hsettings(max_examples=60)
@given(text=_mutations(), which=st.integers(0, len(JSON_INPUT) - 1))
def test_hostile_json_input_is_one_clear_error_line_never_a_traceback(tmp_path_factory, text, which):
    res, path = _invoke_raw(JSON_INPUT[which], tmp_path_factory.mktemp("cli"), text)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    if res.exit_code != 0:  # one `Error:` line, or one line per problem naming the file and the field
        lines = res.output.splitlines()
        assert lines and ((lines[0].startswith("Error: ") and len(lines) == 1)
                          or all(ln.startswith(f"{path}: ") for ln in lines)), res.output  # fmt: skip


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "\xff\xfe\x00garbage", ""])
def test_the_classic_hostile_files(tmp_path, text):
    res, _ = _invoke_raw(["keys", "--request"], tmp_path, text)
    assert res.exit_code == 1 and res.output.count("\n") == 1 and res.output.startswith("Error: ")
    assert "Traceback" not in res.output


def test_a_directory_or_unreadable_request_is_one_line(tmp_path):
    res = CliRunner().invoke(cli, ["keys", "--request", str(tmp_path)])
    assert res.exit_code != 0 and "Traceback" not in res.output


def test_policy_explain_a_route_rule(tmp_path):
    f = tmp_path / "in.json"
    f.write_text(json.dumps({"kind": "route", "target": {"node": "gpu-7", "labels": {"trust": "low"},
                                                         "queue_ms": 3000.0}}))  # fmt: skip
    strict = str(Path(__file__).resolve().parents[2] / "policies" / "tenants" / "strict.toml")
    res = CliRunner().invoke(cli, ["--log-level", "warning", "policy", "explain", strict, "--input", str(f)])
    assert res.exit_code == 0, res.output
    assert "rule trusted-nodes-only [exclude]: FIRED" in res.output
    assert "allowed=False, weight=2.0, deciding=['trusted-nodes-only', 'prefer-idle']" in res.output


def test_policy_explain_input_is_inline_json_or_a_file(tmp_path):
    """The README shows `--input '{...}'`; a file works too, and either failing is one precise line."""
    chat = str(Path(__file__).resolve().parents[2] / "policies" / "tenants" / "chat.toml")
    inline = '{"kind": "admit", "state": {"namespace": {"tenant": "chat", "scope": "tmp-1"}}}'
    f = tmp_path / "in.json"
    f.write_text(inline)
    outputs = []
    for value in (inline, f"  {inline}", str(f)):
        res = CliRunner().invoke(cli, ["--log-level", "warning", "policy", "explain", chat, "--input", value])
        assert res.exit_code == 0, res.output
        assert "rule no-tmp-sessions [deny]: FIRED" in res.output
        outputs.append([ln for ln in res.output.splitlines() if ln.startswith("verdict: ")])
    assert outputs[0] == outputs[1] == outputs[2] and "allowed=False" in outputs[0][0]
    try:  # the json module's own words and column (3.13 says "Illegal trailing comma" at column 17)
        json.loads('{"kind": "admit",}')
    except json.JSONDecodeError as exc:
        trailing = f"line {exc.lineno} column {exc.colno}: {exc.msg}"
    for value, message in (
        ('{"kind": "admit",}', f"Error: --input: inline JSON, {trailing} (a value starting with '{{' is read as JSON, "
                               "anything else as a file)"),
        (str(tmp_path / "nope.json"), f"Error: --input {tmp_path / 'nope.json'}: no such file (the input is a JSON "
                                      "file, or inline JSON starting with '{')"),
        ("[1, 2]", "Error: --input [1, 2]: no such file (the input is a JSON file, or inline JSON starting with '{')"),
        (str(tmp_path), f"Error: {tmp_path}: cannot read it: Is a directory"),
    ):
        res = CliRunner().invoke(cli, ["--log-level", "warning", "policy", "explain", chat, "--input", value])
        assert res.exit_code == 1 and res.output == message + "\n", res.output


# ------------------------------------------------------------------------------------------ policy explain, by kind

SHIPPED = Path(__file__).resolve().parents[2] / "policies"
LITERALS = """name = "lit"
extends = "default"

[[admit]]
name = "empty-payload"
when = "state.nbytes == 0 || false"

[[reuse]]
name = "always-warn"
effect = "warn"
when = "true && match.tokens > 0"

[[place]]
name = "pinned"
tier = "dram"
ttl = "1h"
priority = 5.0

[[share]]
name = "docs-to-everyone"
scope = "docs"
tenants = ["*"]

[[route]]
name = "drained"
effect = "exclude"
when = '"drain" in target.labels || false'
"""
"""A tenant whose rules hold `true` / `false` literals, or leave `when` to its default (`true`, place and share)."""


@pytest.fixture
def policy_dir(tmp_path):
    import shutil

    shutil.copytree(SHIPPED, tmp_path / "policies", ignore=shutil.ignore_patterns("tests"))
    (tmp_path / "policies" / "tenants" / "lit.toml").write_text(LITERALS)
    return tmp_path / "policies"


def _explain(policy_file, data, *options):
    return CliRunner().invoke(cli, [*options, "--log-level", "warning", "policy", "explain", str(policy_file),
                                    "--input", json.dumps(data)])  # fmt: skip


@pytest.mark.parametrize("kind, tenant, data, fired, verdict", [
    ("admit", "chat", {"state": {"namespace": {"tenant": "chat", "scope": "tmp-1"}}}, "no-tmp-sessions [deny]",
     "allowed=False, deciding=['no-tmp-sessions']"),
    ("reuse", "chat", {"node": "edge-1", "match": {"tokens": 9000, "tier": "dram"}, "cost": {"gain_ms": 5.0}},
     "cap-untrusted-node [deny]", "allowed=True, max_tokens=8192, deciding=['cap-untrusted-node']"),
    ("place", "chat", {"state": {"span": {"start": 4080, "end": 4096}}}, "long-sessions [apply]",
     "deciding=['long-sessions'], fired=['long-sessions'], placement={'tier': 'dram', 'ttl_s': 7200.0, "
     "'priority': 8.0}"),
    ("share", "rag", {"request": {"tenant": "chat"}, "match": {"tokens": 64, "scope": "docs"}},
     "docs-to-partners [allow]", "allowed=True, deciding=['docs-to-partners']"),
    ("route", "strict", {"target": {"node": "gpu-7", "labels": {"trust": "low"}, "queue_ms": 3000.0}},
     "trusted-nodes-only [exclude]", "allowed=False, weight=2.0, deciding=['trusted-nodes-only', 'prefer-idle']"),
])  # fmt: skip
def test_policy_explain_works_for_every_rule_kind_of_the_shipped_policies(kind, tenant, data, fired, verdict):
    """The place case crashed (`bad operand type for unary -`): the default place rule's `when` is `true`."""
    res = _explain(SHIPPED / "tenants" / f"{tenant}.toml", {"kind": kind, **data})
    assert res.exit_code == 0, res.output
    assert f"policy {tenant} (revision " in res.output and f", {kind} rules, files: " in res.output
    assert f"rule {fired}: FIRED" in res.output
    assert verdict in res.output.splitlines()[-1]


@pytest.mark.parametrize("kind, data, trace, verdict", [
    ("admit", {"state": {"nbytes": 0}}, ["rule empty-payload [deny]: FIRED",
                                         "  when: state.nbytes == 0 || false  =>  true",
                                         "      state.nbytes == 0  =>  true"], "allowed=False"),
    ("reuse", {"match": {"tokens": 32}}, ["rule always-warn [warn]: FIRED",
                                          "  when: true && match.tokens > 0  =>  true",
                                          "      match.tokens > 0  =>  true"], "warnings=['always-warn']"),
    ("place", {}, ["rule pinned [apply]: FIRED", "  when: true  =>  true",
                   "rule hot-in-dram [apply]: no (skipped: pinned fired first, and the first place rule to fire "
                   "decides)"], "placement={'tier': 'dram', 'ttl_s': 3600.0, 'priority': 5.0}"),
    ("share", {"request": {"tenant": "chat"}, "match": {"tokens": 32, "scope": "docs"}},
     ["rule docs-to-everyone [allow]: FIRED", "  when: true  =>  true"], "allowed=True"),
    ("route", {"target": {"node": "n1", "labels": {"drain": "yes"}}}, [
        "rule drained [exclude]: FIRED", """  when: "drain" in target.labels || false  =>  true""",
        """      "drain" in target.labels  =>  true"""], "allowed=False"),
])  # fmt: skip
def test_policy_explain_works_for_every_rule_kind_with_true_and_false_in_its_rules(policy_dir, kind, data, trace,
                                                                                   verdict):  # fmt: skip
    """`true` / `false` anywhere in a rule (a place or share rule's default `when` is `true`) crashed explain."""
    res = _explain(policy_dir / "tenants" / "lit.toml", {"kind": kind, **data})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert [ln for ln in trace if ln not in lines] == [], res.output
    assert verdict in lines[-1]


def test_policy_explain_shows_a_share_grant_that_is_not_for_this_reader_as_skipped(policy_dir):
    res = _explain(policy_dir / "tenants" / "rag.toml", {"kind": "share", "request": {"tenant": "globex"},
                                                         "match": {"tokens": 32, "scope": "docs"}})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert ('rule docs-to-partners [allow]: no (skipped: it grants scope "docs" to "chat", "partner-a", not to tenant '
            '"globex" reading scope "docs")') in res.output
    assert res.output.splitlines()[-1].endswith("allowed=False")


@pytest.mark.parametrize("options, env, shown", [
    (["--log-level", "debug"], {}, True),
    ([], {"NEXUSKV_LOG_LEVEL": "debug"}, True),  # the level's default
    (["--log-level", "info"], {"NEXUSKV_LOG_LEVEL": "debug"}, False),  # the option decides
    (["--log-level", "warning"], {}, False),
    ([], {}, False),
])  # fmt: skip
def test_an_unexpected_error_is_one_line_with_its_traceback_above_it_at_log_level_debug(monkeypatch, options, env,
                                                                                         shown):  # fmt: skip
    import nexuskv.policy.authoring.explain as explain_module

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(explain_module, "explain", broken)
    for name in ("NEXUSKV_DEBUG", "NEXUSKV_LOG_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    args = [*options, "policy", "explain", str(SHIPPED / "tenants" / "chat.toml"), "--input", '{"kind": "admit"}']
    res = CliRunner().invoke(cli, args, env=env)
    assert res.exit_code == 1
    assert res.stdout == "" and res.stderr.splitlines()[-1] == "Error: RuntimeError: boom"
    if shown:
        lines = res.stderr.splitlines()
        start = lines.index("Traceback (most recent call last):")
        assert 'raise RuntimeError("boom' in res.stderr and lines[start:][-3:-1] == ["RuntimeError: boom",
                                                                                   "second line"]  # fmt: skip
    else:
        assert res.stderr == "Error: RuntimeError: boom\n"
