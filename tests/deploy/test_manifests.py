"""deploy/: the Kubernetes manifests (kubernetes-validate, strict, against the Kubernetes API
schema; the Prometheus Operator's kinds are checked here against the pod they watch),
yamllint on every YAML file, and the PrometheusRule kept equal to the plain rules file.

``python tests/deploy/test_manifests.py --write-prometheusrule`` regenerates
deploy/kubernetes/prometheusrule.yaml from deploy/prometheus/kvdepot-rules.yml and
kvdepot-vllm-rules.yml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
RULES = DEPLOY / "prometheus" / "kvdepot-rules.yml"
VLLM_RULES = DEPLOY / "prometheus" / "kvdepot-vllm-rules.yml"  # alerts on the connector's series in vLLM's /metrics
PROMETHEUSRULE = K8S / "prometheusrule.yaml"
OPERATOR_KINDS = {"PodMonitor", "PrometheusRule"}  # CRDs: no schema in kubernetes-validate


def _tool(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        if os.environ.get("KVDEPOT_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{name} is not installed")
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    return exe


def prometheusrule_text() -> str:
    """The PrometheusRule: kvdepot-rules.yml's groups, then kvdepot-vllm-rules.yml's, comments
    and all, under ``spec``."""
    text = RULES.read_text()
    body = text[text.index("\ngroups:") + 1:]
    more = VLLM_RULES.read_text()
    body = body.rstrip("\n") + "\n\n" + more[more.index("\ngroups:\n") + len("\ngroups:\n"):]
    return ("# The rules of deploy/prometheus/kvdepot-rules.yml and kvdepot-vllm-rules.yml as a\n"
            "# Prometheus Operator PrometheusRule.\n"
            "# Generated: edit the rules file, then run\n"
            "#   python tests/deploy/test_manifests.py --write-prometheusrule\n"
            "---\napiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\nmetadata:\n  name: kvdepot\n"
            "  labels:\n    app.kubernetes.io/name: vllm-kvdepot\nspec:\n"
            + "".join(f"  {line}" if line.strip() else line for line in body.splitlines(keepends=True)))


def manifests() -> list[dict]:
    return [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_yamllint_clean():
    exe = _tool("yamllint")
    r = subprocess.run([exe, "--strict", "-c", str(ROOT / ".yamllint.yaml"), str(DEPLOY)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kubernetes_validate_strict():
    exe = _tool("kubernetes-validate")
    files = sorted(str(f) for f in K8S.glob("*.yaml"))
    r = subprocess.run([exe, "--strict", *files], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "deployment/vllm-kvdepot" in out and "passed" in out, out
    for line in out.splitlines():  # a warning is only ever the Operator's kinds lacking a schema
        if line.startswith("WARN"):
            assert any(f"kind {k} " in line for k in OPERATOR_KINDS), line


def test_pod_shape():
    """What CUDA IPC and the daemon's socket need, as README.md in deploy/kubernetes says."""
    (dep,) = [d for d in manifests() if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    (side,) = [c for c in pod["initContainers"] if c["name"] == "kvdepot"]
    assert side["restartPolicy"] == "Always"  # a native sidecar: up before vLLM, down after
    (vllm,) = pod["containers"]
    mounts = lambda c: {v["name"]: v["mountPath"] for v in c["volumeMounts"]}  # noqa: E731
    for c in (side, vllm):
        assert mounts(c)["kvdepot-socket"] == "/run/kvdepot" and mounts(c)["dshm"] == "/dev/shm", c["name"]
        assert c.get("securityContext", {}).get("runAsUser") in (None, pod["securityContext"]["runAsUser"])
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory" and "kvdepot-socket" in vols
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user
    assert "nvidia.com/gpu" in vllm["resources"]["limits"] and "nvidia.com/gpu" not in side["resources"]["limits"]
    assert {e["name"]: e["value"] for e in side["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert side["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert side["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # memory sized from --l1-bytes (plus headroom)
    args = side["args"]
    l1 = args[args.index("--l1-bytes") + 1]
    assert l1.endswith("g")
    limit = side["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) >= int(l1[:-1]) + 1
    # the connector reaches the daemon's socket in the shared volume
    kv = next(a for a in vllm["args"] if a.startswith("--kv-transfer-config="))
    assert "ipc:///run/kvdepot/kvdepot.sock" in kv and '"kvdepot.client.vllm"' in kv


def test_podmonitor_selects_the_pod_and_its_ports():
    (dep,) = [d for d in manifests() if d["kind"] == "Deployment"]
    (pm,) = [d for d in manifests() if d["kind"] == "PodMonitor"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spec = dep["spec"]["template"]["spec"]
    sidecar_ports = {p["name"] for c in spec["initContainers"] for p in c.get("ports", [])}
    vllm_ports = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
    daemon, vllm = pm["spec"]["podMetricsEndpoints"]  # the daemon's metrics; vLLM's (with vllm:kvdepot_*)
    assert daemon["port"] in sidecar_ports and daemon["path"] == "/metrics"
    assert vllm["port"] in vllm_ports and vllm["path"] == "/metrics"
    # the same renaming of vllm_kvdepot_* back to vllm:kvdepot_* as the example scrape config's
    # (prometheus_client 0.26 and a Prometheus 2.x scrape; tests/vllm/test_grafana_vllm_dashboard.py)
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in scrape["scrape_configs"] if j["job_name"] == "vllm"]
    (want,) = job["metric_relabel_configs"]
    (got,) = vllm["metricRelabelings"]
    assert (got["sourceLabels"], got["regex"], got["targetLabel"], got["replacement"]) == \
        (want["source_labels"], want["regex"], want["target_label"], want["replacement"])


def test_prometheusrule_matches_rules_file():
    assert PROMETHEUSRULE.read_text() == prometheusrule_text(), \
        "stale: run python tests/deploy/test_manifests.py --write-prometheusrule"
    rule = yaml.safe_load(PROMETHEUSRULE.read_text())
    assert rule["spec"]["groups"] == (yaml.safe_load(RULES.read_text())["groups"]
                                      + yaml.safe_load(VLLM_RULES.read_text())["groups"])


if __name__ == "__main__" and sys.argv[1:] == ["--write-prometheusrule"]:
    PROMETHEUSRULE.write_text(prometheusrule_text())
    print(f"wrote {PROMETHEUSRULE}")
