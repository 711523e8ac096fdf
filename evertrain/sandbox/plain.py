"""Plain data across a process boundary: a strict, tagged encoding over JSON, and message framing.

The grader passes values between the candidate's process and the test process. Whatever crosses must
be inert: no pickle, no ``eval``, no object whose methods the candidate wrote. So only the built-in
value types travel (None, bool, int, float, complex, str, bytes and lists, tuples, dicts, sets,
frozensets of them), each tagged with its exact type so that ``1``, ``1.0``, ``True``, ``(1,)`` and
``[1]`` stay distinct: ``["i","0x1"]``, ``["f","0x1.0000000000000p+0"]``, ``["B",true]``,
``["t",[["i","0x1"]]]``, ``["l",[...]]``. Numbers travel as hex strings (exact, and no JSON number
parsing). The encoder refuses subclasses (an ``int`` subclass with an ``__eq__`` that always says yes
is the classic hack); the decoder builds only built-in values and rejects anything malformed.

The decoder is the security boundary: the candidate controls its own process and can write any bytes
it likes, so nothing here trusts the sender. It accepts exactly the JSON this encoder writes (arrays,
strings, true, false; no whitespace, no objects, no numbers) with its own small parser. That parser,
and writing the JSON by hand, are also about speed: this file runs inside every sandbox (shipped as
``/sandbox/plain.py``, standard library only), where ``import json`` alone would cost 8 ms (it pulls
in ``re`` and ``enum``); ``_json``'s C string routines are all it needs.
"""

import binascii
import os

try:  # the C accelerators behind the json package, without the package's imports
    from _json import encode_basestring_ascii as _quote
    from _json import scanstring as _scanstring
except ImportError:  # pragma: no cover - an interpreter without _json
    from json.decoder import scanstring as _scanstring
    from json.encoder import encode_basestring_ascii as _quote

MAX_DEPTH = 100  # nesting of plain values
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_HEADER = 4
_CONTAINERS = {list: "l", tuple: "t", set: "e", frozenset: "z"}
_BUILDERS = {"l": list, "t": tuple, "e": set, "z": frozenset}


class NotPlain(TypeError):
    """A value that is not plain data; ``type_name`` names the offending type."""

    def __init__(self, type_name: str) -> None:
        super().__init__(f"not plain data: {type_name}")
        self.type_name = type_name


class DecodeError(ValueError):
    """Bytes that are not a well-formed plain-data message."""


def _write(value: object, depth: int, out: list[str]) -> None:
    if depth > MAX_DEPTH:
        raise NotPlain(f"nesting deeper than {MAX_DEPTH}")
    kind = type(value)  # exact types only: a subclass may override __eq__, __hash__, __iter__ ...
    if value is None:
        out.append('["N"]')
    elif kind is bool:
        out.append('["B",true]' if value else '["B",false]')
    elif kind is int:
        out.append(f'["i","{value:#x}"]')
    elif kind is float:
        out.append(f'["f","{value.hex()}"]')
    elif kind is complex:
        out.append(f'["c","{value.real.hex()}","{value.imag.hex()}"]')
    elif kind is str:
        out.append(f'["s",{_quote(value)}]')
    elif kind is bytes:
        out.append(f'["y","{binascii.b2a_base64(value, newline=False).decode("ascii")}"]')
    elif kind in _CONTAINERS:
        out.append(f'["{_CONTAINERS[kind]}",[')
        for index, item in enumerate(list(value)):
            if index:
                out.append(",")
            _write(item, depth + 1, out)
        out.append("]]")
    elif kind is dict:
        out.append('["d",[')
        for index, (key, item) in enumerate(list(value.items())):
            out.append(",[" if index else "[")
            _write(key, depth + 1, out)
            out.append(",")
            _write(item, depth + 1, out)
            out.append("]")
        out.append("]]")
    else:
        raise NotPlain(kind.__name__ if type(kind.__name__) is str else "?")


def quote(text: str) -> str:
    """``text`` as a one-line, ASCII JSON string literal."""
    return _quote(text)


def encode(value: object) -> bytes:
    """The plain-data encoding of ``value``; raises :class:`NotPlain` for anything else."""
    out: list[str] = []
    try:
        _write(value, 0, out)
    except RecursionError:
        raise NotPlain("recursive structure") from None
    return "".join(out).encode("ascii")


def _parse(text: str, at: int, depth: int) -> tuple[object, int]:
    """One JSON value of the subset ``encode`` writes, starting at ``at``: (value, end)."""
    if depth > 3 * MAX_DEPTH + 3:  # a dict entry is three arrays deep per plain level
        raise DecodeError("nesting too deep")
    char = text[at:at + 1]
    if char == '"':
        return _scanstring(text, at + 1, True)
    if char == "[":
        items: list[object] = []
        at += 1
        if text[at:at + 1] == "]":
            return items, at + 1
        while True:
            item, at = _parse(text, at, depth + 1)
            items.append(item)
            char = text[at:at + 1]
            at += 1
            if char == "]":
                return items, at
            if char != ",":
                raise DecodeError(f"expected ',' or ']' at {at - 1}")
    if text.startswith("true", at):
        return True, at + 4
    if text.startswith("false", at):
        return False, at + 5
    raise DecodeError(f"unexpected {char!r} at {at}")


def _text(value: object) -> str:
    if type(value) is not str:
        raise DecodeError("expected a string")
    return value


def _untag(node: object, depth: int) -> object:
    if depth > MAX_DEPTH:
        raise DecodeError("nesting too deep")
    if type(node) is not list or not node or type(node[0]) is not str:
        raise DecodeError("malformed node")
    tag, args = node[0], node[1:]
    try:
        if tag == "N" and not args:
            return None
        if tag == "B" and len(args) == 1 and type(args[0]) is bool:
            return args[0]
        if tag == "i" and len(args) == 1:
            return int(_text(args[0]), 16)
        if tag == "f" and len(args) == 1:
            return float.fromhex(_text(args[0]))
        if tag == "c" and len(args) == 2:
            return complex(float.fromhex(_text(args[0])), float.fromhex(_text(args[1])))
        if tag == "s" and len(args) == 1:
            return _text(args[0])
        if tag == "y" and len(args) == 1:
            return binascii.a2b_base64(_text(args[0]), strict_mode=True)
        if tag in _BUILDERS and len(args) == 1 and type(args[0]) is list:
            return _BUILDERS[tag](_untag(item, depth + 1) for item in args[0])
        if tag == "d" and len(args) == 1 and type(args[0]) is list:
            out = {}
            for pair in args[0]:
                if type(pair) is not list or len(pair) != 2:
                    raise DecodeError("malformed dict entry")
                out[_untag(pair[0], depth + 1)] = _untag(pair[1], depth + 1)
            return out
    except DecodeError:
        raise
    except (ValueError, TypeError, OverflowError) as error:  # bad hex or base64, unhashable key ...
        raise DecodeError(f"bad {tag!r} node: {error}") from None
    raise DecodeError(f"unknown node {tag!r}")


def decode(blob: bytes) -> object:
    """The value encoded in ``blob``; raises :class:`DecodeError` on anything malformed."""
    try:
        text = blob.decode("ascii")
        tree, end = _parse(text, 0, 0)
        if end != len(text):
            raise DecodeError(f"trailing data at {end}")
        return _untag(tree, 0)
    except DecodeError:
        raise
    except (ValueError, RecursionError, UnicodeDecodeError) as error:  # bad string escapes ...
        raise DecodeError(f"not a plain-data message: {type(error).__name__}") from None


def send(fd: int, value: object) -> None:
    """Write one framed message (4-byte big-endian length, then the encoding) to ``fd``."""
    blob = encode(value)
    if len(blob) > MAX_MESSAGE_BYTES:
        raise NotPlain(f"message of {len(blob)} bytes")
    data = memoryview(len(blob).to_bytes(_HEADER, "big") + blob)
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def recv(fd: int) -> object:
    """Read one framed message from ``fd``; raises EOFError when the other side is gone."""
    header = _read_exactly(fd, _HEADER)
    if header is None:
        raise EOFError("peer closed the channel")
    size = int.from_bytes(header, "big")
    if size > MAX_MESSAGE_BYTES:
        raise DecodeError(f"message of {size} bytes is over the limit")
    blob = _read_exactly(fd, size)
    if blob is None:
        raise EOFError("peer closed the channel mid-message")
    return decode(blob)
