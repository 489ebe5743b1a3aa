"""The Kubernetes manifests of deploy/kubernetes: valid for a pinned Kubernetes version, offline
(kubernetes-validate, strict: unknown fields fail), and consistent with torchfeed itself (the
worker's arguments parse, the probes use the metrics port, the Service, NetworkPolicy, PDB and
trainer agree on labels, the HPA's metric is one torchfeed exports, the placeholder secret is refused).
Hardened too: every container confined, images pinned by digest, NetworkPolicies around the trainer
and on the workers' egress, and the docs never put the secret on a command line.
"""

from __future__ import annotations

import re
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


# -- hardening ---------------------------------------------------------------------------------
WORKLOAD_KINDS = {"Pod", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"}
DIGEST = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


def _pods() -> dict[str, dict]:
    """Every pod template of every workload (kind/name: the template: metadata and spec)."""
    out = {}
    for (kind, name), doc in _objects().items():
        if kind not in WORKLOAD_KINDS:
            continue
        spec = doc["spec"]
        if kind == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        out[f"{kind}/{name}"] = doc if kind == "Pod" else spec["template"]
    return out


def _containers():
    """(where, pod template, container) for every container and init container."""
    for where, pod in _pods().items():
        for field in ("initContainers", "containers", "ephemeralContainers"):
            for c in pod["spec"].get(field, []):
                yield f"{where}/{c['name']}", pod, c


def test_every_container_is_hardened():
    """Seccomp RuntimeDefault, no privilege escalation, a read-only root, every capability dropped."""
    problems, seen = [], 0
    for where, pod, c in _containers():
        seen += 1
        ctx = c.get("securityContext", {})
        seccomp = ctx.get("seccompProfile") or pod["spec"].get("securityContext", {}).get("seccompProfile")
        if (seccomp or {}).get("type") != "RuntimeDefault":
            problems.append(f"{where}: seccompProfile {seccomp} (RuntimeDefault expected)")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        if ctx.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: readOnlyRootFilesystem is not true")
        if "ALL" not in ctx.get("capabilities", {}).get("drop", []):
            problems.append(f"{where}: capabilities do not drop ALL")
        if ctx.get("privileged") or ctx.get("capabilities", {}).get("add"):
            problems.append(f"{where}: privileged or capabilities added")
    assert seen >= 4, "the workers' and the trainer's containers are expected"
    assert not problems, "\n".join(problems)


def test_the_trainer_has_writable_scratch_space():
    """Its root is read-only: /tmp (compile caches, HOME) and /dev/shm are emptyDirs."""
    pod = _objects()[("Job", "train")]["spec"]["template"]
    trainer = pod["spec"]["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for path in ("/tmp", "/dev/shm"):
        assert path in mounts and "emptyDir" in volumes[mounts[path]], path
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env.get("HOME", "").startswith("/tmp"), "~/.cache and ~/.triton must be writable"


def test_every_image_is_pinned_by_digest():
    images = [(where, c["image"]) for where, _, c in _containers()]
    assert images
    unpinned = [f"{where}: {image}" for where, image in images if not DIGEST.match(image)]
    assert not unpinned, "images must be pinned by digest (NAME[:TAG]@sha256:HEX):\n" + "\n".join(unpinned)


# -- network policies ----------------------------------------------------------------------------
def _selects(selector: dict, labels: dict) -> bool:
    assert not selector.get("matchExpressions"), "only matchLabels are checked here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _policies_for(labels: dict) -> list[dict]:
    return [
        doc["spec"]
        for (kind, _), doc in _objects().items()
        if kind == "NetworkPolicy" and _selects(doc["spec"]["podSelector"], labels)
    ]


def _ports(rule: dict) -> set[tuple[object, str]]:
    return {(p.get("port"), p.get("protocol", "TCP")) for p in rule.get("ports", [])}


def _allows_dns(policy: dict) -> bool:
    """An egress rule to kube-dns in kube-system on UDP and TCP 53 (and nothing broader)."""
    for rule in policy.get("egress", []):
        peers = rule.get("to", [])
        if peers and {(53, "UDP"), (53, "TCP")} <= _ports(rule):
            if all(
                _selects(p.get("namespaceSelector", {}), {"kubernetes.io/metadata.name": "kube-system"})
                and p.get("podSelector", {}).get("matchLabels") == {"k8s-app": "kube-dns"}
                for p in peers
            ):
                return True
    return False


def _egress_is_closed(policy: dict) -> list[str]:
    """Rules that would open egress to anything: no peers, an empty selector, 0.0.0.0/0."""
    wide = []
    for rule in policy.get("egress", []):
        peers = rule.get("to")
        if not peers:
            wide.append(f"a rule without peers: {rule}")
        for peer in peers or []:
            if "ipBlock" in peer and peer["ipBlock"]["cidr"] in ("0.0.0.0/0", "::/0"):
                wide.append(f"every address: {peer}")
            if "namespaceSelector" in peer and not peer["namespaceSelector"] and "podSelector" not in peer:
                wide.append(f"every namespace: {peer}")
    return wide


def test_a_network_policy_confines_the_trainer():
    objs = _objects()
    pod = objs[("Job", "train")]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    metrics = next(p for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    workers = objs[("Deployment", "torchfeed-workers")]["spec"]["template"]["metadata"]["labels"]
    data_port = 6543

    policies = _policies_for(labels)
    inbound = [p for p in policies if "Ingress" in p.get("policyTypes", [])]
    outbound = [p for p in policies if "Egress" in p.get("policyTypes", [])]
    assert inbound, "no NetworkPolicy restricts what reaches the trainer"
    assert outbound, "no NetworkPolicy restricts where the trainer connects"
    for policy in inbound:  # in: the metrics port only, from Prometheus's pods only
        for rule in policy.get("ingress", []):
            assert _ports(rule) == {(metrics["containerPort"], "TCP")}, rule
            assert rule.get("from"), f"open to every pod: {rule}"
            for peer in rule["from"]:
                assert peer.get("podSelector", {}).get("matchLabels"), f"any pod of a namespace: {peer}"
                assert peer.get("namespaceSelector", {}).get("matchLabels"), f"any namespace: {peer}"
    for policy in outbound:
        assert not _egress_is_closed(policy), _egress_is_closed(policy)
    assert any(_allows_dns(p) for p in outbound), "the trainer must resolve the workers' name"
    assert any(
        (data_port, "TCP") in _ports(rule)
        and any(_selects(peer.get("podSelector", {}), workers) for peer in rule["to"])
        for p in outbound
        for rule in p.get("egress", [])
    ), "the trainer must reach the workers' data port"


def test_a_network_policy_confines_the_workers_egress():
    objs = _objects()
    labels = objs[("Deployment", "torchfeed-workers")]["spec"]["template"]["metadata"]["labels"]
    outbound = [p for p in _policies_for(labels) if "Egress" in p.get("policyTypes", [])]
    assert outbound, "no NetworkPolicy restricts where the workers (your dataset code) connect"
    for policy in outbound:
        assert not _egress_is_closed(policy), _egress_is_closed(policy)
    assert any(_allows_dns(p) for p in outbound), "the workers must resolve names"
    assert any(  # the sample cache's lanes: workers dial each other
        any(_selects(peer.get("podSelector", {}), labels) for peer in rule.get("to", []))
        for p in outbound
        for rule in p.get("egress", [])
    ), "workers must reach each other's lanes"


def test_prometheus_is_selected_alike():
    """The workers' and the trainer's metrics ports admit the same, documented, Prometheus pods."""
    objs = _objects()
    peers = []
    for name, port in (("torchfeed-workers", 9090), ("torchfeed-trainer", 9100)):
        rules = [r for r in objs[("NetworkPolicy", name)]["spec"]["ingress"] if (port, "TCP") in _ports(r)]
        assert len(rules) == 1, name
        peers.append(rules[0]["from"])
    assert peers[0] == peers[1]
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for peer in peers[0]:
        for selector in (peer["namespaceSelector"], peer["podSelector"]):
            for key, value in selector["matchLabels"].items():
                assert key in docs and value in docs, f"{key}: {value} is not documented"


# -- the secret and the images in the docs --------------------------------------------------------
def test_the_docs_never_put_the_secret_on_a_command_line():
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for path in [ROOT / "docs" / "kubernetes.md", *MANIFESTS]:
        assert "--from-literal" not in path.read_text(), f"{path.name}: the secret on a command line"
    assert "--from-file=secret=" in docs and "umask 077" in docs and "shred" in docs
    assert "@sha256:" in docs and "digest" in docs  # replace the placeholder digest, and why
