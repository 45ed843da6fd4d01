"""CEL's standard library and extensions as the compiler implements them (`runtime/overloads.py`, `stdlib.py`,
`extensions.py`, `syntax/macros.py`, `checker/names.py`, `checker/generics.py`, `values.py`): gradual typing,
run-time uint, type values, optionals, namespaced functions, containers, the parse-only mode, generic plugin
functions, and a differential of the fast path against the exact path over generated expressions that use them. The
official conformance suite (tests/cel/test_conformance.py) covers each function case by case; these tests pin what a
policy author relies on beyond it."""

from __future__ import annotations

import copy
import datetime as dt
import pickle
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexuskv.cel import (
    BOOL,
    DYN,
    INT,
    STRING,
    TIMESTAMP,
    UINT,
    CelEvalError,
    CelSyntaxError,
    CelTypeError,
    Env,
    FunctionDecl,
    OptionalValue,
    TypeValue,
    Uint,
    abstract_type,
    compile_expr,
    list_of,
    map_of,
    optional_of,
    record_type,
    type_of,
    type_param,
)
from nexuskv.cel.runtime.timestamps import dur_ns, make_dur, make_ts, ts_ns
from nexuskv.cel.values import MixedKeyMap

ENV = Env({
    "i": INT, "u": UINT, "s": STRING, "d": DYN, "li": list_of(INT, 16), "lu": list_of(UINT, 16),
    "m": map_of(STRING, INT, 16), "a.b.c": STRING, "x.y": STRING,
})  # fmt: skip
ACT = {"i": 7, "u": 3, "s": "abc", "d": 2.5, "li": [1, 2, 3], "lu": [4, 5], "m": {"k": 1}, "a.b.c": "abc",
       "x.y": "xy"}  # fmt: skip


def ev(source: str, act: dict | None = None, **kw):
    compiled = compile_expr(source, ENV, **kw)
    a = ACT if act is None else act
    fast = compiled(a)
    exact = compiled.evaluate_exact(a)
    assert type(fast) is type(exact) and fast == exact
    return fast


def fails(source: str, match: str, **kw) -> None:
    compiled = compile_expr(source, ENV, **kw)
    with pytest.raises(CelEvalError, match=match):
        compiled(ACT)
    with pytest.raises(CelEvalError, match=match):
        compiled.evaluate_exact(ACT)


def test_dyn_dispatches_at_run_time():
    assert ev("dyn(1) + 2") == 3
    assert ev("dyn(u) + 2u") == 5 and type(ev("dyn(u) + 2u")) is Uint
    assert ev("dyn(1) == 1u") is True and ev("dyn(1.0) == 1") is True
    fails("dyn(1u) + 1", "no such overload")
    fails("dyn('a') < 1", "no such overload")


def test_uint_values_read_from_the_activation_keep_their_kind_under_dyn():
    assert ev("type(dyn(u)) == uint") is True  # u is bound to a plain int; it is declared uint
    assert ev("dyn(lu[0]) + 1u") == 5
    assert ev("type(dyn(i)) == int") is True


def test_numbers_order_across_kinds_as_doubles():
    assert ev("1 < 1.5") is True and ev("2u > 1.5") is True and ev("1 <= 1u") is True
    assert ev("dyn(9223372036854775807) < 9223372036854775808.0") is False  # compared as doubles (cel-go)


def test_equality_stays_statically_typed():
    with pytest.raises(CelTypeError, match="cannot compare int == uint"):
        compile_expr("1 == 1u", ENV)
    with pytest.raises(CelTypeError, match="cannot compare int == string"):
        compile_expr("i == 'a'", ENV)


def test_type_values():
    assert ev("type(1) == int") is True and ev("type(u) == uint") is True
    assert ev("type(d) == double") is True and ev("type(type(1)) == type") is True
    assert ev("type([]) == list") is True and ev("type(null) == null_type") is True
    assert ev("type(s)") == TypeValue("string")
    assert compile_expr("type(i)", ENV).type == type_of(INT)
    fails("type(1 / 0)", "division by zero")  # the argument is evaluated even when its type is known


def test_conversions():
    assert ev("bool('true') && !bool('0')") is True
    fails("bool('yes')", "cannot convert")
    assert ev("bytes('é')") == "é".encode()
    assert ev("timestamp(0)") == dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    assert ev("duration(duration('1s'))") == dt.timedelta(seconds=1)
    fails("int(-9223372036854775808.0)", "out of range")



def test_timestamps_and_durations_count_nanoseconds():
    t = "timestamp('2024-01-01T00:00:00.000000001Z')"
    assert ev(f"string({t})") == "2024-01-01T00:00:00.000000001Z"
    assert ev(f"{t} > timestamp('2024-01-01T00:00:00Z')") is True
    assert ev(f"{t} - duration('1ns') == timestamp('2024-01-01T00:00:00Z')") is True
    assert ev(f"{t} - timestamp('2024-01-01T00:00:00Z') == duration('1ns')") is True
    assert ev(f"{t} - timestamp('2024-01-01T00:00:00Z')") != dt.timedelta(0)
    assert ev("string(duration('1.000000001s') + duration('999999999ns'))") == "2s"
    assert ev("string(duration('-1ns'))") == "-0.000000001s"
    assert ev("duration('1500us') == duration('1.5ms')") is True  # plain timedeltas where microseconds suffice
    assert type(ev("duration('1500us')")) is dt.timedelta
    assert ev("[timestamp('2024-01-01T00:00:00.5Z')].exists(x, x < " + t + " + duration('1s'))") is True
    fails("timestamp('9999-12-31T23:59:59.999999999Z') + duration('1ns')", "out of range")


def test_time_accessors_take_a_zone():
    t = "timestamp('2024-03-10T01:30:00Z')"
    assert ev(f"{t}.getHours()") == 1 and ev(f"{t}.getHours('America/New_York')") == 20
    assert ev(f"{t}.getHours('+05:30')") == 7 and ev(f"{t}.getDayOfWeek()") == 0
    fails(f"{t}.getHours('Mars/Olympus')", "unknown time zone")
    assert ev("duration('90m').getHours()") == 1 and ev("duration('1.5s').getMilliseconds()") == 500


def test_extension_functions():
    assert ev("'TacoCat'.lowerAscii() + s.upperAscii()") == "tacocatABC"
    assert ev("'a,b,c'.split(',', 2)") == ["a", "b,c"]
    assert ev("'%d items at %.2f'.format([i, d])") == "7 items at 2.50"
    assert ev("math.greatest(i, 2.5, u)") == 7 and ev("math.least(li)") == 1
    assert ev("math.bitShiftRight(-1024, 3)") == 2305843009213693824
    assert ev("base64.decode(base64.encode(b'hi'))") == b"hi"
    fails("math.abs(-9223372036854775807 - 1)", "overflow")


def test_namespaced_functions_yield_to_variables():
    env = ENV.extend({"math": map_of(STRING, INT)})
    with pytest.raises(CelTypeError, match="unknown method 'greatest'"):
        compile_expr("math.greatest(1, 2)", env)  # `math` is a variable here


def test_two_variable_comprehensions_and_bind():
    assert ev("li.all(k, v, v == k + 1)") is True and ev("m.exists(k, v, k == 'k' && v == 1)") is True
    assert ev("li.transformList(k, v, k * v)") == [0, 2, 6]
    assert ev("m.transformMap(k, v, v + 1)") == {"k": 2}
    assert ev("cel.bind(t, i * 2, t + t)") == 28
    assert ev("li.existsOne(v, v > 2)") is True


def test_optionals():
    assert ev("m.?k.orValue(0) + m.?z.orValue(5)") == 6
    assert ev("m[?'z'].hasValue()") is False and ev("li[?1]") == OptionalValue(True, 2)
    assert ev("optional.of(m).k.value()") == 1  # selection on an optional is optional selection
    assert ev("[?m.?k, ?m.?z, 3]") == [1, 3] and ev("{?'a': m.?z, 'b': 2}") == {"b": 2}
    assert ev("optional.of(2).optMap(v, v * 3).value()") == 6
    assert compile_expr("m.?k", ENV).type == optional_of(INT)
    fails("optional.none().value()", "has no value")


def test_mixed_literals_are_dyn_and_work():
    assert compile_expr("[1, 'a', 2.0]", ENV).type == list_of(DYN)
    assert ev("[1, 'a'][1] == 'a'") is True and ev("{1: 'a', 'b': 2}['b']") == 2
    fails("{1.5: 1}", "map keys", checked=False)


def test_qualified_names_and_containers():
    assert ev("a.b.c") == "abc" and ev("c", container="a.b") == "abc"
    assert ev("b.c", container="a") == "abc" and ev(".x.y", container="q") == "xy"
    assert ev("['z'].exists(y, x.y == 'xy')") is True
    with pytest.raises(CelTypeError, match="undeclared variable 'c'"):
        compile_expr("c", ENV)


def test_parse_only_mode_defers_type_errors_to_run_time():
    with pytest.raises(CelTypeError):
        compile_expr("1 + 'a'", ENV)
    fails("1 + 'a'", "no such overload", checked=False)
    assert ev("false && (1 + 'a')", checked=False) is False  # errors are absorbed like any run-time error
    assert ev("nope == 1 || true", checked=False) is True


def test_macros_can_be_disabled():
    with pytest.raises(CelTypeError, match="unknown function 'has'"):
        compile_expr("has(m.k)", ENV, macros=False)


def test_precise_load_time_errors_remain():
    with pytest.raises(CelTypeError, match=r"no matching overload for string\.charAt\(string\)"):
        compile_expr("s.charAt('x')", ENV)
    with pytest.raises(CelTypeError, match=r"unknown function 'math\.greatst' \(did you mean 'math\.greatest'\?\)"):
        compile_expr("math.greatst(1)", ENV)
    with pytest.raises(CelSyntaxError):
        compile_expr("m.?", ENV)
    with pytest.raises(CelTypeError, match="timestamp"):  # malformed text: a load-time error where asked for
        compile_expr("timestamp('not a time')", ENV, strict_literals=True)  # (policies); the spec's: run time


def test_generic_plugin_functions():
    first = FunctionDecl("first", [list_of(type_param("T"))], type_param("T"), lambda xs: xs[0])
    pair = FunctionDecl("pair", [type_param("A"), type_param("B")],
                        abstract_type("pair", type_param("A"), type_param("B")), lambda a, b: (a, b))  # fmt: skip
    env = ENV.extend(functions={"first": first, "pair": pair})
    assert compile_expr("first(li)", env).type == INT and compile_expr("first(['a'])", env).type == STRING
    assert compile_expr("first(li) + 1", env)(ACT) == 2
    assert str(compile_expr("pair(1, 'a')", env).type) == "pair(int, string)"
    assert str(compile_expr("[pair(1, 'a'), pair(dyn(1), 'b')][0]", env).type) == "pair(dyn, string)"
    with pytest.raises(CelTypeError, match="argument 1 of first"):
        compile_expr("first(1)", env)


# --------------------------------------------------------------------------------------------- differential

_LEAVES = ["i", "u", "d", "s", "1", "2u", "2.5", "'x'", "true", "null", "li", "lu", "m", "dyn(i)", "dyn(u)",
           "[1, 'a']", "{1: 2, 'k': true}", "dyn(true)", "optional.of(1)", "optional.none()", "m.?k", "li[?5]",
           "timestamp('2024-01-01T00:00:00.000000001Z')", "duration('1ns')"]  # fmt: skip
_UNARY = ["dyn({})", "type({})", "string({})", "int({})", "double({})", "size({})", "{}.hasValue()",
          "{}.orValue(0)", "math.greatest({}, 1)", "[{}, 1][0]", "{{'k': {}}}.k", "!{}", "-{}",
          "{}.transformList(k, v, v)", "{}.exists(k, v, v == 1)", "cel.bind(z, {}, z)", "{}[true]", "{}[1]",
          "cel.bind(z, {}, true)", "math.bitNot({})"]  # fmt: skip
_BINARY = ["{} + {}", "{} - {}", "{} * {}", "{} / {}", "{} % {}", "{} == {}", "{} < {}", "{} in {}",
           "{} && {}", "{} || {}", "{} ? 1 : 2"]  # fmt: skip


def _exprs(depth: int) -> st.SearchStrategy[str]:
    if depth == 0:
        return st.sampled_from(_LEAVES)
    sub = _exprs(depth - 1)
    return st.one_of(
        st.sampled_from(_LEAVES),
        st.tuples(st.sampled_from(_UNARY), sub).map(lambda x: x[0].format(f"({x[1]})")),
        st.tuples(st.sampled_from(_BINARY), sub, sub).map(lambda x: x[0].format(f"({x[1]})", f"({x[2]})")),
    )


@settings(max_examples=400, deadline=None)
@given(_exprs(3), st.booleans())
def test_fast_and_exact_paths_agree(source, checked):
    """Whatever compiles, the fast path and the exact path give the same value or both fail."""
    try:
        compiled = compile_expr(source, ENV, checked=checked, cost_limit=10**9)
    except (CelTypeError, CelSyntaxError):
        return
    outcomes = []
    for fn in (compiled, compiled.evaluate_exact):
        try:
            v = fn(ACT)
            outcomes.append(("value", type(v), v))
        except CelEvalError:
            outcomes.append(("error",))
    assert outcomes[0][0] == outcomes[1][0], (source, outcomes)
    if outcomes[0][0] == "value":
        assert outcomes[0][1] is outcomes[1][1] and (outcomes[0][2] == outcomes[1][2]
                                                       or outcomes[0][2] != outcomes[0][2]), (source, outcomes)


def test_compiling_and_evaluating_from_many_threads():
    sources = ["math.greatest(li) + i", "'%d items'.format([i]).size()", "m.?k.orValue(0)", "type(dyn(u)) == uint",
               "li.transformList(k, v, k + v)"]  # fmt: skip
    expected = [ev(src) for src in sources]
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(50):
                for src, want in zip(sources, expected, strict=True):
                    assert compile_expr(src, ENV)(ACT) == want
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


_NS = st.integers(-62135596800 * 10**9, 253402300799 * 10**9 + 999_999_999)  # years 1 to 9999


@given(_NS, _NS)
def test_nanosecond_timestamps_round_trip_and_order_like_integers(a, b):
    ta, tb = make_ts(a), make_ts(b)
    assert ts_ns(ta) == a and ts_ns(tb) == b
    assert (ta < tb, ta <= tb, ta == tb, ta != tb, ta > tb) == (a < b, a <= b, a == b, a != b, a > b)
    assert (ta == tb) <= (hash(ta) == hash(tb))
    da, db = make_dur(a // 1000), make_dur(b // 1000)
    assert dur_ns(da) == a // 1000 and (da < db) == (a // 1000 < b // 1000)
    text = compile_expr("string(t)", Env({"t": TIMESTAMP}))({"t": ta})
    assert ts_ns(compile_expr("timestamp(s)", Env({"s": STRING}))({"s": text})) == a


# --------------------------------------------------------------------------------------------- review regressions


class _Vars:
    """A record value whose field names are not Python identifiers (policy variables may be any TOML key)."""

    def __init__(self, **fields: object) -> None:
        for k, v in fields.items():
            setattr(self, k, v)


def test_field_names_never_become_code():
    env = Env({"v": record_type("variables", {"small": BOOL, "small or 1": BOOL, "pass": INT, "s.x": INT})})
    value = _Vars(**{"small": True, "small or 1": False, "pass": 3, "s.x": 4})
    for source, want in [("v.`small or 1`", False), ("has(v.`small or 1`)", True), ("v.pass + v.`s.x`", 7)]:
        compiled = compile_expr(source, env)
        assert compiled({"v": value}) == want and compiled.evaluate_exact({"v": value}) == want
        assert type(compiled({"v": value})) is type(want)


def test_bool_keys_never_find_int_keys():
    fails("{1: 'a'}[dyn(true)]", "no such key")
    assert ev("dyn(true) in {1: 1}") is False and ev("dyn(1) in {true: 1}") is False
    env = Env({"r": map_of(DYN, INT)})
    assert compile_expr("true in r", env)({"r": {1: 5}}) is False
    with pytest.raises(CelEvalError, match="no such key"):
        compile_expr("r[true]", env)({"r": {1: 5}})


def test_uint_values_keep_their_kind_through_containers_and_calls():
    env = ENV.extend({"mu": map_of(STRING, UINT), "nu": UINT.as_nullable()})
    act = {**ACT, "mu": {"a": 1}, "nu": None}
    for source, want in [("math.bitNot(mu.?a.value())", Uint(18446744073709551614)), ("dyn(lu)[0] + 1u", Uint(5)),
                         ("type(dyn(lu)[0]) == uint", True), ("dyn(mu).a + 1u", Uint(2)), ("nu == null", True),
                         ("math.abs(mu.?a.value())", Uint(1))]:  # fmt: skip
        compiled = compile_expr(source, env)
        for fn in (compiled, compiled.evaluate_exact):
            got = fn(act)
            assert got == want and type(got) is type(want), source


def test_or_value_and_or_keep_the_optional_type():
    with pytest.raises(CelTypeError, match=r"no matching overload for optional_type\(int\)\.orValue\(string\)"):
        compile_expr("m[?'z'].orValue('a')", ENV)
    with pytest.raises(CelTypeError, match="no matching overload"):
        compile_expr("m[?'z'].or(optional.of('a'))", ENV)
    assert compile_expr("optional.none().orValue('a')", ENV).type == STRING


def test_bind_computes_its_value_only_when_used():
    assert ev("cel.bind(x, 1 / 0, true)") is True
    assert ev("cel.bind(x, 1 / 0, false && x > 0)") is False
    fails("cel.bind(x, 1 / 0, x > 0)", "division by zero")


def test_transform_map_entry_needs_a_map_at_run_time():
    assert ev("{'a': 1}.transformMapEntry(k, v, {k + 'x': v})") == {"ax": 1}
    fails("{1: 2}.transformMapEntry(k, v, dyn(3))", "must give a map")


def test_null_is_a_value_for_dyn_parameters():
    env = Env({"r": record_type("R", {"s": STRING.as_nullable()})})
    value = _Vars(s=None)
    assert compile_expr("optional.of(r.s).hasValue()", env)({"r": value}) is True
    assert compile_expr("optional.ofNonZeroValue(r.s).hasValue()", env)({"r": value}) is False


def test_nanosecond_values_copy_pickle_and_hash_by_their_full_value():
    t, d = make_ts(1_000_000_000_000_000_001), make_dur(1)
    assert copy.copy(t) == t and copy.deepcopy(d) == d and pickle.loads(pickle.dumps(t)) == t
    assert pickle.loads(pickle.dumps(d)).ns == 1
    u = t.replace(microsecond=0)  # a NanoTimestamp with ns == 0 is its plain value, hash included
    plain = dt.datetime(u.year, u.month, u.day, u.hour, u.minute, u.second, tzinfo=dt.UTC)
    assert u == plain and len({u, plain}) == 1
    assert ts_ns(t + dt.timedelta(seconds=1)) == ts_ns(t) + 10**9 and dur_ns(-d) == -1
    assert dur_ns(dt.timedelta(0) - d) == -1 and dur_ns(t - t) == 0


def test_maps_hold_true_and_one_as_different_keys():
    assert ev("{1: 'a', true: 'b'}[true] + {1: 'a', true: 'b'}[1]") == "ba"
    assert ev("{1: 'a', true: 'b'}.size()") == 2 and ev("{0: 1, false: 2}[false]") == 2
    assert ev("{1: 'a', true: 'b'} == {true: 'b', 1: 'a'}") is True
    assert ev("{1: 'a', true: 'b'}.map(k, k)") == [1, True]
    assert ev("'%s'.format([{1: 'a', true: 'b'}])") == "{1: a, true: b}"
    fails("{1: 'a', true: 'b', true: 'c'}", "duplicate map key")
    fails("{1: 'a', 1u: 'b'}", "duplicate map key")  # 1 and 1u are equal in CEL
    m = ev("{1: 'a', true: 'b'}")
    assert isinstance(m, MixedKeyMap) and m[True] == "b" and m[1] == "a" and m.items() == [(1, "a"), (True, "b")]
