"""``kvobs replay --emit-test``: a bundle's calls as a standalone pytest file that needs vLLM alone.

The file unpickles the manager's state at the window's start (embedded, compressed, base64), makes the
calls (each lookup asserts the answer it gave in production) and ends with the load that failed: it
expects that load to succeed, as the lookup before it promised, so the test fails with vLLM's own
assertion while the bug is there, and passes once it is fixed. Nothing of kvobs is imported.
"""

from __future__ import annotations

import base64
import textwrap
import zlib
from collections.abc import Sequence
from typing import Any

from kvobs.flight import decode_indices
from kvobs.vllm.replay import Bundle

_WIDTH = 100


def _literal(blob: bytes) -> str:
    text = base64.b64encode(zlib.compress(blob, 9)).decode()
    lines = textwrap.wrap(text, _WIDTH - 8)
    return "(\n" + "".join(f'    "{line}"\n' for line in lines) + ")"


def _argument(arg: tuple[str, Any], values: list[bytes]) -> str:
    tag, value = arg
    if tag == "k":
        return f"KEYS[{value}]"
    if tag == "K":
        return "[" + ", ".join(f"KEYS[{i}]" for i in value) + "]"
    if tag == "r":
        return f"ctx({value!r})"
    if tag == "p":  # pickled when recorded (kvobs.flight.Encoded)
        values.append(value)
        return f"VALUES[{len(values) - 1}]"
    return repr(value)


def render(bundle: Bundle, indices: Sequence[int]) -> str:
    """The pytest file's source for the calls ``indices`` of ``bundle`` (the failed load last)."""
    header, failure = bundle.header, bundle.failure or {}
    used = sorted({i for index in indices for arg in bundle.calls[index][1] if arg[0] in "kK"
                   for i in ([arg[1]] if arg[0] == "k" else decode_indices(arg[1]))})
    renumber = {old: new for new, old in enumerate(used)}
    values: list[bytes] = []
    body: list[str] = []
    for index in indices:
        method, args, kwargs, recorded = bundle.calls[index]
        args = tuple((tag, renumber[v] if tag == "k" else [renumber[i] for i in decode_indices(v)] if tag == "K"
                      else v) for tag, v in args)
        rendered = [_argument(a, values) for a in args]
        if kwargs is not None:
            rendered.append(f"**{_argument(('p', kwargs), values)}")
        call = f"manager.{method}({', '.join(rendered)})"
        if method == "lookup" and isinstance(recorded, str):
            body.append(f"    assert str({call}) == {recorded!r}  # as it answered in production")
        elif index == indices[-1] and failure:
            body.append(f"    # vLLM asserted here in production: {failure.get('vllm_message', '')[:300]}")
            body.append(f"    {call}")
        else:
            body.append(f"    {call}")
    message = (failure.get("message") or "").replace('"""', "'''")
    return f'''"""A vLLM KV-offload failure, reproduced from a kvobs replay bundle ({len(indices)} calls).

vLLM {header.get("vllm_version")}, {header.get("manager")}; recorded by kvobs {header.get("kvobs_version")}.
STATE is the manager and its live requests at the start of the recording (pickled with vLLM's classes:
run this with vLLM {header.get("vllm_version")}). The last call is the load that failed. Each lookup before it
asserts what it answered in production; the load is expected to succeed, as they promised, so this test
fails while the bug is there.

What kvobs said at the time:
{textwrap.fill(message, _WIDTH)}
"""

import base64
import pickle
import zlib

from vllm.v1.kv_offload.base import ReqContext

STATE = {_literal(bundle.state)}
KEYS = [
{"".join(f"    bytes.fromhex({bundle.keys[i].hex()!r}),{chr(10)}" for i in used)}]
VALUES = [pickle.loads(zlib.decompress(base64.b64decode(v))) for v in [  # arguments other than keys and requests
{"".join(f"    {base64.b64encode(zlib.compress(v)).decode()!r},{chr(10)}" for v in values)}]]


def test_replayed_offload_failure() -> None:
    manager, contexts = pickle.loads(zlib.decompress(base64.b64decode(STATE)))

    def ctx(req_id: str) -> ReqContext:
        if req_id not in contexts:
            contexts[req_id] = ReqContext(req_id)
        return contexts[req_id]

{chr(10).join(body)}
'''
