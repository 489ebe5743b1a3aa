"""The Kubernetes manifests of deploy/kubernetes: valid for a pinned Kubernetes version, offline
(kubernetes-validate, strict: unknown fields fail), and consistent with torchfeed itself (the
worker's arguments parse, the probes use the metrics port, the Service, NetworkPolicy, PDB and
trainer agree on labels, the HPA's metric is one torchfeed exports, the placeholder secret is refused).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from torchfeed.cli import build_parser
from torchfeed.errors import AuthenticationError
from torchfeed.protocol import auth

yaml = pytest.importorskip("yaml")

KUBERNETES_VERSION = "1.34.0"  # the oldest release the manifests must work on
ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))


def _objects() -> dict[tuple[str, str], dict]:
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(path):
    validate = pytest.importorskip("kubernetes_validate")
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            # raises ValidationError naming the field (strict: unknown fields too)
            validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_manifests_agree_with_torchfeed():
    objs = _objects()
    deploy = objs[("Deployment", "torchfeed-workers")]
    pod = deploy["spec"]["template"]
    labels = pod["metadata"]["labels"]
    worker = next(c for c in pod["spec"]["containers"] if c["name"] == "worker")

    args = build_parser().parse_args([*worker["command"][1:], *worker["args"]])
    assert args.command == "worker" and args.metrics_port == 9090 and args.port == 6543
    assert args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"data": args.port, "metrics": args.metrics_port}
    for probe in ("readinessProbe", "livenessProbe"):  # never a TCP probe on the data port
        assert worker[probe]["httpGet"]["port"] == "metrics", probe

    # the secret: a file of the worker's own user in a private directory (auth.read_secret_file)
    env = {e["name"]: e.get("value") for e in worker["env"]}
    secret_file = env[auth.ENV_SECRET_FILE]
    assert auth.ENV_SECRET not in env
    init = pod["spec"]["initContainers"][0]
    assert secret_file in init["command"][-1] and "umask 077" in init["command"][-1]
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert secret_file.startswith(mounts["run"] + "/")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["secret-source"]["secret"]["secretName"] == "torchfeed-secret"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"] == "/dev/shm"
    assert volumes["run"]["emptyDir"]["medium"] == "Memory"  # the secret never touches a disk
    res = worker["resources"]
    assert res["requests"]["cpu"] == res["limits"]["cpu"] == "1" and "memory" in res["limits"]

    service = objs[("Service", "torchfeed-workers")]
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS record per pod
    assert service["spec"]["selector"].items() <= labels.items()
    policy = objs[("NetworkPolicy", "torchfeed-workers")]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    trainer = objs[("Job", "train")]["spec"]["template"]
    admitted = [
        r for r in policy["spec"]["ingress"] if any(p.get("port") == args.port for p in r.get("ports", []))
    ]
    assert len(admitted) == 1
    selector = admitted[0]["from"][0]["podSelector"]["matchLabels"]
    assert selector.items() <= trainer["metadata"]["labels"].items(), "the trainer must be admitted"
    assert not selector.items() <= labels.items()
    pdb = objs[("PodDisruptionBudget", "torchfeed-workers")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()

    hpa = objs[("HorizontalPodAutoscaler", "torchfeed-workers")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deploy["metadata"]["name"]
    metric = hpa["spec"]["metrics"][0]["external"]
    assert metric["metric"]["name"] == "torchfeed_loader_advised_workers"
    assert metric["target"] == {"type": "AverageValue", "averageValue": "1"}

    trainer_env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
    assert trainer_env["TORCHFEED_WORKERS"] == f"dns://torchfeed-workers.ml.svc:{args.port}"
    assert trainer_env[auth.ENV_SECRET_FILE] == secret_file


def test_the_advised_workers_metric_is_exported():
    pytest.importorskip("prometheus_client")
    from torchfeed.metrics import LoaderCollector
    from torchfeed.stats import LoaderStats

    class Loader:
        def stats(self):
            return LoaderStats(0.5, 0.5, 10.0, 1, 10, 0, 1.0, 0.5)

    names = {f.name for f in LoaderCollector(Loader()).collect()}
    assert "torchfeed_loader_advised_workers" in names


def test_the_placeholder_secret_is_refused():
    placeholder = _objects()[("Secret", "torchfeed-secret")]["stringData"]["secret"]
    with pytest.raises(AuthenticationError):
        auth.load_secret(placeholder.encode())


def test_init_command_is_plain_sh():
    init = _objects()[("Deployment", "torchfeed-workers")]["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][:2] == ["sh", "-c"]
    shlex.split(init["command"][2])  # well-formed


def test_tcp_probes_on_the_data_port_are_not_failed_handshakes(capfd):
    """A kubelet's TCP probe connects and closes: silently dropped, never a failure or a block."""
    import socket

    from helpers import RangeDataset
    from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset

    with LocalWorkers(1, extra_args=["--log-level", "INFO"]) as workers:
        host, port = workers.addresses[0].rsplit(":", 1)
        for _ in range(40):  # beyond the doorman's burst of failed handshakes per source
            socket.create_connection((host, int(port)), timeout=10).close()
        loader = RemoteDataLoader(RemoteDataset(workers.addresses, RangeDataset, 20), batch_size=5)
        assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(20))
    err = capfd.readouterr().err
    assert "listening on" in err  # the worker's log is seen here
    assert "rejected client" not in err and "dropping" not in err
