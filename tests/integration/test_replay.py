"""The flight recorder and ``kvobs replay`` on every defect class the project reproduces, on vLLM's real CPU
manager (every supported release): the failed load writes a bundle; replaying it rebuilds vLLM's manager
from the snapshot and hits vLLM's own assertion at the same call with the same text; ``--minimize`` keeps
the promise and the load; the emitted test fails against vLLM alone (run in a fresh interpreter that
never imports kvobs)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext

import kvobs
from kvobs.bundles import BUNDLE_DIR, BUNDLE_SUFFIX
from kvobs.cli import main as kvobs_main
from kvobs.vllm import ObservedOffloadingManager
from kvobs.vllm.bundle_replay import ReplayError, load, minimize, replay
from kvobs.vllm.flight_recorder import write_bundle
from kvobs.wire.format import FAILURES_DIR
from tests.support.causes import END, ctx, failed_load, observed, store
from tests.support.vllm_env import cpu_extra, create_manager, key, tiering_extra


def noise(m: OffloadingManager, rounds: int, first: int = 5000) -> None:
    """Unrelated traffic: requests that store, look up, load and finish (the minimiser drops it)."""
    for i in range(rounds):
        c = ctx(m, f"noise-{i}")
        keys = [key(first + 2 * i), key(first + 2 * i + 1)]
        out = m.prepare_store(keys, c)
        if out is not None:
            m.complete_store(keys, c)
        if m.lookup(keys[0], c) is LookupResult.HIT:
            spec = m.prepare_load([keys[0]], c)
            assert spec is not None
            m.complete_load([keys[0]], c)
        m.on_request_finished(c)
        m.on_schedule_end(END)


def idle(m: OffloadingManager, rounds: int) -> None:
    """Requests that find nothing and finish (no store: the defect's chunks stay as the defect left them)."""
    for i in range(rounds):
        c = ctx(m, f"idle-{i}")
        assert m.lookup(key(90_000 + i), c) is LookupResult.MISS
        m.on_request_finished(c)
        m.on_schedule_end(END)


def coverage_mismatch(m: ObservedOffloadingManager) -> tuple[list[bytes], ReqContext]:
    a = ctx(m, "req-a")
    store(m, [key(1)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    return [key(1), key(7, group=2)], a


def evicted_after_lookup(m: ObservedOffloadingManager) -> tuple[list[bytes], ReqContext]:
    """#50014's pattern: in one scheduler pass a lookup promises key(1), another request's store evicts it."""
    a, b = ctx(m, "req-a"), ctx(m, "req-b")
    store(m, [key(1), key(2), key(3), key(4)], a)
    assert m.lookup(key(1), a) is LookupResult.HIT
    store(m, [key(11), key(12), key(13), key(14)], b)
    return [key(1)], a


def reset_after_lookup(m: ObservedOffloadingManager) -> tuple[list[bytes], ReqContext]:
    a = ctx(m, "req-a")
    store(m, [key(1)], a)
    m.on_schedule_end(END)
    assert m.lookup(key(1), a) is LookupResult.HIT
    m.reset_cache()
    return [key(1)], a


def store_failed_after_lookup(m: ObservedOffloadingManager) -> tuple[list[bytes], ReqContext]:
    a, w = ctx(m, "req-a"), ctx(m, "writer")
    m.prepare_store([key(1)], w)
    assert m.lookup(key(1), a) is LookupResult.HIT_PENDING
    m.complete_store([key(1)], w, False)
    return [key(1)], a


def store_in_flight(m: ObservedOffloadingManager) -> tuple[list[bytes], ReqContext]:
    a = ctx(m, "req-a")
    store(m, [key(1)], a, complete=False)
    assert m.lookup(key(1), a) is LookupResult.HIT_PENDING
    return [key(1)], a


DEFECTS: dict[str, Callable[[ObservedOffloadingManager], tuple[list[bytes], ReqContext]]] = {
    "coverage_mismatch": coverage_mismatch,
    "evicted_after_lookup": evicted_after_lookup,
    "reset_after_lookup": reset_after_lookup,
    "store_failed_after_lookup": store_failed_after_lookup,
    "store_in_flight": store_in_flight,
}


def fail_and_bundle(managers: list, tmp_path: Path, defect: str, before: int = 6, after: int = 3,
                    extra: dict | None = None) -> Path:
    m = observed(managers, extra or cpu_extra(4), dir=str(tmp_path), flight_calls=16)
    noise(m, before)  # 16-call segments: the window starts at a snapshot with chunks resident
    keys, a = DEFECTS[defect](m)
    idle(m, after)
    match = failed_load(m, keys, a)
    assert match["cause"] == defect
    assert m.observer.flight.snapshots >= 2
    bundles = sorted((tmp_path / BUNDLE_DIR).glob(f"*{BUNDLE_SUFFIX}"))
    assert len(bundles) == 1
    return bundles[0]


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_each_defect_replays_to_vllms_own_assertion(managers: list, tmp_path: Path, defect: str) -> None:
    path = fail_and_bundle(managers, tmp_path, defect)
    bundle = load(str(path))
    assert bundle.failure is not None and bundle.failure["cause"] == defect
    outcome = replay(bundle)
    assert outcome.reproduces(bundle), outcome
    assert outcome.message == bundle.failure["vllm_message"] and not outcome.diverged
    kept = minimize(bundle, budget_s=60)
    assert len(kept) < len(bundle.calls) and kept[-1] == len(bundle.calls) - 1
    assert replay(bundle, kept).reproduces(bundle)
    methods = [bundle.calls[i][0] for i in kept]
    if defect != "coverage_mismatch":  # the promise the load relied on is kept
        assert "lookup" in methods, methods
    assert not any(bundle.calls[i][1] and bundle.calls[i][1][-1] == ("r", "noise-0") for i in kept)


@pytest.mark.parametrize("defect", ["evicted_after_lookup", "reset_after_lookup"])
def test_the_arc_policy_replays_too(managers: list, tmp_path: Path, defect: str) -> None:
    path = fail_and_bundle(managers, tmp_path, defect, extra=cpu_extra(4, eviction_policy="arc"))
    bundle = load(str(path))
    assert replay(bundle).reproduces(bundle)
    assert replay(bundle, minimize(bundle, budget_s=60)).reproduces(bundle)


def test_a_tiering_manager_is_not_recorded_and_its_bundle_says_why(managers: list, tmp_path: Path) -> None:
    m = observed(managers, tiering_extra(4), dir=str(tmp_path), flight_calls=50_000)
    assert m.observer.flight is None and "cannot be snapshotted" in (m.observer.flight_off_reason or "")
    assert m.complete_load == m.inner.complete_load  # nothing tapped for a recorder that is off
    a = ctx(m, "req-a")
    failed_load(m, [key(1)], a)
    path = next((tmp_path / BUNDLE_DIR).glob(f"*{BUNDLE_SUFFIX}"))
    with pytest.raises(ReplayError, match="TieringOffloadingManager's state cannot be snapshotted"):
        load(str(path))


def test_a_tiering_manager_on_default_options_writes_no_bundle(managers: list, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The recorder is on by default only where it can run: on a tiering manager it is off, and a failed load
    gets its report and no bundle (one without a window would add nothing to it)."""
    m = observed(managers, tiering_extra(4), dir=str(tmp_path))
    assert m.observer.flight is None and "cannot be snapshotted" in (m.observer.flight_off_reason or "")
    a = ctx(m, "req-a")
    with caplog.at_level(logging.INFO, logger="kvobs"):
        failed_load(m, [key(1)], a)
    assert any((tmp_path / FAILURES_DIR).iterdir()), "the failure report is still written"
    assert not (tmp_path / BUNDLE_DIR).exists()
    assert not [r for r in caplog.records if "replay bundle" in r.getMessage()], caplog.text


@pytest.mark.parametrize("defect", ["evicted_after_lookup", "store_in_flight"])
def test_the_emitted_test_fails_against_vllm_alone(managers: list, tmp_path: Path, defect: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = fail_and_bundle(managers, tmp_path, defect)
    test_file = tmp_path / "emitted" / "test_vllm_offload_replay.py"
    test_file.parent.mkdir()
    assert kvobs_main(["replay", str(path), "--minimize", "--emit-test", str(test_file), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["reproduced"] and result["minimized_calls"] < result["calls"]
    source = test_file.read_text()
    assert "kvobs" not in "".join(line for line in source.splitlines() if "import" in line)
    # A conftest that records whether anything imported kvobs while the emitted test ran.
    (test_file.parent / "conftest.py").write_text(
        "import sys\n\ndef pytest_sessionfinish(session):\n"
        "    open('kvobs-imported', 'w').write(str(any(m == 'kvobs' or m.startswith('kvobs.') for m in sys.modules)))\n"
    )
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file.name],
                         cwd=test_file.parent, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert result["recorded"] in run.stdout and "AssertionError" in run.stdout, run.stdout
    assert (test_file.parent / "kvobs-imported").read_text() == "False"


def test_replay_says_what_it_cannot_do(managers: list, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = fail_and_bundle(managers, tmp_path, "evicted_after_lookup")
    assert kvobs_main(["replay", str(path)]) == 0
    assert "result: reproduced" in capsys.readouterr().out
    not_a_bundle = tmp_path / "x.zip"
    not_a_bundle.write_bytes(b"garbage")
    assert kvobs_main(["replay", str(not_a_bundle)]) == 2
    assert "not a kvobs replay bundle" in capsys.readouterr().err
    with pytest.raises(ReplayError, match="not a kvobs replay bundle"):
        load(str(not_a_bundle))


def test_an_on_demand_bundle_replays_every_call_as_recorded(managers: list, tmp_path: Path) -> None:
    m = observed(managers, cpu_extra(4), flight_calls=10)
    noise(m, 9)
    path = tmp_path / f"now{BUNDLE_SUFFIX}"
    write_bundle(path, m.inner, m.observer)
    bundle = load(str(path))
    assert bundle.failure is None and len(bundle.calls) >= 10
    outcome = replay(bundle)
    assert outcome.raised_at is None and not outcome.diverged
    assert kvobs_main(["replay", str(path)]) == 0  # no failure to reproduce: every call answered as recorded


def test_default_options_write_a_bundle_that_replays_the_failure(managers: list, tmp_path: Path) -> None:
    """The flight recorder is on by default (issue 43): a failed load with nothing but ``dir`` set writes a bundle,
    and replaying it hits vLLM's own assertion at the same call."""
    m = observed(managers, cpu_extra(4), dir=str(tmp_path))
    assert m.observer.options.flight_calls is None and m.observer.flight is not None
    noise(m, 20)
    keys, a = evicted_after_lookup(m)
    failed_load(m, keys, a)
    bundle = load(str(next((tmp_path / BUNDLE_DIR).glob(f"*{BUNDLE_SUFFIX}"))))
    assert bundle.header["options"]["flight_calls"] == 50_000 and bundle.failure is not None
    outcome = replay(bundle)
    assert outcome.reproduces(bundle), outcome


def test_no_recorder_and_no_bundle_with_flight_calls_0(managers: list, tmp_path: Path) -> None:
    m = observed(managers, cpu_extra(4), dir=str(tmp_path), flight_calls=0)
    assert m.observer.flight is None and "flight_calls is 0" in (m.observer.flight_off_reason or "")
    assert m.complete_load == m.inner.complete_load and m.on_new_request == m.inner.on_new_request
    keys, a = evicted_after_lookup(m)
    failed_load(m, keys, a)
    assert not (tmp_path / BUNDLE_DIR).exists()


def test_a_state_over_a_quarter_of_flight_bytes_turns_the_recorder_off(managers: list, tmp_path: Path) -> None:
    m = observed(managers, cpu_extra(20_000), dir=str(tmp_path), flight_calls=100, flight_bytes=2**20)
    writer = ctx(m, "writer")
    for i in range(200):  # 10,000 chunks resident: a snapshot of about 1 MiB
        store(m, [key(100_000 + 50 * i + j) for j in range(50)], writer)
    m.observer.drain()
    window = m.observer.flight
    assert window is not None and "over a quarter of flight_bytes (1048576)" in (window.off_reason or "")
    assert not m.observer.recorder.flight_calls and window.calls == 0
    a = ctx(m, "req-a")
    failed_load(m, [key(1)], a)
    path = next((tmp_path / BUNDLE_DIR).glob(f"*{BUNDLE_SUFFIX}"))
    with pytest.raises(ReplayError, match="over a quarter of flight_bytes"):
        load(str(path))
    assert not +m.observer.internal_errors


def test_a_window_over_its_budget_snapshots_sooner_and_stays_bounded(managers: list) -> None:
    m = observed(managers, cpu_extra(4), flight_calls=1_000_000, flight_bytes=2**20)
    for part in range(50):  # 10,000 distinct keys, far fewer calls than flight_calls
        noise(m, 100, first=200_000 + 200 * part)
        # The applier keeps up: the asked-for snapshot comes at the next call. (Left to the applier thread, a
        # busy machine applies the whole run at once, and the count below would measure its timing.)
        m.observer.drain()
    window = m.observer.flight
    assert window.snapshots >= 3 and window.off_reason is None
    assert window.nbytes <= 2**20
    path_calls = window.calls
    assert 0 < path_calls < 5_000 * 7


def test_a_wrapped_method_is_no_state_but_an_attribute_vllm_does_not_set_turns_the_recorder_off(
    managers: list, tmp_path: Path
) -> None:
    inner = create_manager(cpu_extra(4))
    lookup, evict = inner.lookup, inner._policy.evict
    inner.lookup = lambda *args, **kwargs: lookup(*args, **kwargs)  # a profiler's timers in the methods' place
    inner._policy.evict = lambda *args, **kwargs: evict(*args, **kwargs)
    m = kvobs.observe(inner, dir=str(tmp_path), flight_calls=16)
    managers.append(m)
    assert m.observer.flight is not None, m.observer.flight_off_reason
    noise(m, 6)
    keys, a = evicted_after_lookup(m)
    failed_load(m, keys, a)
    bundle = load(str(next((tmp_path / BUNDLE_DIR).glob(f"*{BUNDLE_SUFFIX}"))))
    assert replay(bundle).reproduces(bundle)

    # State vLLM's class does not set: no snapshot may miss it. Where CPython keeps the policy's attributes
    # inline, kvobs reads them one by one and finds one too many; where the new attribute gave the policy a
    # real __dict__ (it does once an instance outgrows its class's shared keys, which depends on what ran
    # before), the snapshot reads that dict and finds a name the class does not set. Either way: no recorder.
    patched = create_manager(cpu_extra(4))
    patched._policy.extra = {"state": "kvobs does not know"}
    other = kvobs.observe(patched, flight_calls=16)
    managers.append(other)
    assert other.observer.flight is None
    assert "LRUCachePolicy holds" in (other.observer.flight_off_reason or "")
