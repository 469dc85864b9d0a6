"""docker/k8s/: a kustomize base and overlays that apply as written, every object checked offline.

The base's files (read directly, no kubectl): core kinds (Deployment, Service, ConfigMap, NetworkPolicy)
against the OpenAPI schemas kubernetes-validate ships, the Prometheus Operator's custom resources
(PodMonitor, PrometheusRule, AlertmanagerConfig) against their CRDs' schemas (tests/fixtures/k8s/crds/,
strict: unknown fields fail, as the API server's strict field validation does). Then what the manifests
promise: the generated files are what docker/k8s/render.py writes (the rules of dashboards/rules/, the
dashboards of dashboards/, the inhibit rules of docker/alertmanager/alertmanager.yml, the sidecar patch
of the production-stack post-renderer), the kvobs emptyDir holds what kvobs may write, the pod passes Pod
Security "restricted", no service account token, images on the placeholder registry at the kvobs version.
With kubectl (marker tools: `kubectl kustomize` builds offline): each overlay builds and validates, the
production-stack overlay selects exactly the engine pods of production-stack's chart
(tests/fixtures/k8s/production-stack/pod-labels.yaml), its post-renderer adds the sidecar to them, and the
overlays' commented knobs work once uncommented.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvobs import __version__
from kvobs.journal import disk_bound
from kvobs.options import parse_options

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
BASE = K8S / "base"
OVERLAYS = K8S / "overlays"
POST_RENDERER = OVERLAYS / "production-stack" / "helm-post-renderer"
PERSISTENT = K8S / "components" / "persistent-reports"
FIXTURES = ROOT / "tests" / "fixtures" / "k8s"
ALERTMANAGER = ROOT / "docker" / "alertmanager" / "alertmanager.yml"
KUBERNETES = "1.31.0"  # the Kubernetes release whose schemas the manifests are checked against
SPEC_KEYS = ("inner_spec", "inner_spec_module_path")  # kvobs keys of the spec itself, not Options (kvobs/vllm/spec.py)
PLACEHOLDER = "kvobs-set-your-registry.invalid"
Doc = dict[str, Any]


# --- the base, read from its files -------------------------------------------------------------------------

def base_files() -> list[Path]:
    return [BASE / name for name in yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]]


def documents() -> Iterator[tuple[Path, Doc]]:
    """Every object of the base, from the files its kustomization.yaml lists."""
    for path in base_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                yield path, doc


def the(kind: str, docs: list[Doc] | None = None) -> Doc:
    (found,) = [doc for doc in (docs if docs is not None else [d for _, d in documents()]) if doc["kind"] == kind]
    return found


def pod_spec(docs: list[Doc] | None = None) -> Doc:
    return dict(the("Deployment", docs)["spec"]["template"]["spec"])


def container(name: str, docs: list[Doc] | None = None) -> Doc:
    (found,) = [c for c in pod_spec(docs)["containers"] if c["name"] == name]
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


def render_module() -> Any:
    spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
    assert spec is not None and spec.loader is not None
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    return render


# --- schemas -------------------------------------------------------------------------------------------------

def closed(schema: Any) -> Any:
    """The CRD schema with every object that lists its properties closed to others (additionalProperties:
    false), unless it preserves unknown fields: what the API server's strict field validation rejects."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields") \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schemas() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a validator of the vendored CRD schema (tests/fixtures/k8s/README.md)."""
    validators = {}
    for path in sorted((FIXTURES / "crds").glob("*.json")):
        crd = json.loads(path.read_text())
        schema = closed(crd["openAPIV3Schema"])
        validators[(f"{crd['group']}/{crd['version']}", crd["kind"])] = jsonschema.Draft7Validator(schema)
    return validators


def validate(doc: Doc) -> None:
    """Raises unless the object is valid: a custom resource against its CRD, any other kind against
    Kubernetes' own schema; both strict."""
    key = (doc["apiVersion"], doc["kind"])
    if key in crd_schemas():
        crd_schemas()[key].validate(doc)
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                     KUBERNETES, strict=True)  # its metadata, as ObjectMeta
    else:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_objects_are_there_and_every_file_apply_reads_is_an_object() -> None:
    kinds = sorted(doc["kind"] for _, doc in documents())
    assert kinds == ["AlertmanagerConfig", "ConfigMap", "Deployment", "NetworkPolicy", "PodMonitor",
                     "PrometheusRule", "Service"]
    for path, doc in documents():
        assert {"apiVersion", "kind", "metadata"} <= set(doc), path
    # Every manifest of the base is listed (none forgotten by `apply -k`), and docker/k8s/ itself holds no
    # manifest (issue 29: `apply -f docker/k8s/` stopped at a Prometheus config fragment).
    assert sorted(BASE.glob("*.yaml")) == sorted([*base_files(), BASE / "kustomization.yaml"])
    assert not [p for p in K8S.iterdir() if p.suffix in (".yaml", ".yml", ".json")]


@pytest.mark.parametrize("doc", [d for _, d in documents()], ids=lambda d: d["kind"])
def test_every_object_validates_against_its_schema(doc: Doc) -> None:
    validate(doc)  # raises ValidationError


def test_the_schema_checks_are_real_and_offline() -> None:
    """The validators reject what the API server would (so the test above can fail), from local files."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{KUBERNETES}-local-strict"
    assert (schemas / "deployment-apps-v1.json").is_file()
    broken = copy.deepcopy(the("Deployment"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = "http"
    wrong_type = copy.deepcopy(the("Service"))
    wrong_type["spec"]["ports"][0]["port"] = "eight thousand"
    monitor = copy.deepcopy(the("PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["relabelling"] = []  # a misspelt field
    rule = copy.deepcopy(the("PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"  # not a duration
    inhibit = copy.deepcopy(the("AlertmanagerConfig"))
    inhibit["spec"]["inhibitRules"][0]["sourceMatch"][0]["matchType"] = "~="
    for bad in (broken, wrong_type, monitor, rule, inhibit):
        with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
            validate(bad)


def test_the_base_is_what_render_writes() -> None:
    """One source each: the rules, the dashboards, the inhibit rules and the sidecar patch are generated."""
    for path, write in render_module().OUTPUTS.items():
        assert write() == path.read_text(), f"{path.relative_to(ROOT)} is stale: run python docker/k8s/render.py"


def test_pod_monitor_scrapes_the_sidecar_as_the_rules_job() -> None:
    monitor = the("PodMonitor")
    pod_labels = the("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for c in pod_spec()["containers"] for p in c.get("ports", [])}
    jobs = {}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
        targets = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        # model_name and engine come from the sidecar and vLLM; no scrape-time model label any more.
        assert not {"model", "model_name", "engine"} & set(targets)
        assert targets["instance"]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
        jobs[targets["job"]["replacement"]] = endpoint["port"]
    # The sidecar only (issue 20): scraping vLLM is the operator's; a second scrape would duplicate vllm:*.
    config = ROOT / "dashboards" / "config.yaml"  # the rules' job, where the generated rules take it from
    job = yaml.safe_load(config.read_text())["job"] if config.is_file() else "kvobs"
    assert jobs == {job: "kvobs-metrics"}


@pytest.mark.parametrize("kind", ["PodMonitor", "PrometheusRule", "AlertmanagerConfig"])
def test_kube_prometheus_stack_selects_the_custom_resources(kind: str) -> None:
    """Its Prometheus selects PodMonitors and PrometheusRules by release=<Helm release> unless told otherwise;
    the overlays say how to set yours."""
    assert the(kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    for overlay in ("plain", "production-stack"):
        assert "release" in (OVERLAYS / overlay / "kustomization.yaml").read_text()


def rule_groups() -> list[Doc]:
    return [group for path in sorted((ROOT / "dashboards" / "rules").glob("*.yaml"))
            for group in yaml.safe_load(path.read_text())["groups"]]


def test_prometheus_rule_holds_exactly_the_rules_of_dashboards_rules() -> None:
    groups = the("PrometheusRule")["spec"]["groups"]
    assert groups == rule_groups(), "docker/k8s/base/prometheusrule.yaml is stale: run python docker/k8s/render.py"
    assert {"kvobs.alerts", "kvobs.recording"} <= {g["name"] for g in groups}


def test_dashboard_config_map_holds_exactly_the_dashboards() -> None:
    config_map = the("ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboards = sorted((ROOT / "dashboards").glob("*.json"))
    assert sorted(config_map["data"]) == [p.name for p in dashboards]
    for path in dashboards:
        assert json.loads(config_map["data"][path.name]) == json.loads(path.read_text()), (
            f"{path.name} in docker/k8s/base/grafana-dashboard.yaml is stale: run python docker/k8s/render.py")
    # A ConfigMap holds at most 1 MiB; client-side kubectl apply also stores it in an annotation (256 KiB).
    assert len((BASE / "grafana-dashboard.yaml").read_bytes()) < 256 * 1024
    # grafana_folder works only with the Grafana sidecar's folderAnnotation set: the docs say so.
    assert config_map["metadata"]["annotations"]["grafana_folder"]
    assert "folderAnnotation" in (K8S / "README.md").read_text()


# --- Alertmanager: inhibit rules scoped to kvobs's alerts -------------------------------------------------------

def alert_names() -> set[str]:
    return {rule["alert"] for group in rule_groups() for rule in group["rules"] if "alert" in rule}


def test_every_inhibit_rule_touches_kvobs_alerts_only() -> None:
    """Issue 29: pasted into a shared Alertmanager, an unscoped rule let any critical alert silence every
    warning lacking the equal labels. Each rule names kvobs's alerts on both sides, in alertmanager.yml and
    in the AlertmanagerConfig rendered from it."""
    ours = alert_names()
    assert {"KvobsLoadFailure", "KvobsLoadFailuresRepeated"} <= ours
    others = {"Watchdog", "KubePodCrashLooping", "TargetDown", "NodeFilesystemAlmostOutOfSpace", "kvobsLower"}
    rules = render_module().inhibit_rules()
    assert rules == the("AlertmanagerConfig")["spec"]["inhibitRules"]
    assert len(rules) == len(yaml.safe_load(ALERTMANAGER.read_text())["inhibit_rules"]) >= 2
    for rule in rules:
        for side in ("sourceMatch", "targetMatch"):
            (name,) = [m for m in rule[side] if m["name"] == "alertname"]
            assert name["matchType"] in ("=", "=~"), rule
            pattern = name["value"] if name["matchType"] == "=~" else re.escape(name["value"])
            matched = {alert for alert in ours | others if re.fullmatch(pattern, alert)}  # Alertmanager anchors
            assert matched and matched <= ours, (side, name)
    critical = next(r for r in rules if {"name": "severity", "matchType": "=", "value": "critical"} in r["sourceMatch"])
    assert critical["equal"] == ["cluster", "namespace", "instance", "model_name", "engine"]


@pytest.mark.tools
def test_alertmanager_config_passes_amtool() -> None:
    amtool = shutil.which("amtool")
    assert amtool, "amtool is missing: `make tools` installs Debian's prometheus-alertmanager (which ships it)"
    checked = subprocess.run([amtool, "check-config", str(ALERTMANAGER)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "2 inhibit rules" in checked.stdout, checked.stdout + checked.stderr


# --- the pod ---------------------------------------------------------------------------------------------------

def kvobs_config() -> tuple[Doc, int]:
    """The kvobs options of the vllm container's --kv-transfer-config, and its data-parallel size."""
    args = container("vllm")["args"]
    transfer = json.loads(option_after(args, "--kv-transfer-config"))
    raw = transfer["kv_connector_extra_config"]["kvobs"]
    dp = int(option_after(args, "--data-parallel-size", "1"))
    return {k: v for k, v in raw.items() if k not in SPEC_KEYS}, dp


def kvobs_disk_bound() -> int:
    raw, dp = kvobs_config()
    return disk_bound(parse_options(raw), engines=dp)


def test_kvobs_directory_holds_what_kvobs_may_write() -> None:
    raw, dp = kvobs_config()
    options = parse_options(raw)
    # The manifest sets the journal bounds itself (smaller than the defaults), rather than relying on them.
    assert {"journal_bytes", "journal_processes", "max_reports"} <= set(raw)
    assert options.journal_bytes < parse_options({}).journal_bytes
    needed = kvobs_disk_bound()
    kvobs_dir = next(e["value"] for e in container("vllm")["env"] if e["name"] == "KVOBS_DIR")
    volume = {m["mountPath"]: m["name"] for m in container("vllm")["volumeMounts"]}[kvobs_dir]
    (spec,) = [v for v in pod_spec()["volumes"] if v["name"] == volume]
    limit = quantity_bytes(spec["emptyDir"]["sizeLimit"])
    assert limit >= needed, f"sizeLimit {limit} < disk_bound {needed} for {dp} engines"
    assert limit < 4 * needed  # sized from the bound, not a blanket guess
    gpus = int(container("vllm")["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus >= dp >= 2  # one engine per GPU; two engines, so the bound counts engines
    (claim,) = [d for d in yaml.safe_load_all((PERSISTENT / "pvc.yaml").read_text()) if d]
    assert quantity_bytes(claim["spec"]["resources"]["requests"]["storage"]) >= needed  # the optional PVC too


def test_pod_passes_pod_security_restricted_and_has_no_token() -> None:
    """The checks of the "restricted" Pod Security Standard (kubernetes.io/docs/concepts/security/
    pod-security-standards) that a pod spec can fail, for every container; and no API token mounted."""
    pod = pod_spec()
    assert pod["automountServiceAccountToken"] is False
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
    sidecar = container("kvobs")["securityContext"]  # the sidecar states each on its own (production-stack's pods)
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
    assert container("kvobs")["resources"]["requests"]


def test_the_sidecar_never_takes_vllm_out_of_its_service() -> None:
    """Issue 20: a pod is Ready only when every container is, so the sidecar has no readiness probe, and
    no startup probe either (a container with one is not ready until it passes: it would hold the vLLM
    pod NotReady); its liveness probe reads /livez (the HTTP server answers, from the bind), never
    /healthz (503 on a slow ingest), and the manifest says why."""
    sidecar = container("kvobs")
    assert "readinessProbe" not in sidecar and "startupProbe" not in sidecar
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "kvobs-metrics"}
    text = (BASE / "vllm-kvobs.yaml").read_text()
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


def test_images_sit_on_the_placeholder_registry_at_the_package_version() -> None:
    """Issue 29: no unpublished docker.io/kvobs namespace (a pull from whoever claims it): a registry that
    never resolves (.invalid, RFC 2606) and says what to do, at the one kvobs version for the plugin and
    the sidecar (issue 20: no :latest); compose builds its own images under local names."""
    images = sorted(c["image"] for c in pod_spec()["containers"])
    assert images == [f"{PLACEHOLDER}/kvobs/sidecar:{__version__}", f"{PLACEHOLDER}/kvobs/vllm-openai:{__version__}"]
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]
    assert {compose[s]["image"] for s in ("vllm", "kvobs")} == {f"kvobs/vllm-openai:{__version__}",
                                                                 f"kvobs/sidecar:{__version__}"}


def test_make_image_builds_both_images_at_the_package_version() -> None:
    """What `make image` builds (printed with make -n: no Docker engine here)."""
    made = subprocess.run(["make", "-n", "image", "REGISTRY=registry.example.com/you"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    builds = [line for line in made.stdout.replace("\\\n", " ").splitlines() if line.startswith("docker build")]
    assert len(builds) == 2, made.stdout
    assert {b.split("-f ")[1].split()[0] for b in builds} == {"docker/Dockerfile", "docker/vllm.Dockerfile"}
    tags = {b.split("-t ")[1].split()[0] for b in builds}
    registry = "registry.example.com/you"
    assert tags == {f"{registry}/sidecar:{__version__}", f"{registry}/vllm-openai:{__version__}"}


def test_no_document_still_says_apply_dash_f() -> None:
    """The old command stopped at a non-object file; every doc gives the kustomize one."""
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "docker").rglob("*.y*ml")]
    stale = [str(p.relative_to(ROOT)) for p in texts if p.is_file() and "apply -f docker/k8s" in p.read_text()]
    assert not stale
    assert "kubectl apply -k docker/k8s/overlays/" in (ROOT / "README.md").read_text()


# --- the overlays, built by kubectl kustomize (offline) --------------------------------------------------------

class KustomizeLoader(yaml.SafeLoader):
    """YAML 1.1's loader, but a bare = (kustomize writes matchType: =) is the string "=", as in YAML 1.2."""


KustomizeLoader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def kustomize(directory: Path) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is missing (its built-in kustomize builds the overlays offline)"
    built = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.load_all(built.stdout, Loader=KustomizeLoader) if doc]


@functools.cache
def overlay(name: str) -> list[Doc]:
    return kustomize(OVERLAYS / name)


def selects(selector: Doc, labels: dict[str, str]) -> bool:
    """Kubernetes' LabelSelector semantics (matchLabels and matchExpressions)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not ok:
            return False
    return True


def production_stack_labels() -> Doc:
    return dict(yaml.safe_load((FIXTURES / "production-stack" / "pod-labels.yaml").read_text()))


@pytest.mark.tools
@pytest.mark.parametrize("name", ["plain", "production-stack"])
def test_each_overlay_builds_and_every_object_validates(name: str) -> None:
    docs = overlay(name)
    for doc in docs:
        validate(doc)
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert c["image"].startswith(f"{PLACEHOLDER}/kvobs/"), c["image"]  # fails closed until set
    kinds = sorted(doc["kind"] for doc in docs)
    common = ["AlertmanagerConfig", "ConfigMap", "NetworkPolicy", "PodMonitor", "PrometheusRule"]
    assert kinds == sorted(common + (["Deployment", "Service"] if name == "plain" else []))


@pytest.mark.tools
def test_the_plain_overlay_selects_its_own_pods() -> None:
    docs = overlay("plain")
    pod_labels = the("Deployment", docs)["spec"]["template"]["metadata"]["labels"]
    assert pod_labels == {"app.kubernetes.io/name": "vllm"}
    assert selects(the("PodMonitor", docs)["spec"]["selector"], pod_labels)
    assert selects(the("NetworkPolicy", docs)["spec"]["podSelector"], pod_labels)
    assert selects({"matchLabels": the("Service", docs)["spec"]["selector"]}, pod_labels)


def post_renderer_selector() -> Doc:
    (patch,) = yaml.safe_load((POST_RENDERER / "kustomization.yaml").read_text())["patches"]
    pairs = [term.split("=") for term in patch["target"]["labelSelector"].split(",")]
    return {"matchLabels": dict(pairs)}


@pytest.mark.tools
def test_the_production_stack_overlay_selects_the_charts_engine_pods_and_no_other() -> None:
    labels = production_stack_labels()
    docs = overlay("production-stack")
    selectors = {"PodMonitor": the("PodMonitor", docs)["spec"]["selector"],
                 "NetworkPolicy": the("NetworkPolicy", docs)["spec"]["podSelector"],
                 "post-renderer": post_renderer_selector()}
    for where, selector in selectors.items():
        assert selects(selector, labels["engine"]), where
        for other, other_labels in labels["others"].items():
            assert not selects(selector, other_labels), (where, other)
    assert len({json.dumps(s, sort_keys=True) for s in selectors.values()}) == 1  # one selector, three places
    # Every port but the sidecar's stays open (the chart's engines serve 8000, zmq 55555, ucx 9999).
    policy = the("NetworkPolicy", docs)
    (open_rule,) = [rule for rule in policy["spec"]["ingress"] if "from" not in rule]
    open_ports = [(p["port"], p.get("endPort", p["port"])) for p in open_rule["ports"]]
    for port in (8000, 55555, 9999, 30090):
        assert any(low <= port <= high for low, high in open_ports), port
    assert not any(low <= 9464 <= high for low, high in open_ports)


def chart_output() -> str:
    """Two Deployments shaped as production-stack's chart renders them: an engine (its pod labels from the
    fixture, containers named as helm/templates/deployment-vllm-multi.yaml names them) and the router."""
    labels = production_stack_labels()
    def deployment(name: str, pod_labels: dict[str, str], containers: list[Doc]) -> Doc:
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": pod_labels},
                "spec": {"selector": {"matchLabels": pod_labels},
                         "template": {"metadata": {"labels": pod_labels}, "spec": {"containers": containers}}}}
    engine = deployment("vllm-llama3-deployment-vllm", labels["engine"], [
        {"name": "vllm", "image": "registry.example.com/you/vllm-openai:" + __version__,
         "env": [{"name": "HF_HOME", "value": "/data"}],
         "ports": [{"name": "container-port", "containerPort": 8000}],
         "volumeMounts": [{"name": "vllm-storage", "mountPath": "/data"}]}])
    engine["spec"]["template"]["spec"]["volumes"] = [{"name": "vllm-storage", "emptyDir": {}}]
    router = deployment("vllm-deployment-router", labels["others"]["router"],
                        [{"name": "router-container", "image": "lmcache/lmstack-router:latest"}])
    return yaml.safe_dump_all([engine, router])


@pytest.mark.tools
def test_the_post_renderer_adds_the_sidecar_to_engine_pods_only() -> None:
    script = POST_RENDERER / "post-render.sh"
    assert os.access(script, os.X_OK)
    env = {**os.environ, "PATH": f"{Path(shutil.which('kubectl') or 'kubectl').parent}:{os.environ['PATH']}"}
    ran = subprocess.run([str(script)], input=chart_output(), capture_output=True, text=True, timeout=120, env=env,
                         cwd="/")
    assert ran.returncode == 0, ran.stderr
    docs = [doc for doc in yaml.load_all(ran.stdout, Loader=KustomizeLoader) if doc]
    by_name = {doc["metadata"]["name"]: doc for doc in docs}
    engine, router = by_name["vllm-llama3-deployment-vllm"], by_name["vllm-deployment-router"]
    pod = engine["spec"]["template"]["spec"]
    assert container("kvobs", [engine]) == container("kvobs")  # the base's sidecar, as written there
    vllm = container("vllm", [engine])
    assert {"name": "KVOBS_DIR", "value": "/var/lib/kvobs"} in vllm["env"]
    assert {"name": "HF_HOME", "value": "/data"} in vllm["env"]
    assert {m["name"] for m in vllm["volumeMounts"]} == {"kvobs", "vllm-storage"}
    assert {v["name"] for v in pod["volumes"]} == {"kvobs", "vllm-storage"}
    assert [c["name"] for c in router["spec"]["template"]["spec"]["containers"]] == ["router-container"]
    for doc in docs:
        validate(doc)
    assert (POST_RENDERER / "plugin.yaml").is_file()  # Helm 4's form of the same post-renderer


def uncommented(text: str) -> str:
    """The overlay's kustomization with its commented knobs (namespace, images, components, patches) live."""
    keys = ("namespace:", "images:", "components:", "patches:")
    lines = []
    for line in text.splitlines():
        body = line[2:] if line.startswith("# ") else None
        if body is not None and (body.startswith(keys) or body.startswith(" ")):
            line = body
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.tools
def test_the_plain_overlays_knobs_work_once_uncommented(tmp_path: Path) -> None:
    """What the overlay offers to edit (namespace, registry, persistent reports, release label, cluster
    label, Prometheus's namespace) builds and does what its comment says."""
    text = uncommented((OVERLAYS / "plain" / "kustomization.yaml").read_text())
    # The same overlay, built from a temporary directory: its ../../ (docker/k8s/) made relative to there.
    (tmp_path / "kustomization.yaml").write_text(text.replace("../../", os.path.relpath(K8S, tmp_path) + "/"))
    docs = kustomize(tmp_path)
    for doc in docs:
        validate(doc)
        assert doc["metadata"]["namespace"] == "my-models"
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            assert doc["metadata"]["labels"]["release"] == "my-prometheus-release"
    images = sorted(c["image"] for c in pod_spec(docs)["containers"])
    assert images == [f"registry.example.com/you/sidecar:{__version__}",
                      f"registry.example.com/you/vllm-openai:{__version__}"]
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    deployment = the("Deployment", docs)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"} and deployment["spec"]["replicas"] == 1
    (volume,) = [v for v in pod_spec(docs)["volumes"] if v["name"] == "kvobs"]
    assert volume == {"name": "kvobs", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}}
    relabel = the("PodMonitor", docs)["spec"]["podMetricsEndpoints"][0]["relabelings"]
    assert {"targetLabel": "cluster", "replacement": "my-cluster"} in relabel
    (source,) = the("NetworkPolicy", docs)["spec"]["ingress"][1]["from"]
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "my-monitoring"}


def test_the_kubernetes_scrape_config_without_the_operator_scrapes_what_the_pod_monitor_does() -> None:
    """The Prometheus config fragment that sat among the manifests (and stopped `apply -f`) lives in
    docker/prometheus/ now. (Debian's promtool is built without Kubernetes discovery, so it cannot check it.)"""
    fragment = ROOT / "docker" / "prometheus" / "kubernetes-scrape.yml"
    (job,) = yaml.safe_load(fragment.read_text())["scrape_configs"]
    monitor = the("PodMonitor")["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert job["job_name"] == {r["targetLabel"]: r for r in endpoint["relabelings"]}["job"]["replacement"]
    (keep,) = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keep["regex"] == f"{monitor['selector']['matchLabels']['app.kubernetes.io/name']};{endpoint['port']}"
    assert keep["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_name",
                                     "__meta_kubernetes_pod_container_port_name"]
