r"""A reader for the protocol buffers text format, schema-free, as far as CEL's conformance files need it.

`parse_text` turns text like `section { test { name: "x" value { int64_value: 1 } } }` into a `Message`:
an ordered list of (field name, value) pairs, where a value is a nested `Message` or a `Scalar` (the token as
written, decoded later by whoever knows the field's type). Supported: `#` comments, fields with or without
`:`, `{}` and `<>` message bodies, `[a, b]` repeated values, `[type.googleapis.com/T]` Any expansions and
`[ext.name]` extensions (their bracketed name is the field name), adjacent string concatenation and the C-like
escapes of quoted strings (`\\n`, `\\x41`, `\\101`, `\\u00e9`, `\\U0001F600`). Errors say line and column.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import attrs

__all__ = ["Message", "Scalar", "TextFormatError", "parse_text"]


class TextFormatError(ValueError):
    """The text does not parse; the message starts with `line:column`."""


@attrs.frozen
class Scalar:
    """A scalar as written: `kind` is "string" (`text` already unescaped to bytes), "number" or "ident"."""

    kind: str
    text: str
    raw: bytes = b""

    def as_int(self) -> int:
        """The value as an integer (decimal, hex `0x..` or octal `0..`, with an optional sign)."""
        t = self.text
        neg = t.startswith("-")
        body = t.lstrip("+-")
        if body[:2].lower() == "0x":
            v = int(body[2:], 16)
        elif len(body) > 1 and body.startswith("0") and body.isdigit():
            v = int(body, 8)
        else:
            v = int(body, 10)
        return -v if neg else v

    def as_float(self) -> float:
        """The value as a double (`inf`, `-inf`, `nan` and a trailing `f` accepted)."""
        t = self.text.lower().rstrip("f") if not self.text.lower().endswith("inf") else self.text.lower()
        if t.lstrip("+-") in ("inf", "infinity"):
            return float("-inf") if t.startswith("-") else float("inf")
        return float(t)

    def as_bool(self) -> bool:
        """`true` / `false` (or 1 / 0)."""
        if self.text in ("true", "True", "t", "1"):
            return True
        if self.text in ("false", "False", "f", "0"):
            return False
        raise TextFormatError(f"not a bool: {self.text!r}")

    def as_str(self) -> str:
        """A string field's value (the unescaped bytes as UTF-8)."""
        return self.raw.decode("utf-8")


@attrs.define
class Message:
    """A message: its fields in order, each a `(name, Message | Scalar)` pair; repeated fields repeat."""

    fields: list[tuple[str, Message | Scalar]] = attrs.field(factory=list)

    def get(self, name: str) -> Message | Scalar | None:
        """The last value of field `name` (None when absent)."""
        found = None
        for key, value in self.fields:
            if key == name:
                found = value
        return found

    def all(self, name: str) -> list[Message | Scalar]:
        """Every value of field `name`, in order."""
        return [value for key, value in self.fields if key == name]

    def message(self, name: str) -> Message | None:
        """Field `name` as a message (None when absent; TextFormatError when it is a scalar)."""
        value = self.get(name)
        if value is not None and not isinstance(value, Message):
            raise TextFormatError(f"field {name!r} is a scalar, expected a message")
        return value

    def text(self, name: str, default: str = "") -> str:
        """A string field's value (or `default`)."""
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, Scalar):
            raise TextFormatError(f"field {name!r} is a message, expected a string")
        return value.as_str() if value.kind == "string" else value.text

    def flag(self, name: str) -> bool:
        """A bool field's value (False when absent)."""
        value = self.get(name)
        return isinstance(value, Scalar) and value.as_bool()

    def names(self) -> list[str]:
        """The field names present, in order, without repeats."""
        return list(dict.fromkeys(key for key, _ in self.fields))


_TOKEN = re.compile(
    r"""(?P<space>[ \t\r\n]+|\#[^\n]*)
      |(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
      |(?P<number>[-+]?(?:0[xX][0-9a-fA-F]+|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?[fF]?|inf(?:inity)?|nan)
                  (?![\w.]))
      |(?P<ident>[A-Za-z_][\w.]*(?:/[\w.]+)*)
      |(?P<punct>[{}<>\[\]:,;/-])""",
    re.X,
)
_ESCAPE = re.compile(
    rb"\\(?:([abfnrtv\\'\"?])|[xX]([0-9a-fA-F]{1,2})|([0-7]{1,3})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))"
)
_SIMPLE = {b"a": b"\a", b"b": b"\b", b"f": b"\f", b"n": b"\n", b"r": b"\r", b"t": b"\t", b"v": b"\v",
           b"\\": b"\\", b"'": b"'", b'"': b'"', b"?": b"?"}  # fmt: skip


def _unescape(body: str, where: str) -> bytes:
    data = body.encode("utf-8")

    def one(m: re.Match[bytes]) -> bytes:
        simple, hx, octal, u4, u8 = m.groups()
        if simple is not None:
            return _SIMPLE[simple]
        if hx is not None:
            return bytes([int(hx, 16)])
        if octal is not None:
            return bytes([int(octal, 8) & 0xFF])
        return chr(int(u4 or u8, 16)).encode("utf-8", "surrogatepass")

    out = _ESCAPE.sub(one, data)
    if b"\\" in _ESCAPE.sub(b"", data):
        raise TextFormatError(f"{where}: invalid escape sequence in string")
    return out


class _Lexer:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise TextFormatError(f"{self.where(pos)}: unexpected character {text[pos]!r}")
            if m.lastgroup != "space":
                self.tokens.append((m.lastgroup or "", m.group(), pos))
            pos = m.end()
        self.i = 0

    def where(self, pos: int) -> str:
        line = self.text.count("\n", 0, pos) + 1
        return f"{line}:{pos - (self.text.rfind(chr(10), 0, pos) + 1) + 1}"

    def peek(self) -> tuple[str, str, int] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def next(self, what: str) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None:
            raise TextFormatError(f"{self.where(len(self.text))}: unexpected end of text, expected {what}")
        self.i += 1
        return tok

    def expect(self, punct: str) -> None:
        _kind, text, pos = self.next(repr(punct))
        if text != punct:
            raise TextFormatError(f"{self.where(pos)}: expected {punct!r}, got {text!r}")


def parse_text(text: str) -> Message:
    """Parse a whole text-format message; raises TextFormatError with the line and column of a problem."""
    lx = _Lexer(text)
    msg = _fields(lx, None)
    return msg


def _fields(lx: _Lexer, close: str | None) -> Message:
    msg = Message()
    while True:
        tok = lx.peek()
        if tok is None:
            if close is not None:
                raise TextFormatError(f"{lx.where(len(lx.text))}: unexpected end of text, expected {close!r}")
            return msg
        _kind, text, _pos = tok
        if close is not None and text == close:
            lx.i += 1
            return msg
        name = _field_name(lx)
        for value in _field_values(lx, name):
            msg.fields.append((name, value))
        nxt = lx.peek()
        if nxt is not None and nxt[1] in (",", ";"):
            lx.i += 1


def _field_name(lx: _Lexer) -> str:
    kind, text, pos = lx.next("a field name")
    if kind == "ident":
        return text
    if text == "[":
        parts = []
        while True:
            _k, t, _p = lx.next("']'")
            if t == "]":
                break
            parts.append(t)
        return "[" + "".join(parts) + "]"
    raise TextFormatError(f"{lx.where(pos)}: expected a field name, got {text!r}")


def _field_values(lx: _Lexer, name: str) -> Iterator[Message | Scalar]:
    kind, text, pos = lx.next(f"a value for {name!r}")
    colon = text == ":"
    if colon:
        kind, text, pos = lx.next(f"a value for {name!r}")
    if text == "[" and colon:
        if lx.peek() is not None and lx.peek()[1] == "]":  # type: ignore[index]
            lx.i += 1
            return
        while True:
            yield _value(lx, *lx.next(f"a value for {name!r}"), name)
            _k, t, p = lx.next("',' or ']'")
            if t == "]":
                return
            if t != ",":
                raise TextFormatError(f"{lx.where(p)}: expected ',' or ']', got {t!r}")
    yield _value(lx, kind, text, pos, name, colon)


def _value(lx: _Lexer, kind: str, text: str, pos: int, name: str, colon: bool = True) -> Message | Scalar:
    if text in ("{", "<"):
        return _fields(lx, "}" if text == "{" else ">")
    if not colon:
        raise TextFormatError(f"{lx.where(pos)}: expected ':' or '{{' after {name!r}, got {text!r}")
    if kind == "string":
        raw = _unescape(text[1:-1], lx.where(pos))
        while (nxt := lx.peek()) is not None and nxt[0] == "string":
            lx.i += 1
            raw += _unescape(nxt[1][1:-1], lx.where(nxt[2]))
        return Scalar("string", raw.decode("utf-8", "replace"), raw)
    if kind == "number":
        return Scalar("number", text)
    if text == "-":
        k, t, p = lx.next("a number")
        if k not in ("number", "ident"):
            raise TextFormatError(f"{lx.where(p)}: expected a number after '-', got {t!r}")
        return Scalar("number", "-" + t)
    if kind == "ident":
        return Scalar("ident", text)
    raise TextFormatError(f"{lx.where(pos)}: unexpected {text!r} as the value of {name!r}")
