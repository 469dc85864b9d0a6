"""A replay bundle is data (issue 40; SECURITY.md): whatever a bundle holds, ``kvobs replay`` refuses it with
exit 2 or replays vLLM's manager from its values, and runs nothing else; a test it emits is code kvobs wrote,
with every value from the bundle a literal, so it compiles whatever bytes the keys and text the header hold.
Bundles come from real failures on vLLM's real CPU manager (tests/integration/test_replay.py's defects)."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import msgspec
import pytest

from kvobs.bundles import HEADER, WINDOW
from kvobs.cli import main as kvobs_main
from kvobs.state_codec import StateError
from kvobs.vllm import compat
from kvobs.vllm.bundle_replay import ReplayError, load, replay
from kvobs.vllm.emit import render
from tests.integration.test_replay import fail_and_bundle


class _RunsCode:
    """Unpickled, this would create ``MARKER``: the canonical pickle exploit (os.system at load)."""

    marker = ""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _rewrite(path: Path, header: dict | None = None, window: bytes | None = None, out: Path | None = None) -> Path:
    """A copy of bundle ``path`` with its header and/or window replaced."""
    with zipfile.ZipFile(path) as bundle:
        old_header, old_window = json.loads(bundle.read(HEADER)), bundle.read(WINDOW)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr(HEADER, json.dumps(old_header if header is None else header))
        bundle.writestr(WINDOW, old_window if window is None else window)
    target = out or path.with_name("crafted.kvobs-replay.zip")
    target.write_bytes(buffer.getvalue())
    return target


def test_a_bundle_holding_a_pickle_runs_nothing_and_exits_2(managers: list, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    real = fail_and_bundle(managers, tmp_path, "evicted_after_lookup")
    marker = tmp_path / "pwned"
    _RunsCode.marker = str(marker)
    payload = pickle.dumps({"state": _RunsCode(), "keys": [], "calls": []})
    header = json.loads(zipfile.ZipFile(real).read(HEADER))
    old = {**header, "format": 1}
    crafted = [
        _rewrite(real, old, payload, tmp_path / "format1.kvobs-replay.zip"),  # the format that held pickles
        _rewrite(real, None, payload, tmp_path / "pickled-window.kvobs-replay.zip"),  # a pickle as the window
        _rewrite(real, None, msgspec.msgpack.encode({"state": payload, "keys": [], "calls": []}),
                 tmp_path / "pickled-state.kvobs-replay.zip"),  # a pickle as the state
    ]
    for path in crafted:
        assert kvobs_main(["replay", str(path)]) == 2, path
        err = capsys.readouterr().err
        assert err.startswith("kvobs replay: ") and "Traceback" not in err, err
    assert not marker.exists()
    assert "format 1 held a pickle" in _error(crafted[0])


def _error(path: Path) -> str:
    with pytest.raises(ReplayError) as caught:
        bundle = load(str(path))
        replay(bundle)
    return str(caught.value)


def _window(path: Path) -> dict:
    return msgspec.msgpack.decode(zipfile.ZipFile(path).read(WINDOW))


def test_names_in_a_bundle_select_nothing_outside_its_tables(managers: list, tmp_path: Path) -> None:
    real = fail_and_bundle(managers, tmp_path, "evicted_after_lookup")
    window = _window(real)
    table = compat.snapshot_table()
    assert all(tag.startswith("vllm.v1.kv_offload.") for tag in table)

    def crafted(name: str, **changes: object) -> Path:
        return _rewrite(real, None, msgspec.msgpack.encode({**window, **changes}), tmp_path / f"{name}.zip")

    os_system = state_blob(["os:system"], ["o", 0, 0, []])
    assert "not in the snapshot table" in _error(crafted("state-os", state=os_system))
    as_class = state_blob(["builtins:eval"], ["c", 0])
    assert "not in the snapshot table" in _error(crafted("class-eval", state=as_class))
    # an attribute the class does not set (a method's name, a dunder) is refused, not set
    manager_tag = next(tag for tag, entry in table.items() if entry.cls is compat.CPUOffloadingManager)
    dunder = state_blob([manager_tag, "__class__"], ["o", 0, 0, [1, ["c", 0]]])
    assert "are not the ones its class sets" in _error(crafted("dunder", state=dunder))
    calls = window["calls"]
    for method in ("__class__", "__reduce_ex__", "shutdown", "take_events", "_free_chunk"):
        bad = [[method, calls[0][1], None, None], *calls[1:]]
        assert "is not a manager call a bundle may hold" in _error(crafted(f"method-{method}", calls=bad)), method
    at = next(i for i, call in enumerate(calls) if call[0] == "lookup")
    method, args, _, answer = calls[at]

    def one_call(*replacement: object) -> list:
        return [*calls[:at], list(replacement), *calls[at + 1:]]

    wrong_kind = one_call(method, [["x", os_system], *args[1:]], None, answer)
    assert "lookup's key argument is 'x'" in _error(crafted("wrong-kind", calls=wrong_kind))
    keyword = state_blob([], ["d", ["cache_policy_module_path", "os"]])
    assert "keywords" in _error(crafted("keyword", calls=one_call(method, args, keyword, answer)))
    beyond = one_call(method, [["k", 10**6], *args[1:]], None, answer)
    assert "lookup's key argument is 'k'" in _error(crafted("beyond", calls=beyond))


def test_every_mutation_of_a_real_bundle_is_refused_or_replayed(managers: list, tmp_path: Path) -> None:
    """Seeded byte mutations of a real window (coverage-guided fuzzing is tests/fuzz/fuzz_bundle.py): each
    loads and replays, or is refused with ReplayError; no other exception leaves kvobs."""
    real = fail_and_bundle(managers, tmp_path, "evicted_after_lookup")
    blob = zipfile.ZipFile(real).read(WINDOW)
    rng = random.Random(40)
    outcomes = {"refused": 0, "replayed": 0}
    for _ in range(300):
        data = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            position = rng.randrange(len(data))
            data[position] = rng.randrange(256) if rng.random() < 0.8 else data[position] ^ 0x80
        path = _rewrite(real, None, bytes(data), tmp_path / "mutated.zip")
        try:
            replay(load(str(path)))
            outcomes["replayed"] += 1
        except ReplayError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == 300, outcomes


def state_blob(names: list[str], tree: object, blobs: list[bytes] | None = None) -> bytes:
    """A state blob as kvobs.state_codec writes one: its format, bytes table, names and tree."""
    return msgspec.msgpack.encode([1, blobs or [], names, tree])


def test_state_blobs_are_refused_with_a_state_error_whatever_their_bytes() -> None:
    lookup_result = "vllm.v1.kv_offload.base:LookupResult"
    deep: object = None
    for _ in range(100):  # within msgspec's nesting, beyond the codec's MAX_DEPTH
        deep = ["l", [deep]]
    for blob in (b"", b"\xc1", b"\x91" * 5000 + b"\xc0", msgspec.msgpack.encode(["l"] * 3),
                 state_blob([], ["s", [["l", []]]]), state_blob([], ["r", 7]), state_blob([], ["d", [1]]),
                 state_blob([], ["q", [], -1]), state_blob([lookup_result], ["e", 0, "__class__"]),
                 state_blob([], ["b", 3], [b"k"]), state_blob([], ["e", 5, "HIT"]),
                 msgspec.msgpack.encode([2, [], [], None]), state_blob([], deep)):
        with pytest.raises(StateError):
            compat.decode_value(blob)


HOSTILE_TEXT = ('"""\n\'\'\'\nimport os; os.system("touch x")  # \\x4\\\n\\N{', "back\\slash\\", "\udc80 lone",
                "\x00\x1b[31m\r\n", "'; raise SystemExit #")


def test_an_emitted_test_compiles_for_every_byte_in_its_keys_and_any_header_text(
    managers: list, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = fail_and_bundle(managers, tmp_path, "evicted_after_lookup")
    bundle = load(str(real))
    everything = list(range(len(bundle.calls)))
    for text in HOSTILE_TEXT:
        for field in ("vllm_version", "manager", "kvobs_version"):
            bundle.header[field] = text
        assert bundle.failure is not None
        for field in ("message", "vllm_message", "cause"):
            bundle.failure[field] = text * 40  # long enough to wrap
        compile(render(bundle, everything), "emitted", "exec")
    keys = list(bundle.keys)
    for value in range(256):  # every byte value, alone and in the middle of a key
        bundle.keys = [bytes([value]) if i % 2 else b"k" + bytes([value]) * 3 + b"\\" for i in range(len(keys))]
        compile(render(bundle, everything), "emitted", "exec")
    bundle.keys = [bytes(range(256))] * len(keys)
    compile(render(bundle, everything), "emitted", "exec")

    # With the real keys and the hostile header, the emitted test still runs and fails with vLLM's assertion.
    bundle.keys = keys
    test_file = tmp_path / "emitted" / "test_hostile_header.py"
    test_file.parent.mkdir()
    test_file.write_text(render(bundle, everything), encoding="utf-8")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file.name],
                         cwd=test_file.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "not found in cache" in run.stdout and "1 failed" in run.stdout, run.stdout
    assert not (test_file.parent / "x").exists()
