"""``kvobs doctor``, run as an operator runs it: a process of vLLM's Python, a ``--kv-transfer-config``.

Every case is a real ``kvobs doctor`` process of this interpreter (the installed vLLM, the repository's
kvobs), started together by one fixture (each spends most of its time importing vLLM). What they cover:
kvobs observes (CPU and tiering inner specs, text and ``--json``), an unknown kvobs option and an
unusable directory (exit 2, named), a protocol kvobs does not know (exit 1: the out-of-tree cache policy of
tests/support/changed_protocol.py, loaded by vLLM's own mechanism, as test_fail_open does), a release
newer than kvobs's tested ones (observed, said so), and a Python without vLLM (exit 1). The doctor leaves
nothing behind: no probe file, no directory it created, no secondary tier's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import kvobs
from kvobs.journal import DIR_LOST
from kvobs.versions import SUPPORTED_VLLM
from kvobs.vllm import compat
from kvobs.vllm.doctor import version_relation
from tests.support.vllm_env import BYTES_PER_CHUNK

pytestmark = pytest.mark.slow

ROOT = Path(kvobs.__file__).parents[1]


def transfer_config(connector: str = "ObservedOffloadingConnector", top: dict[str, Any] | None = None,
                    **extra: Any) -> str:
    """The ``--kv-transfer-config`` JSON of the README's form (``top``: more of vLLM's keys), ``extra`` in
    ``kv_connector_extra_config``."""
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both", **(top or {}),
                              "kv_connector_extra_config": {"spec_name": "ObservedOffloadingSpec",
                                                            "spec_module_path": "kvobs.vllm",
                                                            "cpu_bytes_to_use": 10 * 2**30, **extra}}
    if connector == "ObservedOffloadingConnector":
        config["kv_connector_module_path"] = "kvobs.vllm.connector"
    return json.dumps(config)


class Run(NamedTuple):
    status: int
    out: str
    err: str


class Case(NamedTuple):
    args: list[str]
    prelude: str = ""
    """Python run before ``kvobs.cli.main`` in the same process (a changed vLLM, as the case needs)."""
    env: dict[str, str] = {}  # noqa: RUF012 (a NamedTuple default, never mutated)


def cases(tmp: Path) -> dict[str, Case]:
    (tmp / "existing" / "journal").mkdir(parents=True)
    (tmp / "existing" / "failures").mkdir()
    (tmp / "a-file").write_text("not a directory\n")
    return {
        "cpu": Case(["--kv-transfer-config", transfer_config(top={"kv_load_failure_policy": "recompute"},
                                                             kvobs={"dir": str(tmp / "existing"), "survive": True})]),
        "tiering": Case(["--json", "--kv-transfer-config", transfer_config(
            "OffloadingConnector", kvobs={"inner_spec": "TieringOffloadingSpec"},
            secondary_tiers=[{"type": "fs", "root_dir": str(tmp / "fs-tier")}],
        )], env={"KVOBS_DIR": str(tmp / "to-be-created" / "kvobs")}),
        "unknown_option": Case(["--kv-transfer-config", transfer_config(kvobs={"histroy_size": 5})]),
        "bad_json": Case(["--kv-transfer-config", "{'kv_connector': 'ObservedOffloadingConnector'}"]),
        "unwritable_dir": Case(["--kv-transfer-config", transfer_config(kvobs={"survive": True})],
                               env={"KVOBS_DIR": str(tmp / "a-file" / "sub")}),  # fails as root too
        "changed_protocol": Case(["--json", "--kv-transfer-config", transfer_config(
            cpu_bytes_to_use=2 * BYTES_PER_CHUNK, eviction_policy="WrappedLRUPolicy",
            cache_policy_module_path="tests.support.changed_protocol",
        )]),  # tests.support: the processes run from the repository root
        "newer_vllm": Case(["--kv-transfer-config", transfer_config()],
                           prelude="import kvobs.vllm.compat as c; c.VLLM_VERSION = '99.0.0'"),
        "no_vllm": Case([], prelude="sys.modules['vllm'] = None"),  # `import vllm` fails, as without it
    }


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("doctor")


@pytest.fixture(scope="module")
def runs(tmp: Path) -> dict[str, Run]:
    """Every case's ``kvobs doctor`` process, started at once, run to its end."""
    started = {}
    for name, case in cases(tmp).items():
        env = {k: v for k, v in os.environ.items() if k not in ("KVOBS_DIR", "KVOBS_PURE_PYTHON")} | case.env
        code = f"import sys\n{case.prelude}\nfrom kvobs.cli import main\nsys.exit(main(['doctor', *sys.argv[1:]]))"
        started[name] = subprocess.Popen(  # ``-c`` puts the cwd first: the repository's kvobs, as this test's
            [sys.executable, "-c", code, *case.args], cwd=ROOT, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
    done = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=600)
        done[name] = Run(process.returncode, out, err)
    return done


def lines(run: Run) -> dict[str, str]:
    """The report's lines by topic (``topic: statement``); a case's prelude may have let vLLM log a line first."""
    return dict(line.split(": ", 1) for line in run.out.splitlines() if ": " in line and not line.startswith("INFO "))


def test_a_good_config_observes_and_leaves_the_directory_as_it_was(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["cpu"]
    assert run.status == 0, run
    said = lines(run)
    assert said["vLLM"].startswith(f"{compat.VLLM_VERSION} at ")
    tested = compat.VLLM_VERSION in SUPPORTED_VLLM
    assert ("tested (kvobs is tested on" in said["vLLM"]) is tested
    assert said["config"] == ("ObservedOffloadingConnector (kvobs's: the served model name and the trace join); "
                              "ObservedOffloadingSpec around CPUOffloadingSpec")
    assert said["options"] == f"dir={str(tmp / 'existing')!r}, survive=True; the others their defaults"
    assert said["survive"].startswith("armed at start-up")
    assert said["observes"].startswith("yes: every method and attribute kvobs reads of CPUOffloadingManager")
    assert said["hot path"] in ("compiled (mypyc)",) or said["hot path"].startswith("pure Python")
    assert said["dir"].startswith(f"{tmp / 'existing'} (option dir): writable; kvobs keeps at most 1.40 GiB")
    assert said["result"] == "kvobs will observe this engine"
    assert said["settings"] == f"vLLM {compat.VLLM_VERSION}'s own checks of CPUOffloadingSpec's settings pass"
    assert said["flight recorder"] == ("on (the default): the last 50000 to 100000 manager calls and snapshots, "
                                       "at most 32 MiB (started on CPUOffloadingManager here)")
    assert len(said) == 11
    assert sorted(str(p.relative_to(tmp)) for p in (tmp / "existing").rglob("*")) == [
        "existing/failures", "existing/journal"]  # every probe file removed


def test_json_tiering_observes_and_creates_nothing(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["tiering"]
    assert run.status == 0, run
    report = json.loads(run.out)
    assert report["exit"] == 0 and report["result"] == "kvobs will observe this engine"
    assert report["vllm"]["version"] == compat.VLLM_VERSION
    assert report["vllm"]["tested"] is (compat.VLLM_VERSION in SUPPORTED_VLLM)
    assert report["config"] == {"kv_connector": "OffloadingConnector", "spec_name": "ObservedOffloadingSpec",
                                "inner_spec": "TieringOffloadingSpec"}
    assert report["observe"] == {"observes": True, "reason": "ok", "detail": "", "manager": "TieringOffloadingManager",
                                 "knows_cpu_tier": True}
    assert report["hot_path"] in ("compiled", "python")
    created = str(tmp / "to-be-created" / "kvobs")
    assert report["dir"]["path"] == created and report["dir"]["source"] == "$KVOBS_DIR"
    assert report["dir"]["writable"] is True
    assert "problems" not in report
    assert not (tmp / "to-be-created").exists()  # the probe's directories removed again
    assert not (tmp / "fs-tier").exists()  # the configured file-system tier was never built


def test_an_unknown_option_is_the_plugins_start_up_error(runs: dict[str, Run]) -> None:
    run = runs["unknown_option"]
    assert run.status == 2, run
    said = lines(run)
    assert said["config"].startswith("unknown kvobs option 'histroy_size'; known options: history_size,")
    assert "observes" not in said
    assert said["result"] == "fix the configuration above first (exit 2)"


def test_json_that_is_not_json(runs: dict[str, Run]) -> None:
    run = runs["bad_json"]
    assert run.status == 2, run
    assert lines(run)["config"].startswith("--kv-transfer-config is not JSON: ")


def test_a_directory_that_cannot_be_created(runs: dict[str, Run], tmp: Path) -> None:
    run = runs["unwritable_dir"]
    assert run.status == 2, run
    said = lines(run)
    assert said["observes"].startswith("yes")
    assert said["survive"] == ("needs \"kv_load_failure_policy\": \"recompute\" (it is 'fail'; start-up refuses "
                               "it)")
    a_file = tmp / "a-file"
    assert said["dir"] == (f"{a_file / 'sub'} ($KVOBS_DIR): cannot be created: {a_file} is not a directory; "
                           f"the engine would log one WARNING: {DIR_LOST}")
    assert said["result"] == "fix the configuration above first (exit 2)"


def test_a_protocol_kvobs_does_not_know_makes_it_step_aside(runs: dict[str, Run]) -> None:
    run = runs["changed_protocol"]
    assert run.status == 1, run
    report = json.loads(run.out)
    assert report["observe"] == {
        "observes": False, "reason": "unsupported_vllm", "manager": "CPUOffloadingManager", "knows_cpu_tier": False,
        "detail": "cache policy WrappedLRUPolicy keeps its chunks in none of chunks, t1, t2",
    }
    [problem] = report["problems"]
    assert problem.startswith(f"observes: no: kvobs steps aside on vLLM {compat.VLLM_VERSION} (unsupported_vllm): "
                              "cache policy WrappedLRUPolicy keeps its chunks in none of chunks, t1, t2")
    assert report["result"] == "kvobs would step aside: the engine would run as without kvobs (exit 1)"


def test_a_newer_vllm_whose_protocol_matches_is_observed_and_said_untested(runs: dict[str, Run]) -> None:
    run = runs["newer_vllm"]
    assert run.status == 0, run
    said = lines(run)
    assert said["vLLM"].endswith(f": not tested (newer than {SUPPORTED_VLLM[-1]}, the newest kvobs is tested on); "
                                 "observed because its protocol matches")
    assert said["vLLM"].startswith("99.0.0 at ")


def test_without_vllm_it_says_so(runs: dict[str, Run]) -> None:
    run = runs["no_vllm"]
    assert run.status == 1, run
    said = lines(run)
    assert "kvobs's vLLM plugin does not import with" in said["vLLM"]
    assert said["vLLM"].endswith("run kvobs doctor with the Python that runs vllm serve")
    assert said["result"] == "kvobs cannot plug into an engine from this Python (exit 1)"


@pytest.mark.parametrize(("version", "relation"), [
    ("0.31.0", "tested"), ("0.33.0+cpu", "tested"), ("0.33", "tested"), ("0.32.0", "untested"),
    ("0.34.0rc1", "newer"), ("1.0.0", "newer"), ("0.29.9", "older"), ("unknown", "untested"),
])
def test_how_a_version_relates_to_the_tested_ones(version: str, relation: str) -> None:
    assert version_relation(version, ("0.30.0", "0.31.0", "0.33.0")) == relation
