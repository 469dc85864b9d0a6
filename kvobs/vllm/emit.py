"""``kvobs replay --emit-test``: a bundle's calls as a standalone pytest file that needs vLLM alone.

The file rebuilds the manager's state at the window's start from values (kvobs.state_codec, copied into the
file, with the table of vLLM classes it may hold imported by their names in the installed vLLM), makes the
calls (each lookup asserts the answer it gave in production) and ends with the call that failed (a load, or
another manager call that raised): it expects that call to succeed, as the lookups before a load promised, so
the test fails with vLLM's own exception while the bug is there, and passes once it is fixed. Nothing of kvobs
is imported.

Built, not pasted (SECURITY.md): the file's code is this module's text; every value from the bundle (keys,
request ids, answers, the state, the recorded messages) reaches it only as ``repr`` of bytes, str, int, bool
or None, and method names only after kvobs.vllm.bundle_replay.load checked them against the recorded calls.
:func:`render` compiles what it wrote before returning it.
"""

from __future__ import annotations

import ast
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvobs import state_codec
from kvobs.flight import decode_indices
from kvobs.vllm import compat
from kvobs.vllm.bundle_replay import Bundle, ReplayError

_WIDTH = 100
_CHUNK = 48


def _bytes_literal(blob: bytes, indent: str = "    ") -> str:
    """``blob`` as a parenthesised run of bytes literals, each ``repr`` of a slice (no escape is ever split)."""
    parts = [repr(blob[i:i + _CHUNK]) for i in range(0, len(blob), _CHUNK)] or ["b''"]
    return "(\n" + "".join(f"{indent}{part}\n" for part in parts) + ")"


def _str_literal(text: str, indent: str = "    ") -> str:
    """``text`` as a parenthesised run of str literals, each ``repr`` of a slice."""
    parts = [repr(text[i:i + 80]) for i in range(0, len(text), 80)] or ["''"]
    return "(\n" + "".join(f"{indent}{part}\n" for part in parts) + ")"


def _codec_source() -> str:
    """kvobs/state_codec.py without its docstring and ``__future__`` import (the emitted file has its own)."""
    source = Path(state_codec.__file__).read_text(encoding="utf-8")
    body = ast.parse(source).body
    first = body[1].lineno if isinstance(body[0], ast.Expr) else 1  # after the docstring
    lines = source.splitlines()[first - 1:]
    return "\n".join(line for line in lines if line != "from __future__ import annotations").strip() + "\n"


def _table_source() -> str:
    """The snapshot table (kvobs.vllm.compat.snapshot_table) as imports of the installed vLLM's classes."""
    imports: list[str] = []
    rows: list[str] = []
    for n, (tag, entry) in enumerate(sorted(compat.snapshot_table().items())):
        module, qualname = entry.cls.__module__, entry.cls.__qualname__
        if not (all(part.isidentifier() for part in module.split(".")) and qualname.isidentifier()):
            continue  # a nested or odd name cannot be imported plainly; a state holding it does not replay
        imports.append(f"from {module} import {qualname} as _C{n}")
        rows.append(f"    {tag!r}: Entry(_C{n}, {entry.kind!r}, frozenset({sorted(entry.names)!r}), "
                    f"frozenset({sorted(entry.singletons)!r})),")
    return "\n".join(imports) + "\n\nTABLE = {\n" + "\n".join(rows) + "\n}\n"


def _argument(arg: tuple[str, Any], renumber: dict[int, int], values: list[bytes]) -> str:
    tag, value = arg
    if tag == "k":
        return f"KEYS[{renumber[value]}]"
    if tag == "K":
        return "[" + ", ".join(f"KEYS[{renumber[i]}]" for i in decode_indices(value)) + "]"
    if tag == "r":
        return f"ctx({str(value)!r})"
    if tag == "x":  # written as data when recorded (kvobs.flight.Encoded)
        values.append(bytes(value))
        return f"decode(VALUES[{len(values) - 1}], TABLE)"
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    raise ReplayError(f"an argument {tag!r} of type {type(value).__name__} cannot be written into a test")


def render(bundle: Bundle, indices: Sequence[int]) -> str:
    """The pytest file's source for the calls ``indices`` of ``bundle`` (the failed load last)."""
    header, failure = bundle.header, bundle.failure or {}
    used = sorted({i for index in indices for tag, value in bundle.calls[index][1] if tag in "kK"
                   for i in ([value] if tag == "k" else decode_indices(value))})
    renumber = {old: new for new, old in enumerate(used)}
    values: list[bytes] = []
    body: list[str] = []
    for index in indices:
        method, args, kwargs, recorded = bundle.calls[index]
        if method not in compat.CALL_ARGS or not method.isidentifier():
            raise ReplayError(f"{method!r} is not a recorded manager call")
        rendered = [_argument(a, renumber, values) for a in args]
        if kwargs is not None:
            rendered.append(f"**{_argument(('x', kwargs), renumber, values)}")
        call = f"manager.{method}({', '.join(rendered)})"
        if method == "lookup" and isinstance(recorded, str):
            body.append(f"    assert str({call}) == {recorded!r}  # as it answered in production")
        elif index == indices[-1] and failure:
            body.append("    # vLLM raised here in production: RECORDED['vllm_message']")
            body.append(f"    {call}")
        else:
            body.append(f"    {call}")
    recorded_fields = {name: str(value) for name, value in (
        ("vllm_version", header.get("vllm_version")), ("manager", header.get("manager")),
        ("kvobs_version", header.get("kvobs_version")), ("vllm_message", failure.get("vllm_message")),
        ("cause", failure.get("cause")), ("message", failure.get("message"))) if value is not None}
    recorded_source = "".join(f"    {name!r}: {_str_literal(text, '        ')[:-1]}    ),\n"
                              for name, text in recorded_fields.items())
    source = f'''"""A vLLM KV-offload failure, reproduced from a kvobs replay bundle ({len(indices)} calls).

STATE is the manager and its live requests at the start of the recording, as values, rebuilt with the classes
of the vLLM release in RECORDED (run this with that release). The last call is the one that failed. Each lookup
before it asserts what it answered in production; the last call is expected to succeed (a load, as they
promised), so this test fails while the bug is there. RECORDED["message"] is what kvobs said at the time.
"""

from __future__ import annotations

import zlib

from vllm.v1.kv_offload.base import ReqContext

# --- kvobs/state_codec.py, as kvobs {header.get("kvobs_version")!r} ships it: values to vLLM objects, no pickle ---
{_codec_source()}
# --- the classes a state may hold, in the installed vLLM ---
{_table_source()}
RECORDED = {{
{recorded_source}}}
STATE = {_bytes_literal(zlib.compress(bundle.state, 9))}
KEYS = [
{"".join(f"    {bundle.keys[i]!r},{chr(10)}" for i in used)}]
VALUES = [  # arguments other than keys and requests, as values
{"".join(f"    {_bytes_literal(v, '        ')[:-1]}    ),{chr(10)}" for v in values)}]


def test_replayed_offload_failure() -> None:
    manager, contexts = decode(zlib.decompress(STATE), TABLE)

    def ctx(req_id: str) -> ReqContext:
        if req_id not in contexts:
            contexts[req_id] = ReqContext(req_id)
        return contexts[req_id]

{chr(10).join(body)}
'''
    compile(source, "<kvobs emitted test>", "exec")  # a file that does not parse is kvobs's bug: said here
    return source
