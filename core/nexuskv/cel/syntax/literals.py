r"""Decoding CEL's quoted string and bytes literals: raw, triple-quoted, and every escape CEL defines.

`\a \b \f \n \r \t \v \" \' \\ \` \?`, `\xHH`, `\ooo` (octal), and in strings `\uHHHH` and `\UHHHHHHHH`;
in a string, hex and octal escapes are code points, in bytes they are bytes.
"""

from __future__ import annotations

import re

__all__ = ["decode_quoted"]

_ESCAPE = re.compile(
    r"\\(?:([abfnrtv\"'\\`?])|[xX]([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})"
    r"|([0-3][0-7]{2})|(.|\n)?)"
)
_SIMPLE_ESCAPES = {
    "a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
    '"': '"', "'": "'", "\\": "\\", "`": "`", "?": "?",
}  # fmt: skip


def decode_quoted(text: str, as_bytes: bool) -> str | bytes:
    """The value of a quoted string literal (single, double or triple quotes, `r` raw; no `b` prefix).

    Raises ValueError for an escape CEL does not allow or text that is not UTF-8.
    """
    raw = text[:1] in "rR"
    if raw:
        text = text[1:]
    quote = 3 if text[:3] in ('"""', "'''") else 1
    body = text[quote:-quote]
    if raw:
        return body.encode("utf-8") if as_bytes else body
    out: list[bytes] = []
    pos = 0
    for m in _ESCAPE.finditer(body):
        out.append(body[pos : m.start()].encode("utf-8", "surrogatepass"))
        pos = m.end()
        simple, hx, u4, u8, octal, _bad = m.groups()
        if simple is not None:
            out.append(_SIMPLE_ESCAPES[simple].encode())
        elif hx is not None or octal is not None:
            code = int(hx, 16) if hx is not None else int(octal, 8)
            out.append(bytes([code]) if as_bytes else chr(code).encode("utf-8"))
        elif u4 is not None or u8 is not None:
            if as_bytes:
                raise ValueError("\\u and \\U escapes are not allowed in bytes literals")
            code = int(u4 or u8, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise ValueError(f"invalid unicode escape {m.group()!r}")
            out.append(chr(code).encode("utf-8"))
        else:
            raise ValueError(f"invalid escape sequence {m.group()!r} in string literal")
    out.append(body[pos:].encode("utf-8", "surrogatepass"))
    data = b"".join(out)
    if as_bytes:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("string literal escapes do not form valid UTF-8") from None
