"""The namespace compiled CEL code runs in, and constant folding at compile time.

`runtime_globals` maps the `_name`s the generated code calls to the run-time helpers of `runtime/` (`core`,
`conversions`, `dynamic`, `overloads` and `stdlib`); `fold` evaluates pure sub-trees whose operands are all literals
once, at compile time (`bytes_of("4GiB")` -> 4294967296), turning malformed literal text into a load-time error.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

from nexuskv.cel.checker.check import FOLD_AT_COMPILE, FOLDABLE
from nexuskv.cel.codegen.generator import Gen
from nexuskv.cel.runtime import conversions, dynamic, stdlib
from nexuskv.cel.runtime import core as rt
from nexuskv.cel.runtime import overloads as std
from nexuskv.cel.runtime.core import CelEvalError
from nexuskv.cel.runtime.extensions import SIZE_LIMIT
from nexuskv.cel.runtime.stdlib import type_value
from nexuskv.cel.syntax.parser import CelTypeError, Node
from nexuskv.cel.types import Env
from nexuskv.cel.values import Uint, as_uint, uint_deep

__all__ = ["fold", "runtime_globals"]

_HELPER_NAMES = (
        "nn", "var", "iadd", "isub", "imul", "idiv", "imod", "ineg", "uadd", "usub", "umul", "udiv", "umod",
        "fdiv", "tadd", "tsub", "duration", "timestamp", "int_of_double", "int_of_uint", "int_of_string",
        "int_of_timestamp", "uint_of_int", "uint_of_double", "uint_of_string", "double_of_string",
        "format_double", "string_of_bytes", "string_of_timestamp", "string_of_duration", "string_of",
        "bytes_of", "matches", "lidx", "mget", "sel", "mkmap", "eq", "in_list", "all_x", "exists_x",
        "as_bool",
        "d_arith", "d_neg", "d_cmp", "d_in", "d_index", "d_select", "d_has", "d_size", "d_iter", "d_str",
        "d_expect", "call_plugin",
)  # fmt: skip
_RUNTIME = (rt, conversions, dynamic)
_HELPERS: dict[str, Any] = {name: next(getattr(m, name) for m in _RUNTIME if hasattr(m, name))
                            for name in _HELPER_NAMES}  # fmt: skip
_RUN_TIME_ONLY = ("out of range",)
"""Errors of constant conversions that stay run-time errors (CEL defines them as evaluation errors)."""


def runtime_globals(consts: Mapping[str, Any]) -> dict[str, Any]:
    """The globals generated code runs with: the runtime helpers (as `_name`) plus the given constants."""
    g: dict[str, Any] = {"__builtins__": builtins}
    g.update({f"_{k}": v for k, v in _HELPERS.items()})
    g["_and_"] = dynamic.and_
    g["_or_"] = dynamic.or_
    g["_Uint"] = Uint
    g["_as_uint"] = as_uint
    g["_uint_deep"] = uint_deep
    g["_dispatch"] = std.dispatch
    g["_type_value"] = type_value
    g["_fail"] = rt.err
    g["_Lazy"] = stdlib.Lazy
    for name in ("pairs", "entries", "opt_select", "opt_index", "opt_has", "opt_items", "opt_entry", "opt_map",
                 "opt_flat_map"):  # fmt: skip
        g[f"_{name}"] = getattr(stdlib, name)
    g.update(consts)
    return g


# --------------------------------------------------------------------------------------------- folding


def fold(n: Node, env: Env, source: str, strict_literals: bool = False) -> Node:
    """Evaluate pure sub-trees whose operands are all literals (bytes_of("4GiB") -> 4294967296).

    A malformed `bytes_of` literal is a located compile error; a malformed `duration` or `timestamp` literal only
    with `strict_literals` (policies), else it stays for run time, where the spec makes it an evaluation error.
    """
    n.args = [fold(a, env, source, strict_literals) for a in n.args]
    if n.op not in FOLDABLE or not all(a.op == "lit" for a in n.args):
        return n
    if n.op == "call" and (n.value in env.functions or n.value == "matches"):
        return n
    consts: dict[str, Any] = {}
    gen = Gen(env, True, consts, [])
    code = gen.g(n, {})
    try:
        value = eval(code, runtime_globals(consts), {"A": {}})
    except CelEvalError as exc:
        if SIZE_LIMIT in exc.message:  # a literal expression that would build a huge value: a located load error
            raise CelTypeError(exc.message, n.line, n.col, source) from None
        strict = n.op == "call" and (n.value == "bytes_of" or strict_literals)
        if strict and n.value in FOLD_AT_COMPILE and not any(m in exc.message for m in _RUN_TIME_ONLY):
            # malformed text is a mistake worth a load-time error; a value out of range is a run-time error
            raise CelTypeError(
                f"invalid argument to {n.value}(): {exc.message}", n.line, n.col, source
            ) from None
        return n
    except Exception:  # pragma: no cover - a helper failed unexpectedly; keep the run-time path
        return n
    if isinstance(value, list | dict):
        return n
    folded = Node("lit", [], n.line, n.col, value=value)
    folded.t = n.t
    return folded
