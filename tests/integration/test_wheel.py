"""The wheel and sdist a user installs: built as PyPI's are, installed in a clean venv, each command run.

Real parts: ``python -m build`` (isolated, build-system.requires from the package index, as pip and PyPI
build), a new venv with the wheel installed by pip, the ``kvobs`` console script it installs, vLLM's
real offload manager (through ``kvobs doctor``), a real crash log (tests/support/crash_log.py) and a
real sidecar. The venv reuses this venv's torch and vLLM (installing them takes minutes) through a .pth
naming a folder of links to this venv's site-packages, kvobs's own files left out: the editable install
(``__editable__.kvobs-*.pth`` and its finder) never reaches the new venv, and each command asserts it
runs the wheel's kvobs.

The fast tests at the end run ``kvobs assets`` from this checkout (the editable install ``make venv``
makes): it must write what the wheel carries.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvobs import __version__, cli
from kvobs.assets import PACKAGED, select
from kvobs.hot_path_modules import C_MODULES, HOT_PATH_MODULES
from tests.support.services import ROOT, clean_env, free_port, http_get, wait_for

THIS_SITE = Path(sysconfig.get_path("purelib"))
"""This venv's site-packages: torch, vLLM and kvobs's dependencies, and kvobs installed editable."""
KVOBS_FILES = ("kvobs", "__editable__.kvobs", "__editable___kvobs")
"""The names in a site-packages that are kvobs's (package, dist-info, the editable .pth and finder)."""
NEVER_IN_THE_WHEEL = ("demo/", "benchmarks/", "docs/", "tests/", "dashboards/", "docker/")
NOT_THE_PRODUCT = ("demo", "cpu_worker", "defects", "tiny_model")
"""Names of the demo's modules (the repository's demo/ package): in no path of the wheel or the sdist's package."""
CRASH_LOG = "tests.support.crash_log"


def compiler_present() -> bool:
    """Whether this Python's C compiler exists: then the wheel must carry the compiled hot path."""
    return shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is not None


@dataclass
class Installed:
    """The built distributions and the venv the wheel is installed in."""

    wheel: Path
    sdist: Path
    venv: Path
    work: Path

    def run(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        """The venv's ``kvobs`` console script, away from the checkout (its cwd would put the repo's kvobs first)."""
        return subprocess.run([str(self.venv / "bin" / "kvobs"), *args], cwd=self.work, capture_output=True,
                              text=True, timeout=timeout, env=clean_env(**env))


def linked_site_packages(target: Path) -> Path:
    """A folder of links to every entry of this venv's site-packages but kvobs's own."""
    target.mkdir()
    for entry in THIS_SITE.iterdir():
        if not entry.name.lower().startswith(KVOBS_FILES):
            (target / entry.name).symlink_to(entry)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    dist, venv, work = base / "dist", base / "venv", base / "work"
    work.mkdir()
    started = time.monotonic()
    build = subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=work,
                           capture_output=True, text=True, timeout=300, env=clean_env())
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    built = time.monotonic()
    [wheel] = dist.glob("kvobs-*.whl")
    [sdist] = dist.glob("kvobs-*.tar.gz")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "kvobs-test-reuse.pth").write_text(f"{linked_site_packages(base / 'site')}\n")
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index",
                              str(wheel)], cwd=work, capture_output=True, text=True, timeout=120, env=clean_env())
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    print(f"build {built - started:.0f} s, venv and install {time.monotonic() - built:.0f} s")
    return Installed(wheel, sdist, venv, work)


@pytest.mark.slow
def test_the_distributions_carry_what_a_user_needs_and_nothing_else(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    stray = [n for n in names if not n.startswith(("kvobs/", f"kvobs-{__version__}.dist-info/"))]
    assert not stray and not [n for n in names if n.startswith(NEVER_IN_THE_WHEEL)], stray
    demo = [n for n in names if any(part in n.split("/")[-1] for part in NOT_THE_PRODUCT)
            or any(folder in NOT_THE_PRODUCT for folder in n.split("/")[:-1])]
    assert not demo, demo  # kvobs/demo/ and kvobs/vllm/cpu_worker.py were in it before issue 43
    assert f"kvobs-{__version__}.dist-info/licenses/LICENSE" in names
    packaged = sorted(n.removeprefix(f"kvobs/{PACKAGED}/") for n in names if n.startswith(f"kvobs/{PACKAGED}/"))
    assert packaged == select(ROOT)  # every asset the checkout has, and only those
    compiled = sorted(n.split(".")[0].removeprefix("kvobs/") for n in names if n.endswith(".so"))
    native = sorted([*HOT_PATH_MODULES, *C_MODULES, "hot_path__mypyc"])
    assert compiled == (native if compiler_present() else []), compiled
    assert not [n for n in names if n.endswith(".c")]  # built, not shipped as source (the sdist has it)
    with tarfile.open(installed.sdist) as sdist:
        top = f"kvobs-{__version__}/"
        members = {m.name.removeprefix(top) for m in sdist.getmembers()}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "setup.py", "kvobs/hot_path_modules.py",
            *(f"kvobs/{name}.py" for name in HOT_PATH_MODULES), *(f"kvobs/{name}.c" for name in C_MODULES)} <= members
    assert not [m for m in members if m.startswith(("demo/", "kvobs/demo/")) or "cpu_worker" in m]
    assert set(select(ROOT)) <= members  # a wheel built from the sdist (python -m build does) has them too


@pytest.mark.slow
def test_the_installed_kvobs_is_the_wheels(installed: Installed) -> None:
    probe = subprocess.run([str(installed.venv / "bin" / "python"), "-c",
                            "import kvobs, kvobs.hot_path_loader as h, kvobs.capture_ring as c, vllm; "
                            "print(kvobs.__file__, h.HOT_PATH, c.RING_FORM)"],
                           cwd=installed.work, capture_output=True, text=True, timeout=120, env=clean_env())
    assert probe.returncode == 0, probe.stderr[-2000:]
    where, hot_path, ring = probe.stdout.split()
    assert Path(where).is_relative_to(installed.venv), where  # not the checkout, not the editable finder
    assert hot_path == ("compiled" if compiler_present() else "python")
    assert ring == ("c" if compiler_present() else "python")


@pytest.mark.slow
def test_doctor_with_the_readmes_configuration(installed: Installed) -> None:
    run = installed.run("doctor", "--json")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert report["kvobs"]["python"].startswith(str(installed.venv)) and report["observe"]["observes"] is True
    assert report["hot_path"] == ("compiled" if compiler_present() else "python")


@pytest.mark.slow
def test_the_wheels_demo_says_where_the_demo_is(installed: Installed) -> None:
    """The wheel has no demo package: ``kvobs demo`` says it lives in the source repository, exit 2."""
    for args in (("demo",), ("demo", "--serve")):
        run = installed.run(*args)
        assert (run.returncode, run.stdout, run.stderr) == (2, "", cli.DEMO_ELSEWHERE + "\n"), run


@pytest.mark.slow
def test_serve_and_explain_a_real_crash(installed: Installed) -> None:
    """A crash of vLLM's real manager with the plugin (the checkout's kvobs writes it), read by the wheel's."""
    crash_dir, log = installed.work / "kvobs-dir", installed.work / "vllm.log"
    crash = subprocess.run([sys.executable, "-m", CRASH_LOG, "kvobs", "missing", "0", str(crash_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert crash.returncode == 0 and "AssertionError: Chunk b'" in crash.stdout, crash.stderr[-2000:]
    log.write_text(crash.stdout)

    explain = installed.run("explain", str(log), "--dir", str(crash_dir))
    assert explain.returncode == 0, explain.stderr[-2000:]
    assert "kvobs (in the log): cause evicted_after_lookup, req_id 'req-victim'" in explain.stdout
    assert "key 0000000000000000/0 end_token 48: evicted_after_lookup" in explain.stdout  # from the report

    port = free_port()
    serve = subprocess.Popen([str(installed.venv / "bin" / "kvobs"), "serve", "--dir", str(crash_dir),
                              "--host", "127.0.0.1", "--port", str(port)], cwd=installed.work,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=clean_env())
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(f"{url}/healthz")[0] == 200, what="the wheel's sidecar /healthz")
        status, _, body = http_get(f"{url}/metrics")
        metrics = body.decode()
        assert status == 200 and 'kvobs_build_info{' in metrics
        wait_for(lambda: failures_counted(url), what="the crash's failed load counted")
    finally:
        serve.send_signal(signal.SIGTERM)
        _, stderr = serve.communicate(timeout=30)
    assert serve.returncode == 0, stderr.decode()[-2000:]


def failures_counted(url: str) -> bool:
    """Whether the sidecar's /metrics counts the one failed load of the crash, with its cause."""
    lines = http_get(f"{url}/metrics")[2].decode().splitlines()
    return any(line.startswith("kvobs_load_failures_total{") and 'cause="evicted_after_lookup"' in line
               and line.endswith(" 1.0") for line in lines)


@pytest.mark.slow
def test_assets_from_the_wheel(installed: Installed) -> None:
    target = installed.work / "kvobs-assets"
    run = installed.run("assets", str(target))
    assert run.returncode == 0, run.stderr
    check_assets(target)
    again = installed.run("assets", str(target))
    assert again.returncode == 2 and "pass --force" in again.stderr and not again.stdout


def check_assets(target: Path) -> None:
    """Every asset written, each parsing as what it is; the dashboards JSON, the rules Prometheus rule groups."""
    written = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert written == select(ROOT)
    for name in written:
        text = (target / name).read_text()
        if name.endswith(".json"):
            assert json.loads(text)["panels"], name  # a Grafana dashboard
        elif name.endswith((".yaml", ".yml")):
            assert [doc for doc in yaml.safe_load_all(text) if doc is not None], name
    for rules in ("kvobs-alerts.yaml", "kvobs-recording.yaml"):
        groups = yaml.safe_load((target / "dashboards/rules" / rules).read_text())["groups"]
        assert groups and all(group["rules"] for group in groups), rules
    assert os.access(target / "docker/k8s/overlays/production-stack/helm-post-renderer/post-render.sh", os.X_OK)


def test_the_demo_missing_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    """Where no demo package is found (the wheel), ``kvobs demo`` names where it is, and runs nothing."""
    monkeypatch.setattr(cli, "_demo_package", lambda: None)
    assert cli.main(["demo", "--requests", "1"]) == 2
    out, err = capsys.readouterr()
    assert not out and err == cli.DEMO_ELSEWHERE + "\n" and "make demo" in err and "source repository" in err


def test_the_checkouts_demo_is_found_beside_its_kvobs() -> None:
    """From the checkout (kvobs installed editable, as `make venv` does) the demo is the repository's."""
    package = cli._demo_package()
    assert package is not None and Path(package.__file__ or "").resolve() == ROOT / "demo" / "__init__.py"


def test_assets_from_the_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The editable install (make venv) has no packaged copy: it writes the repository's own files."""
    target = tmp_path / "new" / "kvobs-assets"  # created, parents included
    assert cli.main(["assets", str(target)]) == 0
    assert capsys.readouterr().out.startswith(f"kvobs assets: wrote {len(select(ROOT))} files to {target}")
    check_assets(target)


def test_assets_never_overwrite_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["assets", str(tmp_path)]) == 0
    edited = tmp_path / "docker/prometheus/prometheus.yml"
    edited.write_text("# the operator's own\n")
    capsys.readouterr()
    assert cli.main(["assets", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvobs assets: {tmp_path} already holds ")
    assert err.endswith("pass --force to overwrite them\n")
    assert edited.read_text() == "# the operator's own\n"  # nothing written
    assert cli.main(["assets", "--force", str(tmp_path)]) == 0
    assert edited.read_bytes() == (ROOT / "docker/prometheus/prometheus.yml").read_bytes()


@pytest.mark.parametrize("case", ["a file", "a directory in a file's place"])
def test_assets_bad_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    if case == "a file":
        target = tmp_path / "assets.txt"
        target.write_text("")
        expected = f"kvobs assets: {target} exists and is not a directory\n"
    else:
        target = tmp_path
        (target / "dashboards/kvobs-offload.json").mkdir(parents=True)
        expected = f"kvobs assets: {target}/dashboards/kvobs-offload.json is a directory where kvobs writes a file\n"
    assert cli.main(["assets", "--force", str(target)]) == 2
    assert capsys.readouterr().err == expected
    assert not (tmp_path / "docker").exists()  # nothing written
