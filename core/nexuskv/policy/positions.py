r"""Where things are in a policy file's TOML text: the file position of a rule, a key and a character of a value.

`tomllib` gives values, not positions; problems must name the file line and column. This scanner knows just
enough TOML (the four string forms with their escapes, comments, table headers, keys) to find the string a
value came from and to map each character of the decoded string back to its offset in the file, so that an
error at line 2, column 5 of a `'''` expression, or after an escaped `\"` in a basic string, lands on the right
character. Anything it cannot find yields None and callers fall back to a coarser position.
"""

from __future__ import annotations

import re

__all__ = ["Strings", "file_position", "key_value", "rule_block", "value_offsets"]

_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\", "e": "\x1b"}


def _string_end(text: str, i: int) -> int:
    """Offset just past the string that starts at `text[i]` (a quote)."""
    for delim in ('"""', "'''"):
        if text.startswith(delim, i):
            j = i + 3
            while True:
                k = text.find(delim, j)
                if k < 0:
                    return len(text)
                if delim == '"""' and _escaped(text, k):
                    j = k + 1
                    continue
                k += 3
                for _ in range(2):  # up to two more quotes belong to the value
                    if text[k : k + 1] == delim[0]:
                        k += 1
                return k
    quote = text[i]
    j = i + 1
    while j < len(text) and text[j] != "\n":
        if quote == '"' and text[j] == "\\":
            j += 2
            continue
        if text[j] == quote:
            return j + 1
        j += 1
    return j


def _escaped(text: str, k: int) -> bool:
    n = 0
    while k - n - 1 >= 0 and text[k - n - 1] == "\\":
        n += 1
    return n % 2 == 1


class Strings:
    """The string tokens of a TOML text and a `masked` copy with comments and string contents blanked."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts: list[int] = []
        out = list(text)
        i = 0
        while i < len(text):
            c = text[i]
            if c == "#":
                j = text.find("\n", i)
                j = len(text) if j < 0 else j
                out[i:j] = " " * (j - i)
                i = j
            elif c in "\"'":
                j = _string_end(text, i)
                self.starts.append(i)
                q = 3 if text.startswith(c * 3, i) else 1
                for k in range(i + q, max(i + q, j - q)):
                    if out[k] != "\n":
                        out[k] = " "
                i = j
            else:
                i += 1
        self.masked = "".join(out)

    def next_string(self, pos: int, end: int | None = None) -> int | None:
        """Offset of the first string token at or after `pos` (and before `end`)."""
        for s in self.starts:
            if s >= pos and (end is None or s < end):
                return s
        return None


def value_offsets(text: str, start: int) -> tuple[str, list[int]] | None:
    """Decode the TOML string at `start`: its value and, per character, the file offset it came from."""
    if start >= len(text) or text[start] not in "\"'":
        return None
    quote = text[start]
    multi = text.startswith(quote * 3, start)
    i = start + (3 if multi else 1)
    chars: list[str] = []
    offs: list[int] = []
    if multi:
        if text.startswith("\r\n", i):
            i += 2
        elif text.startswith("\n", i):
            i += 1
    close = quote * 3 if multi else quote
    while i < len(text):
        if text.startswith(close, i):
            if multi:  # `''''` / `"""""`: up to two quotes before the closing delimiter belong to the value
                extra = 0
                while extra < 2 and text.startswith(close, i + 1 + extra) and text[i] == quote:
                    extra += 1
                for k in range(extra):
                    chars.append(quote)
                    offs.append(i + k)
            return "".join(chars), [*offs, i]
        c = text[i]
        if quote == '"' and c == "\\":
            nxt = text[i + 1 : i + 2]
            if multi and (nxt in (" ", "\t", "\r", "\n")):
                j = i + 1
                while j < len(text) and text[j] in " \t":
                    j += 1
                if text[j : j + 1] in ("\n", "\r"):  # line-ending backslash: trim through the next non-space
                    while j < len(text) and text[j] in " \t\r\n":
                        j += 1
                    i = j
                    continue
            if nxt in _ESCAPES:
                chars.append(_ESCAPES[nxt])
                offs.append(i)
                i += 2
                continue
            if nxt in ("u", "U", "x"):
                n = {"u": 4, "U": 8, "x": 2}[nxt]
                try:
                    chars.append(chr(int(text[i + 2 : i + 2 + n], 16)))
                except ValueError:
                    return None
                offs.append(i)
                i += 2 + n
                continue
            return None
        if not multi and c == "\n":
            return None
        chars.append(c)
        offs.append(i)
        i += 1
    return None


def rule_block(scan: Strings, kind: str, rule: str, occurrence: int = 0) -> tuple[int, int] | None:
    """(start, end) offsets of the `[[kind]]` table whose `name` is `rule` (the `occurrence`-th such one)."""
    masked, text = scan.masked, scan.text
    headers = [m for m in re.finditer(r"(?m)^[ \t]*\[", masked)]
    seen = 0
    for n, h in enumerate(headers):
        if not re.match(rf"[ \t]*\[\[[ \t]*{re.escape(kind)}[ \t]*\]\]", masked[h.start() :]):
            continue
        end = headers[n + 1].start() if n + 1 < len(headers) else len(text)
        got = key_value(scan, "name", h.start(), end)
        if got is None:
            continue
        decoded = value_offsets(text, got)
        if decoded is not None and decoded[0] == rule:
            if seen == occurrence:
                return h.start(), end
            seen += 1
    return None


def table_block(scan: Strings, table: str) -> tuple[int, int] | None:
    """(start, end) offsets of the `[table]` section."""
    masked = scan.masked
    headers = [m for m in re.finditer(r"(?m)^[ \t]*\[", masked)]
    for n, h in enumerate(headers):
        if re.match(rf"[ \t]*\[[ \t]*{re.escape(table)}[ \t]*\]", masked[h.start() :]):
            return h.start(), headers[n + 1].start() if n + 1 < len(headers) else len(masked)
    return None


def key_offset(scan: Strings, key: str, start: int, end: int) -> int | None:
    """Offset of the `key` (bare or quoted) of a `key = value` line in [start, end)."""
    k = re.escape(key)
    pat = re.compile(rf"""(?:{k}|"{k}"|'{k}')[ \t]*=""")
    # Quoted keys are blanked in `masked`: find the line starts there, match the key in the text.
    for m in re.finditer(r"(?m)^[ \t]*\S", scan.masked[start:end]):
        pos = start + m.end() - 1
        if pat.match(scan.text, pos):
            return pos
    return None


def key_value(scan: Strings, key: str, start: int, end: int, index: int | None = None) -> int | None:
    """Offset of the opening quote of `key`'s string value in [start, end) (its `index`-th item for arrays)."""
    pos = key_offset(scan, key, start, end)
    if pos is None:
        return None
    eq = scan.masked.find("=", pos)
    if eq < 0:
        return None
    first = scan.next_string(eq, end)
    if index is None or first is None:
        return first
    k = scan.starts.index(first)
    items = scan.starts[k : k + index + 1]
    return items[index] if len(items) > index and items[index] < end else None


def file_position(text: str, offset: int) -> tuple[int, int]:
    """1-based (line, column) of a file offset."""
    return text.count("\n", 0, offset) + 1, offset - (text.rfind("\n", 0, offset) + 1) + 1
