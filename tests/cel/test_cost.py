"""The static cost bound charges what an expression builds (issue 29): result types carry size bounds.

Each builder's result type has a `max_size` that is an upper bound of what it really builds (a property over
random inputs within the declared sizes); chained builders compound through these bounds, so the issue's
findings (a huge literal format precision, seven chained `replace` calls on literals) are located load errors;
and the cost of a few typical expressions is pinned.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexuskv.cel import (
    BYTES,
    DOUBLE,
    INT,
    STRING,
    CelCostError,
    CelEvalError,
    CelType,
    CelTypeError,
    Compiled,
    Env,
    compile_expr,
    list_of,
    map_of,
    record_type,
)

MAX_STRING_CHARS = 1 << 20  # what replace, format and join refuse to build past, at run time

ENV = Env({
    "s": STRING.with_size(6), "t": STRING.with_size(3), "u": STRING.with_size(4), "fmt": STRING.with_size(8),
    "b": BYTES.with_size(5), "l": list_of(STRING.with_size(3), max_size=4),
    "m": map_of(STRING.with_size(2), STRING.with_size(3), max_size=3),
    "ln": list_of(list_of(STRING.with_size(2), max_size=2), max_size=3),
    "i": INT, "k": INT, "n": INT, "d": DOUBLE, "flag": STRING.with_size(1),
})  # fmt: skip
ALPHABET = "ab ,%.'\"\\\n\t\u00e9\u20ac\U0001d11e"  # quotes and escapes, white space, 2-, 3- and 4-byte UTF-8


def text(size: int) -> st.SearchStrategy[str]:
    return st.text(ALPHABET, max_size=size)


DOUBLES = st.floats() | st.sampled_from([1.7976931348623157e308, -1.7976931348623157e308, 5e-324, -0.0, 1e21])
ACTIVATIONS = st.fixed_dictionaries({
    "s": text(6), "t": text(3), "u": text(4), "fmt": st.text("%sdfeboxX.019a", max_size=8),
    "b": st.binary(max_size=5), "l": st.lists(text(3), max_size=4),
    "m": st.dictionaries(text(2), text(3), max_size=3), "ln": st.lists(st.lists(text(2), max_size=2), max_size=3),
    "i": st.integers(-(2**63), 2**63 - 1), "k": st.integers(-1, 8), "n": st.integers(-2, 6), "d": DOUBLES,
    "flag": st.sampled_from(["", "y"]),
})  # fmt: skip

BUILDERS = [
    # strings extension
    "s.replace(t, u)", "s.replace(t, u, n)", "s.replace('', u)", "s.replace('a', u, 2)", "s.replace(t, 'xyz')",
    "s.replace('ab', 'abcde')", "s.split(t)", "s.split(t, n)", "s.split('')", "s.split(',', 3)", "s.split('a,')",
    "l.join()", "l.join(t)", "[s, t, 'a'].join(u)", "s.lowerAscii()", "s.upperAscii()", "s.trim()",
    "s.reverse()", "s.substring(k)", "s.substring(k, n)", "s.substring(1, 3)", "s.charAt(k)", "strings.quote(s)",
    # encoders, conversions
    "base64.encode(b)", "base64.decode(t + u)", "bytes(s)", "string(b)", "string(d)", "string(i)",
    # operators, literals, macros
    "s + t", "b + b", "l + [s]", "l + l", "[s, t, u]", "{s: t, u: s}", "l.map(x, x + s)", "l.filter(x, x != t)",
    "l.transformList(j, v, v + t)", "m.transformMap(key, v, key + v)", "m.map(key, m[key] + key)",
    "l.transformMapEntry(j, v, {v: s})",
    # format
    "'%s-%d'.format([s, i])", "'%.3f|%e|%.2e'.format([d, d, d])", "'%b %o %x %X'.format([i, i, s, b])",
    "'%s'.format([l])", "'%s'.format([m])", "'%s %s'.format([ln, b])", "'%f %e'.format([i, i])",
    "'%%%s%%'.format([t])", "'%.12f'.format([d])", "'%x'.format([s])", "'%s'.format([d])", "'%d'.format([d])",
    "'%s'.format([[d, i, true, null]])", "fmt.format([d, i, s])", "fmt.format(l)", "fmt.format([b, s])",
    # chains
    "s.replace(t, u).replace(u, s).upperAscii()", "strings.quote(strings.quote(s))", "(s + t).split(u).join(s)",
    "s.replace('', s).replace('', t)", "l.map(x, x.replace('', t)).join(s)", "(s + t).substring(k)",
    "'%s|%s'.format([s.split(t), l.join(u)]).trim()", "base64.encode(bytes(strings.quote(s)))",
    "flag == '' ? s.replace(t, u) : t + t", "[s.replace(t, u), t][0] + 'x'", "cel.bind(x, s + s, x.replace(t, x))",
    "optional.of(s + t).orValue(u).replace(t, u)", "l.filter(x, x.size() > 1).map(x, x + x).join(t)",
    "s.split('').map(c, strings.quote(c)).join(t).split(t)", "fmt.format([s.reverse()]).lowerAscii()",
]  # fmt: skip


@cache
def compiled(source: str) -> Compiled:
    return compile_expr(source, ENV, cost_limit=10**12)


def fits(value: Any, t: CelType, path: str = "result") -> None:
    """`value` is within the size bounds of `t` (strings, bytes, lists and maps must declare one)."""
    if isinstance(value, str | bytes | list | dict):
        assert t.max_size is not None, f"{path}: {t!r} declares no bound"
        assert len(value) <= t.max_size, f"{path}: {len(value)} > {t.max_size}: {value!r}"
    if isinstance(value, list):
        for i, item in enumerate(value):
            fits(item, t.elem, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            fits(key, t.key, f"{path} key")
            fits(item, t.elem, f"{path}[{key!r}]")


@pytest.mark.parametrize("source", BUILDERS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(activation=ACTIVATIONS)
def test_each_builders_result_bound_is_an_upper_bound_of_what_it_builds(source, activation):
    c = compiled(source)
    try:
        value = c(activation)
    except CelEvalError:
        return
    fits(value, c.type)


SIMPLE_CLAUSES = [("%s", "s"), ("%s", "l"), ("%s", "m"), ("%s", "d"), ("%s", "b"), ("%d", "i"), ("%f", "d"),
                  ("%e", "d"), ("%b", "i"), ("%o", "i"), ("%x", "s"), ("%X", "b"), ("%x", "i"), ("%%", ""),
                  ("ab", ""), (" ", "")]  # fmt: skip
PRECISE_CLAUSES = st.builds(lambda p, verb, arg: (f"%.{p}{verb}", arg), st.integers(0, 60), st.sampled_from("fe"),
                            st.sampled_from(["d", "i"]))  # fmt: skip
FORMAT_PIECES = st.one_of(st.sampled_from(SIMPLE_CLAUSES), PRECISE_CLAUSES)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(FORMAT_PIECES, max_size=6), activation=ACTIVATIONS)
def test_a_literal_format_strings_bound_is_an_upper_bound_of_its_result(pieces, activation):
    fmt = "".join(p for p, _ in pieces)
    args = ", ".join(a for _, a in pieces if a)
    c = compiled(f"'{fmt}'.format([{args}])")
    try:
        value = c(activation)
    except CelEvalError:
        return
    fits(value, c.type)


# ------------------------------------------------------------------------------------------ the findings

MATCH = Env({"match": record_type("Match", {"tokens": INT, "tier": STRING})})


def test_a_huge_literal_precision_is_a_cost_error():
    """Issue 29, finding 5: `"%.200000000f".format([double(match.tokens)])` cost under 20 and took 1.6 s."""
    source = '"%.200000000f".format([double(match.tokens)])'
    with pytest.raises(CelCostError, match=r"exceeds the limit 10000; it may build a string of up to 1048576 ch"):
        compile_expr(source, MATCH)
    nested = f"match.tier != {source}"  # the error points at the call that builds the string
    with pytest.raises(CelCostError, match=r"format\(\) at 1:30 alone costs") as info:
        compile_expr(nested, MATCH)
    assert (info.value.line, info.value.column) == (1, nested.index("format") + 1)
    # the precision is read at check time: the bound grows with it (up to the run-time size limit)
    sizes = [compile_expr(f"'%.{p}f'.format([1.5])", MATCH, cost_limit=10**9).type.max_size for p in (0, 900)]
    assert sizes == [312, 312 + 900]
    assert compile_expr(source, MATCH, cost_limit=10**9).type.max_size == MAX_STRING_CHARS


def test_seven_chained_replaces_on_literals_are_a_cost_error_at_once():
    """Issue 29: seven chained `.replace` calls on literals took 7 s and 486 MiB in `policy check`."""
    source = "'" + "a" * 64 + "'" + ".replace('a', 'aaaaaaaaaa')" * 7
    started = time.perf_counter()
    with pytest.raises(CelCostError, match=r"replace\(\) at 1:149 alone costs \d+; it may build a string of up to"
                                           r" 640000 characters") as info:  # fmt: skip
        compile_expr(source, MATCH)
    assert time.perf_counter() - started < 1.0  # refused before anything is folded
    fourth = 66 + 3 * 27 + 1  # the literal, three `.replace('a', 'aaaaaaaaaa')`, then `.`
    assert source[fourth:].startswith("replace") and (info.value.line, info.value.column) == (1, fourth + 1)
    s64 = Env({"s": STRING.with_size(64)})  # the same chain on a variable (literals would be folded)
    bounds = [compile_expr("s" + ".replace('a', 'aaaaaaaaaa')" * k, s64, cost_limit=10**12).type.max_size
              for k in range(1, 7)]  # fmt: skip
    assert bounds == [640, 6400, 64000, 640000, MAX_STRING_CHARS, MAX_STRING_CHARS]


def test_the_findings_are_located_problems_in_a_policy_file(tmp_path):
    from nexuskv.policy.loader import Policies

    wide = '"%.200000000f".format([double(match.tokens)]) != "x"'
    chained = "'" + "a" * 64 + "'" + ".replace('a', 'aaaaaaaaaa')" * 7
    (tmp_path / "default.toml").write_text(
        f"[[reuse]]\nname = \"wide\"\nwhen = '{wide}'\n\n[[reuse]]\nname = \"chained\"\nwhen = \"{chained} == ''\"\n"
    )
    problems = sorted(Policies.check(tmp_path), key=lambda p: p.line or 0)
    assert [(p.rule, p.line) for p in problems] == [("wide", 3), ("chained", 7)], problems
    first, second = problems
    assert first.column == 9 + wide.index("format")  # at the call, in the file (the value starts at column 9)
    assert first.message.startswith("when: estimated cost") and "format() at 1:" in first.message
    fourth = 66 + 3 * 27 + 1  # the fourth `.replace(...)` is the first over the budget
    assert chained[fourth:].startswith("replace") and second.column == 9 + fourth
    assert "it may build a string of up to 640000 characters" in second.message


# ------------------------------------------------------------------------------------------ figures

PIN = Env({"s": STRING.with_size(100), "d": DOUBLE, "l": list_of(STRING.with_size(10), max_size=5), "u": STRING})


@pytest.mark.parametrize(
    ("source", "cost", "bound"),
    [
        ("s.replace('a', 'bb')", 24, 200),  # 100 + 100 * (2 - 1)
        ("s + s", 23, 200),
        ("'%.3f'.format([d])", 36, 315),  # 309 digits, sign, point, 3 decimals (and 1 to spare)
        ("l.join(', ')", 9, 58),  # 5 * 10 + 4 * 2
        ("s.split(',')", 104, 101),  # items
        ("s.lowerAscii()", 12, 100),
        ("strings.quote(s)", 23, 202),
        ("l + ['x']", 10, 6),  # items
        ("l.map(x, x + '!')", 32, 5),
        ("u.replace('a', 'b')", 414, 4096),  # no maxLength: the default 4096
        ("u + u", 823, 8192),
    ],
)
def test_cost_figures(source, cost, bound):
    c = compile_expr(source, PIN)
    assert (c.cost, c.type.max_size) == (cost, bound)


def test_bounds_survive_joins_and_parse_only_mode():
    # a branch bounded above the default keeps its bound when joined with an undeclared one
    assert compile_expr("d > 0.0 ? s.replace('', s) : u", PIN, cost_limit=10**6).type.max_size == 100 + 101 * 100
    # parse-only mode types literals as dyn; a builder reads their length from the literal itself
    assert compile_expr("'abc'.replace('a', 'bb')", PIN, checked=False).cost < 20
    with pytest.raises(CelCostError):
        compile_expr("u.replace('', u)", PIN)
    with pytest.raises(CelTypeError, match="over the size limit"):  # folding stops at the run-time limit too
        compile_expr("'" + "a" * 64 + "'" + ".replace('a', 'aaaaaaaaaa')" * 7, PIN, cost_limit=10**12)


def test_folding_reports_the_run_time_cost():
    """The budget is checked before folding (folding does the work it bounds); `cost` is what is left to run."""
    c = compile_expr("s == 'ab'.replace('b', 'cd')", PIN)
    assert "'acd'" in c.python
    assert c.cost == 1 + 1 + 1 + 1


def test_concatenating_dyn_operands_is_bounded_at_run_time():
    """Review of issue 29: `dyn` drops the static size, so `dyn(s) + dyn(s)` chained through `cel.bind` doubled a
    string per step at a cost under 100 (8 MiB in 21 steps); the run time now stops it at about 1 Mi."""
    from nexuskv.cel import CelEvalError, Env, compile_expr
    from nexuskv.cel import types as T

    src = "cel.bind(v0, dyn(s), " + "".join(f"cel.bind(v{i}, v{i - 1} + v{i - 1}, " for i in range(1, 22))
    src += "size(v21)" + ")" * 22
    fn = compile_expr(src, Env(variables={"s": T.STRING.with_size(8)}))
    assert fn.cost < 200  # the static bound sees nothing through dyn: the run time has to
    with pytest.raises(CelEvalError, match="over the size limit of 1048576"):
        fn({"s": "abcdefgh"})
    lists = compile_expr("cel.bind(a, dyn(l), " + "".join(f"cel.bind(a{i}, {'a' if i == 1 else f'a{i - 1}'} + "
                         f"{'a' if i == 1 else f'a{i - 1}'}, " for i in range(1, 22)) + "size(a21)" + ")" * 22,
                         Env(variables={"l": T.list_of(T.INT, 8)}))  # fmt: skip
    with pytest.raises(CelEvalError, match="over the size limit"):
        lists({"l": list(range(8))})
    assert compile_expr("dyn(s) + dyn(s)", Env(variables={"s": T.STRING}))({"s": "ab"}) == "abab"
