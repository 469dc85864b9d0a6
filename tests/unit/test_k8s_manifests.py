"""docker/k8s/: every manifest is a valid Kubernetes object, checked offline.

Core kinds (Deployment, Service, ConfigMap) against the OpenAPI schemas kubernetes-validate ships
(strict: unknown fields fail); the Prometheus Operator's custom resources (PrometheusRule, PodMonitor),
whose schemas it does not ship, by their shape here. Then what the manifests promise: the
PrometheusRule holds exactly the groups of dashboards/rules/*.yaml and the dashboard ConfigMap exactly
dashboards/*.json (docker/k8s/render.py writes both), the kvobs emptyDir holds what kvobs may write
(kvobs.journal.disk_bound of the manifest's own kvobs options and DP size), the pod passes Pod
Security "restricted", and vLLM has probes and resource requests.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvobs.journal import disk_bound
from kvobs.options import parse_options

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
KUBERNETES = "1.31.0"  # the Kubernetes release whose schemas the manifests are checked against
MONITORING = "monitoring.coreos.com/v1"
SPEC_KEYS = ("inner_spec", "inner_spec_module_path")  # kvobs keys of the spec itself, not Options (kvobs/vllm/spec.py)


def documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object of docker/k8s/ (prometheus-scrape.yaml is a Prometheus config, not one)."""
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None and "apiVersion" in doc:
                yield path, doc


def the(kind: str) -> dict[str, Any]:
    (found,) = [doc for _, doc in documents() if doc["kind"] == kind]
    return found


def pod_spec() -> dict[str, Any]:
    return dict(the("Deployment")["spec"]["template"]["spec"])


def container(name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec()["containers"] if c["name"] == name]
    return dict(found)


def option_after(args: list[str], flag: str, default: str | None = None) -> str:
    if flag not in args:
        assert default is not None, f"{flag} missing"
        return default
    return args[args.index(flag) + 1]


def quantity_bytes(text: str) -> int:
    """A Kubernetes quantity of bytes ("512Mi", "1G", "1073741824")."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", text)
    assert match is not None, text
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9,
             "T": 10**12}
    return int(match[1]) * scale[match[2]]


def test_the_objects_are_there() -> None:
    kinds = sorted(doc["kind"] for _, doc in documents())
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodMonitor", "PrometheusRule", "Service"]


@pytest.mark.parametrize("doc", [d for _, d in documents() if d["apiVersion"] != MONITORING],
                         ids=lambda d: d["kind"])
def test_core_objects_validate_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises ValidationError


def test_the_schema_check_is_real_and_offline() -> None:
    """The validator rejects what the API server would (so the test above can fail), from its own files."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{KUBERNETES}-local-strict"
    assert (schemas / "deployment-apps-v1.json").is_file()
    broken = copy.deepcopy(the("Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)
    wrong_type = copy.deepcopy(the("Service"))
    wrong_type["spec"]["ports"][0]["port"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, KUBERNETES, strict=True)


DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")
RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
RELABEL_KEYS = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}


def test_prometheus_rule_has_the_operators_shape() -> None:
    rule = the("PrometheusRule")
    assert rule["apiVersion"] == MONITORING and set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", rule["metadata"]["name"])
    assert set(rule["spec"]) == {"groups"}
    names = [group["name"] for group in rule["spec"]["groups"]]
    assert len(names) == len(set(names)) >= 2
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules", "partial_response_strategy", "limit"}
        assert group["rules"]
        for entry in group["rules"]:
            assert set(entry) <= RULE_KEYS, entry
            assert ("alert" in entry) != ("record" in entry) and isinstance(entry["expr"], str) and entry["expr"]
            if "for" in entry:
                assert "alert" in entry and DURATION.fullmatch(entry["for"])
            for key in ("labels", "annotations"):
                assert all(isinstance(v, str) for v in entry.get(key, {}).values()), entry


def test_pod_monitor_has_the_operators_shape_and_scrapes_the_pods_ports() -> None:
    monitor = the("PodMonitor")
    assert monitor["apiVersion"] == MONITORING
    deployment = the("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for c in pod_spec()["containers"] for p in c.get("ports", [])}
    jobs = {}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings", "metricRelabelings",
                                 "honorLabels", "scheme"}
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics" and DURATION.fullmatch(endpoint["interval"])
        for relabel in endpoint["relabelings"]:
            assert set(relabel) <= RELABEL_KEYS, relabel
        targets = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        # model_name and engine come from the sidecar and vLLM; no scrape-time model label any more.
        assert not {"model", "model_name", "engine"} & set(targets)
        assert targets["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
        jobs[targets["job"]["replacement"]] = endpoint["port"]
    # The sidecar only (issue 20): scraping vLLM is the operator's; a second scrape would duplicate vllm:*.
    assert jobs == {"kvobs": "kvobs-metrics"}


@pytest.mark.parametrize("kind", ["PodMonitor", "PrometheusRule"])
def test_kube_prometheus_stack_selects_the_custom_resources(kind: str) -> None:
    """Its Prometheus selects PodMonitors and PrometheusRules by release=<Helm release> unless told otherwise."""
    labels = the(kind)["metadata"]["labels"]
    assert labels["release"] == "kube-prometheus-stack"
    text = (K8S / ("podmonitor.yaml" if kind == "PodMonitor" else "render.py")).read_text()
    assert "release" in text and "change" in text.lower()  # the file says the label is to be adapted


def rule_groups() -> list[dict[str, Any]]:
    return [group for path in sorted((ROOT / "dashboards" / "rules").glob("*.yaml"))
            for group in yaml.safe_load(path.read_text())["groups"]]


def test_prometheus_rule_holds_exactly_the_rules_of_dashboards_rules() -> None:
    groups = the("PrometheusRule")["spec"]["groups"]
    assert groups == rule_groups(), "docker/k8s/prometheusrule.yaml is stale: run python docker/k8s/render.py"
    assert {"kvobs.alerts", "kvobs.recording"} == {g["name"] for g in groups}


def test_dashboard_config_map_holds_exactly_the_dashboards() -> None:
    config_map = the("ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboards = sorted((ROOT / "dashboards").glob("*.json"))
    assert sorted(config_map["data"]) == [p.name for p in dashboards]
    for path in dashboards:
        assert json.loads(config_map["data"][path.name]) == json.loads(path.read_text()), (
            f"{path.name} in docker/k8s/grafana-dashboard.yaml is stale: run python docker/k8s/render.py")
    # A ConfigMap holds at most 1 MiB; client-side kubectl apply also stores it in an annotation (256 KiB).
    assert len((K8S / "grafana-dashboard.yaml").read_bytes()) < 256 * 1024


def test_render_writes_the_files_as_committed() -> None:
    spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    for path, write in render.OUTPUTS.items():
        assert write() == path.read_text(), f"{path.name} is stale: run python docker/k8s/render.py"


def kvobs_config() -> tuple[dict[str, Any], int]:
    """The kvobs options of the vllm container's --kv-transfer-config, and its data-parallel size."""
    args = container("vllm")["args"]
    transfer = json.loads(option_after(args, "--kv-transfer-config"))
    raw = transfer["kv_connector_extra_config"]["kvobs"]
    dp = int(option_after(args, "--data-parallel-size", "1"))
    return {k: v for k, v in raw.items() if k not in SPEC_KEYS}, dp


def test_kvobs_directory_holds_what_kvobs_may_write() -> None:
    raw, dp = kvobs_config()
    options = parse_options(raw)
    # The manifest sets the journal bounds itself (smaller than the defaults), rather than relying on them.
    assert {"journal_bytes", "journal_processes", "max_reports"} <= set(raw)
    assert options.journal_bytes < parse_options({}).journal_bytes
    needed = disk_bound(options, engines=dp)
    kvobs_dir = next(e["value"] for e in container("vllm")["env"] if e["name"] == "KVOBS_DIR")
    volume = {m["mountPath"]: m["name"] for m in container("vllm")["volumeMounts"]}[kvobs_dir]
    (spec,) = [v for v in pod_spec()["volumes"] if v["name"] == volume]
    limit = quantity_bytes(spec["emptyDir"]["sizeLimit"])
    assert limit >= needed, f"sizeLimit {limit} < disk_bound {needed} for {dp} engines"
    assert limit < 4 * needed  # sized from the bound, not a blanket guess
    gpus = int(container("vllm")["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= dp >= 2  # one engine per GPU; two engines, so the bound counts engines


def test_pod_passes_pod_security_restricted() -> None:
    """The checks of the "restricted" Pod Security Standard (kubernetes.io/docs/concepts/security/
    pod-security-standards) that a pod spec can fail, for every container."""
    pod = pod_spec()
    pod_ctx = pod.get("securityContext", {})
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for volume in pod["volumes"]:
        assert set(volume) - {"name"} <= allowed_volumes, volume
    for c in pod["containers"] + pod.get("initContainers", []):
        ctx = c.get("securityContext", {})
        where = c["name"]
        assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, where
        assert ctx.get("runAsUser", pod_ctx.get("runAsUser")) != 0, where
        assert ctx.get("allowPrivilegeEscalation") is False, where
        assert not ctx.get("privileged"), where
        assert ctx["capabilities"]["drop"] == ["ALL"], where
        assert set(ctx["capabilities"].get("add", [])) <= {"NET_BIND_SERVICE"}, where
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile"))
        assert seccomp is not None and seccomp["type"] in ("RuntimeDefault", "Localhost"), where
        assert not any("hostPort" in p for p in c.get("ports", [])), where
    sidecar = container("kvobs")["securityContext"]  # the sidecar states each on its own
    assert sidecar["runAsNonRoot"] and sidecar["seccompProfile"]["type"] == "RuntimeDefault"
    assert sidecar["readOnlyRootFilesystem"]


def test_vllm_has_health_probes_and_resource_requests() -> None:
    vllm = container("vllm")
    port_names = {p["name"] for p in vllm["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = vllm[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in port_names, probe  # vLLM's health endpoint
    requests = vllm["resources"]["requests"]
    assert {"cpu", "memory", "nvidia.com/gpu"} <= set(requests)
    assert quantity_bytes(requests["memory"]) >= 2**30
    sidecar = container("kvobs")
    assert sidecar["resources"]["requests"]


def test_the_sidecar_never_takes_vllm_out_of_its_service() -> None:
    """Issue 20: a pod is Ready only when every container is, so the sidecar has no readiness probe, and
    no startup probe either (a container with one is not ready until it passes: it would hold the vLLM
    pod NotReady); its liveness probe reads /livez (the HTTP server answers, from the bind), never
    /healthz (503 on a slow ingest), and the manifest says why."""
    sidecar = container("kvobs")
    assert "readinessProbe" not in sidecar and "startupProbe" not in sidecar
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "kvobs-metrics"}
    text = (K8S / "vllm-kvobs.yaml").read_text()
    assert "No readiness probe, on purpose" in text and "out of its Service" in text
    assert "No startup probe either" in text


def test_the_network_policy_lets_vllm_serve_and_only_prometheus_reach_the_sidecar() -> None:
    policy = the("NetworkPolicy")
    pod_labels = the("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    by_port = {port["port"]: rule.get("from") for rule in policy["spec"]["ingress"] for port in rule["ports"]}
    assert set(by_port) == {"http", "kvobs-metrics"}  # container port names of the pod
    assert by_port["http"] is None  # vLLM's API from anywhere: the policy must not cut the engine's traffic
    (source,) = by_port["kvobs-metrics"]
    assert source["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    assert "namespaceSelector" in source


def test_images_carry_the_package_version_and_make_image_builds_both() -> None:
    """Issue 20: no :latest; the plugin's and the sidecar's image carry one tag, the kvobs version, which is
    what `make image` builds (printed with make -n: no Docker engine here)."""
    import subprocess

    from kvobs import __version__

    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    images = [c["image"] for c in pod_spec()["containers"]] + [compose[s]["image"] for s in ("vllm", "kvobs")]
    assert sorted(images) == sorted(["kvobs/vllm-openai:" + __version__, "kvobs/sidecar:" + __version__] * 2), images
    made = subprocess.run(["make", "-n", "image", "REGISTRY=registry.example.com/you"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    builds = [line for line in made.stdout.replace("\\\n", " ").splitlines() if line.startswith("docker build")]
    assert len(builds) == 2, made.stdout
    assert {b.split("-f ")[1].split()[0] for b in builds} == {"docker/Dockerfile", "docker/vllm.Dockerfile"}
    tags = {b.split("-t ")[1].split()[0] for b in builds}
    registry = "registry.example.com/you"
    assert tags == {f"{registry}/sidecar:{__version__}", f"{registry}/vllm-openai:{__version__}"}
