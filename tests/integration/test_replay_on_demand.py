"""Replay bundles on demand through the sidecar (``POST /api/v1/replays``): a real ``kvobs serve`` process
and vLLM's real CPU manager under kvobs sharing one directory, as in a pod. The engine keeps working while
its journal writer answers; the bundle it writes is fetched over HTTP and replays (no failure in it: the
replay runs every call to the end without diverging)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager

from kvobs.bundles import MAX_BUNDLES
from kvobs.cli import main as kvobs_main
from kvobs.replay_requests import POLL_EVERY_S, REQUEST_EVERY_S, REQUEST_TTL_S, make_request, requests_dir
from kvobs.sidecar.replay_endpoints import REPLAYS_PATH
from kvobs.vllm.bundle_replay import load, replay
from tests.support.causes import END, ctx, failed_load, observed, store
from tests.support.services import ROOT, Sidecar, http_get, wait_for
from tests.support.vllm_env import cpu_extra, key


def traffic(m: OffloadingManager, rounds: int, first: int) -> None:
    """Requests that store, look up, load and finish, as a scheduler makes them."""
    for i in range(rounds):
        c = ctx(m, f"req-{first + i}")
        keys = [key(first + 2 * i), key(first + 2 * i + 1)]
        if m.prepare_store(keys, c) is not None:
            m.complete_store(keys, c)
        if m.lookup(keys[0], c) is LookupResult.HIT:
            assert m.prepare_load([keys[0]], c) is not None
            m.complete_load([keys[0]], c)
        m.on_request_finished(c)
        m.on_schedule_end(END)


def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(url, data=b"", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"null")


def bundles(sidecar: Sidecar, headers: dict[str, str] | None = None) -> dict[str, Any]:
    status, _, body = http_get(f"{sidecar.url}{REPLAYS_PATH}", headers)
    assert status == 200, body
    return dict(json.loads(body))


def live_engine(managers: list, sidecar: Sidecar, engine: str = "0", **options: Any) -> OffloadingManager:
    """An observed manager writing to the sidecar's directory, once its journal is there: an engine alive to
    answer (a request for none is refused)."""
    m = observed(managers, cpu_extra(64), dir=str(sidecar.dir), engine=engine, **options)
    wait_for(lambda: list((sidecar.dir / "journal").glob(f"{engine}-*.jsonl")), what=f"engine {engine}'s journal")
    return m


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    running = Sidecar(tmp_path / "kvobs").start()
    yield running
    running.stop()


def answered(sidecar: Sidecar, request_id: str, m: OffloadingManager, first: int) -> dict[str, Any]:
    """The bundle answering ``request_id``, the engine working on until it is listed."""
    found: list[dict[str, Any]] = []

    def listed() -> bool:
        traffic(m, 20, first)  # the scheduler thread does not wait for the bundle
        found[:] = [b for b in bundles(sidecar)["bundles"] if b["requested"] == request_id]
        return bool(found)

    wait_for(listed, what=f"a bundle answering request {request_id}", timeout=20)
    return found[0]


def test_a_requested_bundle_is_written_while_the_engine_works_and_replays(
    managers: list, sidecar: Sidecar, tmp_path: Path
) -> None:
    m = live_engine(managers, sidecar, flight_calls=2_000)
    traffic(m, 300, 1_000)
    status, _, made = post(f"{sidecar.url}{REPLAYS_PATH}")
    assert status == 202 and made["engine"] is None and made["bundles"] == REPLAYS_PATH, made
    assert made["expected"] == ["0"], made
    listed = answered(sidecar, made["request"], m, 5_000)
    [followed] = bundles(sidecar)["requests"]  # the sidecar followed it to its answer
    assert followed["request"] == made["request"] and followed["state"] == "answered", followed
    assert followed["expected"] == followed["answered_by"] == ["0"] and followed["reason"] is None
    assert listed["engine"] == "0" and listed["failure"] is None
    assert listed["replayable"] is True and listed["calls"] > 100 and listed["why_not"] is None

    status, content_type, data = http_get(f"{sidecar.url}{listed['url']}")
    assert status == 200 and content_type == "application/zip" and len(data) == listed["bytes"]
    path = tmp_path / "fetched.kvobs-replay.zip"
    path.write_bytes(data)
    bundle = load(str(path))
    assert bundle.failure is None and len(bundle.calls) == listed["calls"]
    outcome = replay(bundle)
    assert outcome.raised_at is None and not outcome.diverged, outcome
    assert kvobs_main(["replay", str(path)]) == 0  # as README's example: every call answered as recorded

    # One request per REQUEST_EVERY_S: the next is refused with how long to wait, and leaves nothing.
    status, headers, body = post(f"{sidecar.url}{REPLAYS_PATH}")
    assert status == 429 and 0 < body["retry_after_s"] <= REQUEST_EVERY_S
    assert 1 <= int(headers["Retry-After"]) <= REQUEST_EVERY_S
    assert [p["request"] for p in bundles(sidecar)["pending"]] == [made["request"]]
    assert not +m.observer.internal_errors


def test_an_engine_without_the_recorder_answers_with_why(managers: list, sidecar: Sidecar) -> None:
    m = live_engine(managers, sidecar, "dp1", flight_calls=0)
    status, _, made = post(f"{sidecar.url}{REPLAYS_PATH}?engine=dp1")
    assert status == 202 and made["engine"] == "dp1"
    listed = answered(sidecar, made["request"], m, 1_000)
    assert listed["engine"] == "dp1" and listed["replayable"] is False
    assert "flight_calls is 0" in listed["why_not"]


def test_a_request_for_an_engine_the_directory_never_had_is_a_404(managers: list, sidecar: Sidecar) -> None:
    """Issue 41: it was a 202 "answers within seconds", and vanished a minute later, unsaid."""
    live_engine(managers, sidecar)  # engine "0"
    status, _, body = post(f"{sidecar.url}{REPLAYS_PATH}?engine=dp7")
    assert status == 404 and body["engine"] == "dp7" and body["reason"] == "unknown", body
    assert "'dp7'" in body["error"] and "no journal" in body["error"]
    listing = bundles(sidecar)
    assert listing["bundles"] == listing["pending"] == listing["requests"] == []
    assert post(f"{sidecar.url}{REPLAYS_PATH}?engine=0")[0] == 202  # refused, it held no slot of the rate limit


def _dead_engine(directory: Path, engine: str) -> None:
    """A stand-in EngineCore process that journals, then dies on a failed load as EngineCore does."""
    died = subprocess.run([sys.executable, "-m", "tests.support.engine_process", str(directory), engine, "4", "fail"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert died.returncode != 0 and "AssertionError" in died.stderr, died.stderr[-2000:]
    assert list((directory / "journal").glob(f"{engine}-*.jsonl"))


def test_a_request_for_a_dead_engine_is_a_409_saying_why(managers: list, sidecar: Sidecar) -> None:
    """Its journal is there, but no live process holds it (the writer's flock died with it): nothing would
    answer. The same for a request to every engine when none is alive; a live one is asked as before."""
    _dead_engine(sidecar.dir, "dp3")
    status, _, body = post(f"{sidecar.url}{REPLAYS_PATH}?engine=dp3")
    assert status == 409 and body["engine"] == "dp3" and body["reason"] == "not_alive", body
    assert "'dp3'" in body["error"] and "died" in body["error"]
    status, _, body = post(f"{sidecar.url}{REPLAYS_PATH}")
    assert status == 409 and body["engine"] is None and body["reason"] == "no_live_engine", body
    assert "dp3" in body["error"]
    assert not requests_dir(sidecar.dir).exists() or not any(requests_dir(sidecar.dir).iterdir())
    live_engine(managers, sidecar, "dp1")
    status, _, made = post(f"{sidecar.url}{REPLAYS_PATH}")
    assert status == 202 and made["expected"] == ["dp1"], made  # the dead dp3 is not waited for


def test_a_request_no_engine_answers_in_time_is_listed_and_logged_as_unanswered(
    managers: list, sidecar: Sidecar
) -> None:
    """A request that expires unanswered (here one left for an engine that never comes, REQUEST_TTL_S - 2 s
    ago, as by an earlier sidecar) is listed with its state and reason, and logged in one line, once."""
    m = observed(managers, cpu_extra(64), dir=str(sidecar.dir))  # engine "0": answers only its own
    lost = make_request(sidecar.dir, "dp9", now=time.time() - REQUEST_TTL_S + 2)

    def settled() -> dict[str, Any] | None:
        traffic(m, 5, 1_000)
        found = [r for r in bundles(sidecar)["requests"] if r["request"] == lost.id]
        return found[0] if found and found[0]["state"] != "pending" else None

    state = wait_for(settled, what="the request to settle", timeout=20)
    assert state["state"] == "unanswered" and state["expected"] == ["dp9"] and state["answered_by"] == [], state
    assert "no bundle from dp9 within 60 s" in state["reason"]
    time.sleep(2 * POLL_EVERY_S)  # more sweeps: still one line
    lines = [line for line in sidecar.log_lines() if lost.id in line]
    assert len(lines) == 1 and "unanswered" in lines[0] and "dp9" in lines[0], sidecar.log_lines()[-20:]


@pytest.mark.parametrize(("query", "parameter", "says"), [
    ("?engine=a/../b", "engine", "not an engine label"),
    ("?engine=a&engine=b", "engine", "may be given once"),
    ("?model=x", "model", "unknown parameter 'model'"),
])
def test_a_bad_request_is_a_400_naming_the_parameter(sidecar: Sidecar, query: str, parameter: str, says: str) -> None:
    status, _, body = post(f"{sidecar.url}{REPLAYS_PATH}{query}")
    assert status == 400 and body["parameter"] == parameter and says in body["error"], body
    assert not (sidecar.dir / "replay").exists()


def test_with_a_token_every_replay_endpoint_needs_it(managers: list, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    sidecar = Sidecar(tmp_path / "kvobs", "--token-file", str(token)).start()
    try:
        assert post(f"{sidecar.url}{REPLAYS_PATH}")[0] == 401
        assert not (sidecar.dir / "replay").exists()
        for path in (REPLAYS_PATH, f"{REPLAYS_PATH}/000000000000001-0-1-1"):
            assert http_get(f"{sidecar.url}{path}")[0] == 401
        auth = {"Authorization": "Bearer s3cret"}
        live_engine(managers, sidecar)
        assert post(f"{sidecar.url}{REPLAYS_PATH}", auth)[0] == 202
        assert len(bundles(sidecar, auth)["pending"]) == 1
        status, _, body = http_get(f"{sidecar.url}{REPLAYS_PATH}/000000000000001-0-1-1", auth)
        assert status == 404 and b"no bundle" in body
        status, _, body = http_get(f"{sidecar.url}{REPLAYS_PATH}/..%2F..%2Fetc%2Fpasswd", auth)
        assert status == 404
    finally:
        sidecar.stop()


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH"])
def test_other_methods_on_replays_are_refused_and_say_which_are_allowed(sidecar: Sidecar, method: str) -> None:
    request = urllib.request.Request(f"{sidecar.url}{REPLAYS_PATH}", data=b"{}", method=method)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405 and refused.value.headers["Allow"] == "GET, HEAD, POST"
    assert not (sidecar.dir / "replay").exists()


def test_requested_bundles_never_push_out_a_failures(managers: list, sidecar: Sidecar) -> None:
    m = observed(managers, cpu_extra(4), dir=str(sidecar.dir), flight_calls=2_000)
    traffic(m, 50, 1_000)
    a = ctx(m, "req-a")
    k = key(77)
    store(m, [k], a)
    assert m.lookup(k, a) is LookupResult.HIT
    store(m, [key(78 + i) for i in range(4)], ctx(m, "evicts"))  # four chunks: k is evicted after its lookup
    failed_load(m, [k], a)
    now = time.time()
    # Five requests as if made a second more than REQUEST_EVERY_S apart, the newest now (all within REQUEST_TTL_S).
    made = [make_request(sidecar.dir, None, now=now - (REQUEST_EVERY_S + 1) * back) for back in range(4, -1, -1)]
    newest = {r.id for r in made[1:]}  # the oldest answered, then pruned (or expired first on a slow machine)
    wait_for(lambda: {b["requested"] for b in bundles(sidecar)["bundles"] if b["requested"]} == newest,
             what="the bundles of the four newest requests, and no other", timeout=20)
    listing = bundles(sidecar)["bundles"]
    assert [b["failure"]["cause"] for b in listing if b["failure"]] == ["evicted_after_lookup"]
    assert len([b for b in listing if b["requested"]]) == MAX_BUNDLES


def test_a_request_from_a_clock_stepped_back_does_not_block_new_ones(managers: list, sidecar: Sidecar) -> None:
    live_engine(managers, sidecar)
    ahead = make_request(sidecar.dir, None, now=time.time() + 3600)  # made before the clock went back an hour
    status, _, made = post(f"{sidecar.url}{REPLAYS_PATH}")
    assert status == 202, made
    assert [p["request"] for p in bundles(sidecar)["pending"]] == [made["request"]] != [ahead.id]


def test_a_small_body_is_ignored_and_a_large_one_refused_unread(managers: list, sidecar: Sidecar) -> None:
    live_engine(managers, sidecar)
    request = urllib.request.Request(f"{sidecar.url}{REPLAYS_PATH}", data=b"x" * 5000, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 413
    assert not (sidecar.dir / "replay").exists()
    request = urllib.request.Request(f"{sidecar.url}{REPLAYS_PATH}", data=b'{"engine": "ignored"}', method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 202 and json.loads(response.read())["engine"] is None
