"""vLLM's own offload-manager test suites, run bare and with every manager observed by kvobs.

What is here: ``vllm_0_34_0/`` holds vLLM v0.34.0's manager-level tests, vendored unchanged (each file
keeps vLLM's SPDX header and says where it came from; vLLM's license is ``vllm_0_34_0/LICENSE``). They
sit under ``vllm_0_34_0/tests/v1/kv_offload/``, the path they have in vLLM's repository, so that their
own imports (``from tests.v1.kv_offload.conftest import ...``) work as written: they import as the
package ``tests.v1.kv_offload``, ``tests`` being this repository's test package with the vendored
``tests/`` folder added to its ``__path__`` (below, where ``_RELEASE_DIR`` is set).

Two runs, same files:

* bare: ``pytest tests/upstream`` runs vLLM's tests as vLLM runs them;
* wrapped: ``KVOBS_UPSTREAM_WRAP=1 pytest tests/upstream`` runs them again with every offload manager
  they construct observed by ``kvobs.observe()``: every ``CPUOffloadingManager(...)`` and every
  ``TieringOffloadingManager(...)`` a test builds returns ``kvobs.observe(<the manager vLLM built>)``.
  The CPU tier of a tiering manager (``CPUPrimaryTierOffloadingManager``) is observed through the
  tiering wrapper, as in production, so it is not wrapped on its own (it is handed to the tiering
  manager, which kvobs then observes). Secondary tiers (file system, object store, P2P) are not
  ``OffloadingManager``\\ s and are never wrapped.

How the wrapping reaches the tests without touching them: before each test, the names
``CPUOffloadingManager`` and ``TieringOffloadingManager`` are monkeypatched, in every vendored test
module and in the two vLLM modules that define them (for tests that import them inside a function),
to a stand-in that builds the real manager and returns it observed. The stand-in is not a class of its
own for anything else: ``isinstance``/``issubclass`` and class attributes answer as the real class
does. After each wrapped test, kvobs must have counted no internal error of its own (it contains its
faults, so vLLM's assertions alone would not see one). The terminal summary counts the managers
observed, and a wrapped run that observed none fails.
Tests a kvobs wrapper cannot apply to are deselected in the wrapped run by name, each with its reason
(``NOT_FOR_A_WRAPPER``); ``KVOBS_UPSTREAM_WRAP=all`` runs them wrapped too.

Vendored modules that are only helpers of a manager suite are not collected (``HELPER_MODULES``); of a
secondary tier's suite that is mostly about the tier alone, only the tests that build a manager run
(``MANAGER_TESTS_ONLY``).

Collected only where it applies: the vendored tests are vLLM 0.34's, so they are collected only when
the installed vLLM is 0.34.x (``collect_ignore_glob`` below); on any other release, or without vLLM,
``pytest tests/upstream`` collects nothing here.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import tests

WRAP_VAR = "KVOBS_UPSTREAM_WRAP"
"""``KVOBS_UPSTREAM_WRAP=1``: the wrapped run; ``=all``: the wrapped run, ``NOT_FOR_A_WRAPPER`` included."""

VENDORED_RELEASES = {(0, 34): "vllm_0_34_0"}
"""(major, minor) of vLLM -> the folder holding that release's vendored tests."""

VENDORED_PACKAGE = "tests.v1.kv_offload"
"""The package name the vendored tests import as (their path in vLLM's repository)."""

WRAPPED_CLASSES = {
    "vllm.v1.kv_offload.cpu.manager": "CPUOffloadingManager",
    "vllm.v1.kv_offload.tiering.manager": "TieringOffloadingManager",
}
"""The managers the tests construct that kvobs wraps: defining module -> class name."""

# Tests that cannot apply to a wrapped manager, by node id under vllm_0_34_0/: deselected in the
# wrapped run only (never skipped), named in its summary, and checked to exist whenever their module
# is collected. Each says why; keep this list as short as it can be. KVOBS_UPSTREAM_WRAP=all runs
# them wrapped anyway, to check that each still fails as its reason says.
_CUSTOM_POLICY = (
    "the manager's cache policy is the test's own out-of-tree _DummyCachePolicy, whose chunks are in "
    "none of chunks/t1/t2: kvobs.observe() raises ProtocolMismatch for it by design (docs/vllm.md, "
    "'When kvobs does not know the vLLM in front of it'; the plugin steps aside instead)"
)
NOT_FOR_A_WRAPPER: dict[str, str] = {
    "tests/v1/kv_offload/cpu/policies/test_factory.py::TestCachePolicyFactory::"
    "test_register_and_resolve_custom_policy": _CUSTOM_POLICY,
    "tests/v1/kv_offload/cpu/policies/test_factory.py::TestCachePolicyFactory::"
    "test_manager_resolves_policy_via_module_path": _CUSTOM_POLICY,
    "tests/v1/kv_offload/tiering/p2p/test_manager.py::TestPromotionLatency::"
    "test_p2p_load_without_transfer_time_records_promotion_latency": (
        "the tiering manager's primary tier is a SimpleNamespace stub, not a CPU manager: kvobs.observe() "
        "raises ProtocolMismatch('TieringOffloadingManager without a CPU primary_tier') by design, as it "
        "observes removals through the CPU tier's cache policy"
    ),
}


def _installed_vllm() -> tuple[int, int] | None:
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else (int(match[1]), int(match[2]))


_RELEASE_DIR = VENDORED_RELEASES.get(_installed_vllm() or (-1, -1))

if _RELEASE_DIR is not None:
    # ``tests`` is this repository's test package (tests/__init__.py), imported before the vendored
    # tests; their own package is also named ``tests`` (vLLM's tests/, holding v1/kv_offload). One name,
    # two folders: the vendored ``tests/`` joins this package's ``__path__``, so ``tests.v1`` is found
    # there (this repository's tests/ has no ``v1``) and the vendored modules import as written.
    _VENDORED_TESTS = str(Path(__file__).resolve().parent / _RELEASE_DIR / "tests")
    if _VENDORED_TESTS not in tests.__path__:
        tests.__path__.append(_VENDORED_TESTS)

HELPER_MODULES = {
    "vllm_0_34_0": (
        # Imported by tiering/p2p/test_manager.py for helpers (fake sessions, a free port, a ZMQ
        # transport); P2P session and transport suites, not manager suites: not collected.
        "tests/v1/kv_offload/tiering/p2p/test_sessions.py",
        "tests/v1/kv_offload/tiering/p2p/test_zmq_transport.py",
    ),
}
"""Vendored test modules that are there only because a manager suite imports them."""

MANAGER_TESTS_ONLY = {
    "vllm_0_34_0": {
        # The P2P tier's suite: 11 of its tests build a TieringOffloadingManager over the P2P tier (two
        # put it under vLLM's real scheduler and EngineCore pause check); the other 121 test the P2P tier
        # alone, with real ZMQ sockets and wall-clock deadlines (some flake on a loaded 2-core machine,
        # bare as well). Only these 11 are run, in both runs; the rest are deselected.
        "tests/v1/kv_offload/tiering/p2p/test_manager.py": (
            "TestPromotionLatency::test_p2p_load_without_transfer_time_records_promotion_latency",
            "test_timed_out_load_holds_chunks_until_abort_ack",
            "TestHasPendingWork::test_B2_idle_manager_does_not_keep_engine_busy",
            "TestHasPendingWork::test_B2_no_poll_thread_keeps_engine_busy",
            "test_reset_cache_aborts_load_from_silent_peer",
            "test_held_promotions_answer_peer_lookups_with_miss",
            "TestIdleWhileServingPeers::test_pinned_peer_hit_does_not_block_idleness",
            "TestIdleWhileServingPeers::test_pinned_peer_hit_without_poll_thread_is_pending",
            "test_reset_cache_releases_parked_p2p_slots",
            "test_reset_symmetric_lookup_rounds",
        ),
    },
}
"""Vendored suites of a secondary tier of which only the tests that build a manager are run (by node id
under the release folder, parameters aside)."""

# Every vendored release but the installed one's is left uncollected (not skipped: never imported).
collect_ignore_glob = [f"{folder}/*" for folder in VENDORED_RELEASES.values() if folder != _RELEASE_DIR]
collect_ignore = [f"{folder}/{path}" for folder, paths in HELPER_MODULES.items() for path in paths]


def wrapping() -> bool:
    return os.environ.get(WRAP_VAR, "") not in ("", "0")


def deselecting() -> bool:
    return wrapping() and os.environ.get(WRAP_VAR) != "all"


def pytest_configure(config: pytest.Config) -> None:
    # Marks vLLM's tests carry, registered by vLLM's top-level conftest and pyproject (not vendored);
    # this project runs pytest with --strict-markers.
    config.addinivalue_line("markers", "cpu_test: vLLM's mark for tests that run on CPU")
    config.addinivalue_line("markers", "skip_global_cleanup: vLLM's mark to skip its global cleanup")
    config.stash[_observed_key] = Counter()


_observed_key = pytest.StashKey[Counter[str]]()


class _ObservingConstructor(type):
    """Metaclass of the stand-ins: calling one builds the real manager and returns it observed."""

    _kvobs_real: type
    _kvobs_observed: list[Any]

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        import kvobs

        observed = kvobs.observe(cls._kvobs_real(*args, **kwargs))
        cls._kvobs_observed.append(observed)
        return observed

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._kvobs_real)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, cls._kvobs_real)

    def __getattr__(cls, name: str) -> Any:
        return getattr(cls._kvobs_real, name)

    def __repr__(cls) -> str:
        return f"<kvobs-observing stand-in for {cls._kvobs_real.__module__}.{cls._kvobs_real.__qualname__}>"


def _stand_in(real: type, observed: list[Any]) -> type:
    return _ObservingConstructor(
        real.__name__,
        (),
        {"_kvobs_real": real, "_kvobs_observed": observed, "__module__": real.__module__,
         "__qualname__": real.__qualname__, "__doc__": real.__doc__},
    )


@pytest.fixture(autouse=True)
def _kvobs_observe_upstream_managers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In the wrapped run, every manager the test constructs comes back observed by kvobs; after the
    test, kvobs must have counted no internal error of its own (kvobs contains its faults, so a test
    of vLLM's would pass over one)."""
    if not wrapping():
        yield
        return
    import importlib

    observed: list[Any] = []
    reals = {name: getattr(importlib.import_module(module), name) for module, name in WRAPPED_CLASSES.items()}
    stand_ins = {name: _stand_in(real, observed) for name, real in reals.items()}
    modules = [sys.modules[m] for m in WRAPPED_CLASSES]
    modules += [mod for name, mod in list(sys.modules.items())
                if mod is not None and (name == VENDORED_PACKAGE or name.startswith(VENDORED_PACKAGE + "."))]
    for module in modules:
        for name, real in reals.items():
            if getattr(module, name, None) is real:
                monkeypatch.setattr(module, name, stand_ins[name])
    yield
    totals = request.config.stash[_observed_key]
    totals.update(type(manager.inner).__name__ for manager in observed)
    totals["tests"] += bool(observed)
    totals["ran"] += 1
    faults = [f"{type(manager.inner).__name__}: {stage} x{n}"
              for manager in observed for stage, n in manager.observer.internal_errors.items() if n]
    if faults:
        pytest.fail(f"kvobs counted internal errors of its own: {'; '.join(faults)}", pytrace=False)


def _has(obj: Any, names: list[str]) -> bool:
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _RELEASE_DIR is None:
        return
    prefix = f"tests/upstream/{_RELEASE_DIR}/"
    modules = {item.nodeid.split("::")[0]: item.module for item in items if isinstance(item, pytest.Function)}
    manager_tests = MANAGER_TESTS_ONLY.get(_RELEASE_DIR, {})
    named = [*NOT_FOR_A_WRAPPER, *(f"{file}::{test}" for file, tests in manager_tests.items() for test in tests)]
    for nodeid in named:
        file, *names = nodeid.split("::")
        module = modules.get(prefix + file)
        if module is not None and not _has(module, names):
            raise pytest.UsageError(f"tests/upstream/conftest.py names {nodeid!r}, which its module no longer has")

    def deselected(item: pytest.Item) -> bool:
        nodeid = item.nodeid.removeprefix(prefix)
        file, _, test = nodeid.partition("::")
        if file in manager_tests and test.partition("[")[0] not in manager_tests[file]:
            return True
        return deselecting() and nodeid in NOT_FOR_A_WRAPPER

    keep, drop = [], []
    for item in items:
        (drop if deselected(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not wrapping() or _RELEASE_DIR is None:
        return
    count = config.stash.get(_observed_key, Counter())
    managers = ", ".join(f"{count[name]} {name}" for name in WRAPPED_CLASSES.values())
    terminalreporter.write_line(
        f"kvobs upstream ({_RELEASE_DIR}, wrapped): {count['tests']} of {count['ran']} tests ran with observed"
        f" managers ({managers})")
    if deselecting():
        for nodeid, reason in NOT_FOR_A_WRAPPER.items():
            terminalreporter.write_line(f"  not run wrapped: {nodeid}: {reason}")


MIN_RUN_TO_EXPECT_A_WRAP = 10
"""A wrapped run of this many vendored tests that observed no manager fails (a few picked by -k may
construct none)."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A wrapped run that wrapped nothing proves nothing (say, a rename the stand-ins missed).
    totals = session.config.stash.get(_observed_key, Counter())
    if (wrapping() and totals["ran"] >= MIN_RUN_TO_EXPECT_A_WRAP and not totals["tests"]
            and exitstatus == pytest.ExitCode.OK):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"{WRAP_VAR}=1 but no test constructed a manager kvobs wrapped", red=True)
