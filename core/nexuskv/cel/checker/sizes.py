"""Size bounds of the values CEL builds: characters of a string, bytes of a bytes value, items of a list.

The checker gives the result type of a string or list builder the `max_size` that `call_bound` derives from its
arguments, so that chained builders compound: `s.replace(old, new)` has at most
`slen(s) + (slen(s) + 1) * slen(new)` characters, and a `.replace` on that result starts from this bound.
`cost_of` charges 0.1 per character of a built string (`STRING_BUILDERS`) and 1 per item of a built list
(`LIST_BUILDERS`). A literal argument tightens a bound where it can: the length of `old` in `replace` or of the
separator in `split`, the count `n`, a format string's clauses and precisions, `substring`'s indexes. The
builders that refuse at run time to make a string over `MAX_STRING_CHARS` (`replace`, `format`, `join`) have
their bound capped there. An argument of type `dyn`, or a string without a declared maximum, counts as the
default length (`DEFAULT_MAX_STRING`), as everywhere in the cost model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from nexuskv.cel.checker.relations import items, slen
from nexuskv.cel.runtime.extensions import MAX_PRECISION, MAX_STRING_CHARS
from nexuskv.cel.syntax.parser import Node
from nexuskv.cel.types import BYTES, DEFAULT_MAX_STRING, DYN, STRING, CelType, list_of

__all__ = ["LIST_BUILDERS", "STRING_BUILDERS", "call_bound", "format_bound", "text_bound"]

STRING_BUILDERS = frozenset({
    "replace", "format", "join", "lowerAscii", "upperAscii", "trim", "reverse", "substring", "strings.quote",
    "base64.encode", "base64.decode", "bytes",
})  # fmt: skip
"""Calls charged 0.1 per character (or byte) of their result's bound."""
LIST_BUILDERS = frozenset({"split"})
"""Calls charged 1 per item of their result's bound."""
_CAPPED = frozenset({"replace", "format", "join"})

SCALAR_TEXT = {"int": 20, "uint": 20, "double": 32, "bool": 5, "null": 4, "timestamp": 40, "duration": 40,
               "type": 256}  # fmt: skip
"""The longest text of a scalar of each kind (`string(x)`, `%s`): `-9223372036854775808`, a double's shortest
form (at most 24 characters), `9999-12-31T23:59:59.999999999Z`, a duration in seconds; a type's name."""
_CLAUSE = re.compile(r"%(?:\.(\d+))?(.)?", re.S)  # as `extensions.format_` reads a format string
_CLAUSE_WIDTHS = ((2, None), (4, 9), (5, 99), (6, 999), (7, MAX_PRECISION))
"""(length of a clause, the largest precision it may give): `%f`, `%.9f`, `%.99f`, `%.999f`, `%.1000f`."""


def _len(n: Node) -> int:
    """An upper bound of the length of a string or bytes argument: a literal's own length, else its type's.

    A literal of another kind (possible in parse-only mode) makes the call fail: it builds nothing.
    """
    if n.op == "lit":
        return len(n.value) if isinstance(n.value, str | bytes) else 0
    return slen(n.t)


def _min_len(n: Node) -> int:
    """A lower bound of the length of a string argument (0 unless it is a literal)."""
    return len(n.value) if n.op == "lit" and isinstance(n.value, str | bytes) else 0


def _int_lit(n: Node | None) -> int | None:
    """The value of an int literal argument, else None."""
    if n is None or n.op != "lit" or isinstance(n.value, bool) or not isinstance(n.value, int):
        return None
    return int(n.value)


def text_bound(t: CelType) -> int:
    """The longest text `%s` writes for a value of type `t` (a list or map: its items' texts and separators)."""
    k = t.kind
    if k in ("string", "bytes"):
        size = slen(t)  # bytes are decoded: at most one character per byte
    elif k == "list":
        size = 2 + items(t) * (2 + text_bound(t.elem))
    elif k == "map":
        size = 2 + items(t) * (4 + text_bound(t.key) + text_bound(t.elem))
    else:
        size = SCALAR_TEXT.get(k, DEFAULT_MAX_STRING)  # dyn: the default length, as in the rest of the model
    return max(size, 4) if t.nullable else size


def _clause_bound(verb: str | None, prec: int | None, t: CelType) -> int:
    """The longest text of one format clause `%.<prec><verb>` applied to a value of type `t`."""
    if verb is None or verb not in "sdfeboxX":  # an unknown clause is an error before anything is written
        return 0
    k = t.kind
    digits = 6 if prec is None else prec
    if digits > MAX_PRECISION:  # an error at run time, before anything is built: counted in full all the same
        return digits + _clause_bound(verb, None, t)
    if verb == "s":
        return text_bound(t)
    if verb == "d":
        return 20
    if verb == "f":  # a double up to 1.8e308 has 309 integer digits; an int or uint at most 20
        return (22 if k in ("int", "uint", "bool") else 312) + digits
    if verb == "e":  # -1.<digits>e+308, or -Infinity
        return 9 + digits
    if verb == "b":
        return 65
    if verb == "o":
        return 23
    if k == "string":  # %x of a string: two hex digits per UTF-8 byte, at most four bytes per character
        return 8 * slen(t)
    if k == "bytes":
        return 2 * slen(t)
    return 8 * DEFAULT_MAX_STRING if k == "dyn" else 17


def _widest(t: CelType) -> int:
    """The longest text any clause writes for a value of type `t`, at the largest precision."""
    return max(_clause_bound(verb, MAX_PRECISION, t) for verb in "sdfebox")


def _arg_types(args: Node) -> tuple[list[CelType], CelType]:
    """The types of a format call's arguments by position (when the list is a literal) and their common type."""
    t = args.t
    elem = t.elem if t.kind == "list" else DYN
    if args.op == "list" and not any(a.op == "optelem" for a in args.args):
        return [a.t for a in args.args], elem
    return [], elem


def format_bound(fmt: Node, args: Node) -> int:
    """The longest result of `fmt.format(args)`: the format string's text plus each clause's longest text.

    A literal format string is read clause by clause, so a literal precision (`%.200000000f`) counts in full.
    Another one writes at most its own length in text, plus for each argument (each clause takes the next one)
    the widest clause at the largest precision; and at most what the clause that writes the most per character
    of format string (`%.999f`) would if it filled the string.
    """
    by_position, elem = _arg_types(args)
    if fmt.op != "lit" or not isinstance(fmt.value, str):
        size = _len(fmt)
        per_character = max(-(-size * _clause_bound(verb, prec, elem) // width) for verb in "sdfebox"
                            for width, prec in _CLAUSE_WIDTHS)  # fmt: skip
        per_argument = sum(map(_widest, by_position)) if by_position else items(args.t) * _widest(elem)
        return min(max(per_character, size), size + per_argument)
    text = fmt.value
    total = pos = i = 0
    for m in _CLAUSE.finditer(text):
        total += m.start() - pos
        pos = m.end()
        prec, verb = m.groups()
        if verb == "%" and prec is None:
            total += 1
            continue
        t = by_position[i] if i < len(by_position) else elem
        total += _clause_bound(verb, None if prec is None else int(prec), t)
        i += 1
    return total + len(text) - pos


def _join_bound(lst: Node, sep: Node | None) -> int:
    """The longest `lst.join(sep)`: every item at its bound, with a separator between each two."""
    gap = 0 if sep is None else _len(sep)
    if lst.op == "list" and not any(a.op == "optelem" for a in lst.args):
        lengths = [_len(a) for a in lst.args]
        return sum(lengths) + max(len(lengths) - 1, 0) * gap
    n = items(lst.t)
    elem = lst.t.elem if lst.t.kind == "list" else DYN
    return n * slen(elem) + max(n - 1, 0) * gap


def _replace_bound(s: Node, old: Node, new: Node, count: Node | None) -> int:
    """The longest `s.replace(old, new[, n])`: each replacement grows the text by at most len(new) - len(old)."""
    size, shortest = _len(s), _min_len(old)
    times = size // shortest if shortest > 0 else size + 1  # an empty `old` matches between every two characters
    n = _int_lit(count)
    if n is not None and n >= 0:
        times = min(times, n)
    return size + times * max(_len(new) - shortest, 0)


def _split_bound(s: Node, sep: Node, count: Node | None) -> CelType:
    """`s.split(sep[, n])`: at most len(s) // len(sep) + 1 parts (n when n > 0), each at most len(s) long."""
    size, shortest = _len(s), _min_len(sep)
    parts = size // shortest + 1 if shortest > 0 else size + 1
    n = _int_lit(count)
    if n is not None and n >= 0:
        parts = min(parts, n)
    return list_of(STRING.with_size(size), parts)


def _substring_bound(s: Node, start: Node, end: Node | None) -> int:
    """`s.substring(start[, end])`: at most len(s), less what literal indexes leave out."""
    size, first = _len(s), _int_lit(start)
    last = size if end is None else _int_lit(end)
    if first is None or last is None:
        return size
    return max(min(last, size) - max(first, 0), 0)


def call_bound(name: str, nodes: Sequence[Node], result: CelType) -> CelType:
    """`result` (the type of the standard call `name(nodes...)`) with the size bound its arguments allow.

    `nodes` are the checked arguments, receiver first (each has its type in `.t`); `result` is returned as it
    is when no bound is derivable.
    """
    kind = result.kind
    n = len(nodes)
    if kind == "list" and name == "split" and n >= 2:
        return _split_bound(nodes[0], nodes[1], nodes[2] if n > 2 else None)
    if kind not in ("string", "bytes") or n == 0:
        return result
    first = nodes[0]
    if name == "replace" and n >= 3:
        size = _replace_bound(first, nodes[1], nodes[2], nodes[3] if n > 3 else None)
    elif name == "format" and n == 2:
        size = format_bound(first, nodes[1])
    elif name == "join":
        size = _join_bound(first, nodes[1] if n > 1 else None)
    elif name in ("lowerAscii", "upperAscii", "trim", "reverse"):
        size = _len(first)
    elif name == "substring" and n >= 2:
        size = _substring_bound(first, nodes[1], nodes[2] if n > 2 else None)
    elif name == "charAt":
        size = 1
    elif name == "strings.quote":  # every character escaped, and the two quotes
        size = 2 * _len(first) + 2
    elif name == "base64.encode":
        size = 4 * -(-_len(first) // 3)
    elif name == "base64.decode":
        size = 3 * -(-_len(first) // 4)
    elif name == "bytes" and kind == "bytes":
        size = 4 * _len(first) if first.t.kind in ("string", "dyn") else _len(first)  # UTF-8: <= 4 bytes each
    elif name == "string" and first.t.kind in ("string", "bytes"):
        size = _len(first)
    else:
        return result
    if name in _CAPPED:
        size = min(size, MAX_STRING_CHARS)
    return (STRING if kind == "string" else BYTES).with_size(size).as_nullable(result.nullable)
