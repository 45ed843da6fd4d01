"""Every sub-expression of a CEL source, as text: what `policy explain` evaluates one by one."""

from __future__ import annotations

import re

import lark
from lark.exceptions import UnexpectedInput

from nexuskv.cel.syntax.parser import _syntax_error, grammar_parser

__all__ = ["subexpressions"]

_KEYWORD_OR_COMMENT = re.compile(r"//[^\n]*|\b(true|false)\b")


def subexpressions(source: str) -> list[str]:
    """Source text of every sub-expression of `source`, outermost first, in reading order, no duplicates.

    For explaining a rule: each text can be compiled and evaluated on its own, except those that use a
    comprehension's loop variable. Raises CelSyntaxError for text that does not parse. lark (1.3) hands the parse
    tree's `true` / `false` tokens over without a position, so a sub-expression that begins or ends with one has no
    start or end (`policy explain` crashed on every `place` and `share` rule: their default `when` is `true`). Each
    such token is placed at the first `true` / `false` after the text before it (between the two there are only
    operators, brackets, spaces and comments), and each sub-expression's missing start or end is taken from it.
    """
    spans: set[tuple[int, int]] = set()
    cursor = 0

    def visit(t: lark.Tree) -> tuple[int, int] | None:  # children in reading order, `cursor` after the last seen
        nonlocal cursor
        meta = t.meta
        start, end = (None, None) if getattr(meta, "empty", True) else (meta.start_pos, meta.end_pos)
        if start is not None:
            cursor = max(cursor, start)
        first: tuple[int, int] | None = None
        last: tuple[int, int] | None = None
        for child in t.children:
            if isinstance(child, lark.Tree):
                got = visit(child)
            elif child.start_pos is not None:
                got = (child.start_pos, child.end_pos if child.end_pos is not None else child.start_pos + len(child))
            else:
                got = next(((m.start(), m.end()) for m in _KEYWORD_OR_COMMENT.finditer(source, cursor)
                            if m.group(1) == child.value), None)  # fmt: skip
            if got is not None:
                cursor = max(cursor, got[1])
                first = first or got
                last = got
        start = start if start is not None else (first[0] if first else None)
        end = end if end is not None else (last[1] if last else None)
        if start is None or end is None:
            return None
        spans.add((start, end))
        cursor = max(cursor, end)
        return start, end

    try:
        tree = grammar_parser().parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(source, exc) from None
    visit(tree)
    texts: list[str] = []
    for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
        text = source[start:end].strip()
        if text and text not in texts:
            texts.append(text)
    return texts
