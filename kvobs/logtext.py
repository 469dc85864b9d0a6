"""A log file's bytes as the text lines a person would read: decoded by content, not by name.

Why by content: logs arrive renamed, rotated and piped (``vllm.log.1``, standard input), so the
file name says nothing reliable. What is in the first bytes does: a compressor's magic bytes, a
byte-order mark, or (UTF-16 without a mark) the NUL byte in every other position; in a UTF-8
log a byte that is not UTF-8 is read as Latin-1 (raw 8-bit controls, a Latin-1 log). What a
terminal would not show is removed from each line: every escape sequence form of ECMA-48 (CSI
such as colours, the charset designations ``tput sgr0`` emits such as ``ESC(B``, OSC strings
such as window titles and hyperlinks, DCS/SOS/PM/APC strings, and their 8-bit C1 forms) and every
other C0 or C1 control but tab and the line end (the SI ``tput sgr0`` ends with under screen, tmux
and the Linux console).

A compression kvobs cannot read with the standard library (zstd, lz4, zip) is an
:class:`UnreadableLog` saying which and what to do, instead of "no assertion found".
Bounded: a line is cut at ``max_chars`` characters (the rest of it skipped); a damaged or cut
compressed stream ends the input, and ``damage`` says so.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import re
import zlib
from collections.abc import Callable, Generator, Iterator
from typing import Any, BinaryIO, cast

COMPRESSED: tuple[tuple[bytes, str, Callable[[Any], Any] | None], ...] = (
    (b"\x1f\x8b", "gzip", lambda raw: gzip.GzipFile(fileobj=raw, mode="rb")),
    (b"\xfd7zXZ\x00", "xz", lambda raw: lzma.LZMAFile(raw)),  # noqa: SIM115 (read lazily, line by line)
    (b"BZh", "bz2", lambda raw: bz2.BZ2File(raw)),
    (b"\x28\xb5\x2f\xfd", "zstd", None),
    (b"\x04\x22\x4d\x18", "lz4", None),
    (b"PK\x03\x04", "zip", None),
)
"""Magic bytes, the format's name, and how to open it (None: not in Python's standard library)."""
BOMS: tuple[tuple[bytes, str], ...] = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16 LE: its mark starts the same way
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
SNIFF_BYTES = 4096
ESCAPES = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"  # CSI: SGR colours, cursor moves (7- and 8-bit introducer)
    r"|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC: titles, hyperlinks; to BEL or ST
    r"|(?:\x1b[PX^_]|[\x90\x98\x9e\x9f])(?:[^\x1b\x9c]|\x1b[^\\])*(?:\x1b\\|\x9c)?"  # DCS/SOS/PM/APC: to ST only
    r"|\x1b[ -/]*[0-~]"  # the other escape sequences: nF (ESC ( B), Fp, Fe, Fs
    r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]"  # any other C0 or C1 control (SI after sgr0), DEL; not tab or CR/LF
)
"""Every escape sequence form of ECMA-48 (ISO 6429) that terminals emit, and the controls left:
a terminal shows none of them. A DCS/SOS/PM/APC string ends at ST only, so an ESC inside (tmux's
passthrough doubles them) or a BEL does not end it early."""
LATIN_1 = "kvobs.latin-1"
"""The error handler a UTF-8 log is decoded with: a byte that is not UTF-8 is read as Latin-1, so a
log with raw 8-bit C1 controls (0x9b for CSI) or in Latin-1 keeps its text, not U+FFFD in its place."""


def _as_latin_1(exc: UnicodeError) -> tuple[str, int]:
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    return exc.object[exc.start : exc.end].decode("latin-1"), exc.end


codecs.register_error(LATIN_1, _as_latin_1)
_DAMAGE = (EOFError, gzip.BadGzipFile, zlib.error, lzma.LZMAError, OSError)


class UnreadableLog(ValueError):
    """The input is in a form kvobs does not decode; the message says which and what to do."""


def strip_escapes(text: str) -> str:
    return ESCAPES.sub("", text)


def _peekable(stream: Any) -> Any:
    return stream if hasattr(stream, "peek") else io.BufferedReader(cast(Any, stream))


def _decompressed(stream: BinaryIO) -> Any:
    """The stream, or its decompression when its first bytes are a compressor's magic."""
    raw = _peekable(stream)
    head = raw.peek(8)[:8]
    for magic, name, opener in COMPRESSED:
        if head.startswith(magic):
            if opener is None:
                raise UnreadableLog(f"{name}-compressed (kvobs explain reads plain, gzip, xz and bz2 logs); "
                                    f"decompress it first, e.g. {name} -d or unzip")
            return _peekable(opener(raw))
    return raw


def _encoding(head: bytes) -> tuple[str, int]:
    """The text encoding the first bytes show, and the length of its byte-order mark."""
    for bom, name in BOMS:
        if head.startswith(bom):
            return name, len(bom)
    even, odd = head[0::2], head[1::2]
    if len(odd) >= 16:  # UTF-16 without a mark: mostly ASCII text, so every other byte is NUL
        if odd.count(0) >= 0.9 * len(odd) and even.count(0) == 0:
            return "utf-16-le", 0
        if even.count(0) >= 0.9 * len(even) and odd.count(0) == 0:
            return "utf-16-be", 0
    return "utf-8", 0


def log_lines(stream: BinaryIO, damage: list[str], max_chars: int) -> Generator[str, None, None]:
    """Decoded lines without their line ending (LF or CRLF) or escapes, each at most ``max_chars``
    characters. Raises :class:`UnreadableLog` before the first line for a form it cannot decode."""
    try:
        reader = _decompressed(stream)
        head = reader.peek(SNIFF_BYTES)[:SNIFF_BYTES]
    except _DAMAGE as exc:
        damage.append(f"compressed input damaged ({exc or type(exc).__name__}); read up to there")
        return
    encoding, bom = _encoding(head)
    reader.read(bom)
    errors = LATIN_1 if encoding == "utf-8" else "replace"
    text = io.TextIOWrapper(reader, encoding=encoding, errors=errors, newline="\n")
    try:
        yield from _text_lines(text, max_chars)
    except _DAMAGE as exc:  # a cut or corrupt compressed stream: keep what was read
        damage.append(f"compressed input damaged ({exc or type(exc).__name__}); read up to there")
    finally:
        text.detach()  # the caller's stream (standard input) stays open


def _text_lines(text: io.TextIOWrapper, max_chars: int) -> Iterator[str]:
    while True:
        line = text.readline(max_chars)
        if not line:
            return
        if len(line) == max_chars and not line.endswith("\n"):
            while True:  # skip the remainder of an over-long line
                rest = text.readline(max_chars)
                if not rest or rest.endswith("\n"):
                    break
        yield strip_escapes(line).rstrip("\r\n")
