"""deploy/: the Kubernetes manifests validate against the Kubernetes API schemas (offline, strict: an unknown
field fails), the Gateway API Inference Extension example points at what the manifests run, and the image's
health check and dependency list work on a real server and the real pyproject.toml."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from server.cli import REPO_ROOT

K8S = REPO_ROOT / "deploy" / "kubernetes"
DOCKER = REPO_ROOT / "deploy" / "docker"
# The oldest Kubernetes release the manifests must load on (apps/v1, startup probes, sizeLimit).
K8S_VERSION = "1.30"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _core_manifests() -> list[dict]:
    return _docs(K8S / "xpulora.yaml")


def _deployment() -> dict:
    (dep,) = [d for d in _core_manifests() if d["kind"] == "Deployment"]
    return dep


@pytest.mark.parametrize("version", [K8S_VERSION, kubernetes_validate.latest_version()])
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    kinds = []
    for doc in _core_manifests():
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Deployment", "PersistentVolumeClaim", "PersistentVolumeClaim", "Service"]


def test_the_validator_rejects_a_wrong_manifest() -> None:
    """The check above can fail: a misspelt probe field and a string replica count are caught."""
    dep = _deployment()
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(dep))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_deployment_runs_the_image_as_a_user_would() -> None:
    from server.cli import build_parser

    dep = _deployment()
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    assert "command" not in c  # the image's entrypoint (`xpulora serve`) stays
    argv = ["serve", *c["args"]]
    a = build_parser(argv).parse_args(argv)
    assert a.enable_lora and a.lora_root == ["/adapters"] and a.port == 8000
    assert c["ports"] == [{"name": "http", "containerPort": 8000}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    res = c["resources"]
    gpu = [k for k in res["limits"] if k.startswith("gpu.intel.com/")]
    assert gpu and res["requests"][gpu[0]] == res["limits"][gpu[0]]  # extended resources: request == limit
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001  # the image's user
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/adapters"]["readOnly"] and mounts["/models"]["readOnly"]
    (svc,) = [d for d in _core_manifests() if d["kind"] == "Service"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_inference_gateway_example_targets_the_deployment() -> None:
    values = yaml.safe_load((K8S / "inference-gateway" / "values.yaml").read_text())
    pool = values["inferencePool"]
    dep = _deployment()
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pool["modelServers"]["matchLabels"].items() <= labels.items()
    assert pool["targetPortNumber"] == dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert pool["modelServerType"] == "vllm"  # the EPP's vLLM metric names, which /metrics exports
    (route,) = _docs(K8S / "inference-gateway" / "httproute.yaml")
    # HTTPRoute is a CRD: the validator has no schema for it, so its shape is checked here.
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "HTTPRoute"
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "xpulora"}
    readme = (K8S / "README.md").read_text()
    for metric in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"):
        assert metric in readme and metric in (K8S / "inference-gateway" / "values.yaml").read_text(), metric
    assert "helm install xpulora " in readme  # the release name the HTTPRoute names


# -- deploy/docker ---------------------------------------------------------------------------------------------
def test_requirements_script_lists_runtime_and_extras() -> None:
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    run = lambda extras: subprocess.run(
        [sys.executable, str(DOCKER / "requirements.py"), str(REPO_ROOT / "pyproject.toml"), extras],
        capture_output=True, text=True, timeout=60)
    out = run("").stdout.splitlines()
    assert out == [*project["build-system"]["requires"], *project["project"]["dependencies"]]
    out = run("xpu,quantize").stdout.splitlines()
    assert out[-2:] == [*project["project"]["optional-dependencies"]["xpu"],
                        *project["project"]["optional-dependencies"]["quantize"]]
    bad = run("nope")
    assert bad.returncode != 0 and "no extra 'nope'" in bad.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthcheck():  # deploy/docker/healthcheck.py, imported as the image runs it (a script, not a package)
    sys.path.insert(0, str(DOCKER))
    try:
        import healthcheck
    finally:
        sys.path.pop(0)
    return healthcheck


def test_healthcheck_reads_the_port_as_the_server_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The health check's light reading of --port / --config (no torch import) agrees with the server's parser."""
    from server.cli import build_parser

    hc = _healthcheck()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text("port: 9100\nmax-num-seqs: 4\n")
    (tmp_path / "q.yaml").write_text("max-num-seqs: 4\n")
    cases = [[], ["--port", "9000"], ["--port=9001", "--max-num-seqs", "4"], ["/models/m", "--config", "p.yaml"],
             ["--config", "p.yaml", "--port", "9002"], ["--config=q.yaml"], ["--host", "127.0.0.1", "/m"]]
    for flags in cases:
        args = ["serve", *flags]
        assert hc.server_port(args) == build_parser(args).parse_args(args).port, flags


@pytest.mark.parametrize("bind", ["0.0.0.0", "127.0.0.1"])
def test_healthcheck_finds_the_server_and_fails_on_loopback_only(bind: str, tmp_path: Path) -> None:
    """A real `python -m server.cli_main serve` (the demo) with its port given by flag: the health check finds it among
    the processes, takes the port from its command line, and is healthy when the server listens on every
    interface, unhealthy when it listens on the loopback only (the check probes the non-loopback address)."""
    hc = _healthcheck()
    if hc.external_address().startswith("127."):
        pytest.skip("this machine has no non-loopback address")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "server.cli_main", "serve", "--host", bind, "--port", str(port)],
                              env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, "the server exited"
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(1)
        # Other servers may run on a shared test machine; in a container ours is the only one (the first).
        args = dict(hc.serve_commands())[server.pid]
        assert args == ["serve", "--host", bind, "--port", str(port)]
        url = hc.health_url(args)
        assert url == f"http://{hc.external_address()}:{port}/health"
        if bind == "0.0.0.0":
            assert hc.probe(url) == f"{url}: 200"
        else:
            with pytest.raises(OSError):
                hc.probe(url)
    finally:
        server.terminate()
        server.wait(timeout=60)
