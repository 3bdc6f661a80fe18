"""The Kubernetes base (``k8s/base``), its overlays (``k8s/overlays/cpu-demo``,
``k8s/overlays/gpu``, ``k8s/overlays/redis-cluster``), the trainer's runs (``k8s/trainer`` and
each overlay's ``trainer``), its policies, the image setting (``k8s/components/images``) and
the Redis Cluster component (``k8s/components/redis-cluster``), checked offline: rendered by
kustomize (``kubectl kustomize``, with its default load restrictions), every object validated by
``kubernetes-validate --strict``, and what each overlay promises read back from the render. A
broken overlay is shown to fail both checks. The cluster's start command, configuration and
create Job run for real against local ``redis-server`` processes, and the route cache runs with
the manifest's settings against the cluster they made."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import redis

from routereplay.dev.launch import free_ports

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
BASE = K8S / "base"
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
OVERLAYS = ("cpu-demo", "gpu")
CLUSTER = K8S / "overlays" / "redis-cluster"
COMPONENT = K8S / "components" / "redis-cluster"
NAME = "app.kubernetes.io/name"
# Each pipeline (None: the base) and the kustomization of its training run.
PIPELINES = (None, *OVERLAYS, "redis-cluster")
RUNS = {
    None: K8S / "trainer",
    "cpu-demo": K8S / "overlays" / "cpu-demo" / "trainer",
    "gpu": K8S / "overlays" / "gpu" / "trainer",
    "redis-cluster": K8S / "trainer",
}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def render(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True)


def objects(folder: Path) -> dict[tuple[str, str], dict]:
    result = render(folder)
    assert result.returncode == 0, result.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}


def pipeline(overlay: str | None) -> Path:
    return K8S / "overlays" / overlay if overlay else BASE


def with_run(overlay: str | None) -> dict[tuple[str, str], dict]:
    """A pipeline's objects and its training run's, as both applies leave them."""
    return objects(pipeline(overlay)) | objects(RUNS[overlay])


def validate(folder: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    result = render(folder)
    assert result.returncode == 0, result.stderr
    rendered = tmp_path / f"{folder.name}.yaml"
    rendered.write_text(result.stdout)
    return subprocess.run(
        [str(VALIDATE), "--strict", str(rendered)], capture_output=True, text=True
    )


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def container(obj: dict) -> dict:
    (only,) = pod_spec(obj)["containers"]
    return only


def pod_labels(rendered: dict) -> dict[str, dict]:
    """Each workload's pod labels, by its app name."""
    return {
        obj["spec"]["template"]["metadata"]["labels"][NAME]: obj["spec"]["template"]["metadata"][
            "labels"
        ]
        for (kind, _), obj in rendered.items()
        if kind in ("Deployment", "StatefulSet", "Job")
    }


def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and In expressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.parametrize(
    "folder",
    [
        "overlays/cpu-demo",
        "overlays/gpu",
        "overlays/redis-cluster",
        "trainer",
        "overlays/cpu-demo/trainer",
        "overlays/gpu/trainer",
    ],
)
def test_overlay_renders_and_validates_strictly(folder, tmp_path):
    if not VALIDATE.exists():
        pytest.skip("kubernetes-validate is not installed")
    result = validate(K8S / folder, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_the_base_plus_patches(overlay):
    """Same objects as the base (none lost, none added): the base folder is its only resource."""
    mine = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    assert mine["resources"] == ["../../base"]
    # The base brings the policies; an overlay's components only choose images.
    images = {"../../components/gpu-images", "../../components/images"}
    assert set(mine.get("components", [])) <= images
    assert objects(K8S / "overlays" / overlay).keys() == objects(BASE).keys()


def test_only_clients_reach_the_route_cache_and_only_it_reaches_redis():
    """Also: the rollout servers take calls from anywhere on their gRPC port only, and the
    trainer's ranks only from each other (on any port: collectives pick theirs)."""
    rendered = with_run(None)
    labels = pod_labels(rendered)
    policies = [obj for (kind, _), obj in rendered.items() if kind == "NetworkPolicy"]
    (serving,) = [
        p for p in policies if selects(p["spec"]["podSelector"], labels["rollout-server"])
    ]
    assert serving["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 50052}]}]
    (ranks,) = [p for p in policies if selects(p["spec"]["podSelector"], labels["trainer"])]
    (rule,) = ranks["spec"]["ingress"]
    assert "ports" not in rule
    assert {
        app
        for app, pod in labels.items()
        for peer in rule["from"]
        if selects(peer["podSelector"], pod)
    } == {"trainer"}
    for target, allowed, port in (
        ("route-cache", {"rollout-server", "trainer"}, 50051),
        ("redis", {"route-cache"}, 6379),
    ):
        (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], labels[target])]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        (rule,) = policy["spec"]["ingress"]
        sources = {
            app
            for app, pod in labels.items()
            for peer in rule["from"]
            if selects(peer["podSelector"], pod)
        }
        assert sources == allowed, target
        assert [p["port"] for p in rule["ports"]] == [port]
        # The port is the one the target's container serves.
        workload = next(
            o
            for o in rendered.values()
            if o["kind"] != "Service"
            and o.get("spec", {})
            .get("template", {})
            .get("metadata", {})
            .get("labels", {})
            .get(NAME)
            == target
        )
        assert port in [p["containerPort"] for p in container(workload)["ports"]]


@pytest.mark.parametrize("overlay", [None, *OVERLAYS, "redis-cluster"])
def test_route_cache_scales_and_keeps_a_replica_through_drains(overlay):
    """The autoscaler alone owns the route cache's replica count (a count in the Deployment
    would reset it on every apply); the disruption budgets of the route cache and of the
    rollout servers let drains evict one pod at a time."""
    rendered = objects(K8S / "overlays" / overlay if overlay else BASE)
    deployment = rendered[("Deployment", "route-cache")]
    hpa = rendered[("HorizontalPodAutoscaler", "route-cache")]
    pdb = rendered[("PodDisruptionBudget", "route-cache")]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "route-cache")
    spec = hpa["spec"]
    assert "replicas" not in deployment["spec"]
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    assert "cpu" in container(deployment)["resources"]["requests"]  # utilisation needs it
    assert selects(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    # A budget that allows no eviction at the fewest replicas would block drains.
    replicas = spec["minReplicas"]
    allowed = pdb["spec"].get("maxUnavailable", replicas - pdb["spec"].get("minAvailable", 0))
    assert allowed >= 1
    servers = rendered[("Deployment", "rollout-server")]
    budget = rendered[("PodDisruptionBudget", "rollout-server")]
    assert selects(budget["spec"]["selector"], servers["spec"]["template"]["metadata"]["labels"])
    assert budget["spec"]["maxUnavailable"] == 1


def test_cpu_demo_is_one_small_replica_each():
    rendered = with_run("cpu-demo")
    base = with_run(None)
    assert rendered[("Deployment", "rollout-server")]["spec"]["replicas"] == 1
    assert rendered[("HorizontalPodAutoscaler", "route-cache")]["spec"]["minReplicas"] == 1
    for key, obj in rendered.items():
        if key[0] in ("Deployment", "Job"):
            image = container(obj)["image"]
            assert image.endswith(":0.1.0") and "-gpu" not in image, image
            assert "nvidia.com/gpu" not in container(obj)["resources"].get("limits", {})
            mem = container(obj)["resources"]["limits"]["memory"]
            assert _gib(mem) < _gib(container(base[key])["resources"]["limits"]["memory"])


def test_gpu_overlay_gives_each_rollout_server_and_trainer_rank_a_gpu():
    rendered = with_run("gpu")
    for key in (("Deployment", "rollout-server"), ("Job", "trainer")):
        obj = rendered[key]
        c = container(obj)
        assert c["image"].split(":")[0].endswith("-gpu"), c["image"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "1"
        tolerations = pod_spec(obj)["tolerations"]
        assert {
            "key": "nvidia.com/gpu",
            "operator": "Exists",
            "effect": "NoSchedule",
        } in tolerations
    # One rank per pod in the base, so one GPU per pod is every rank's GPU.
    assert "--nproc-per-node=1" in container(rendered[("Job", "trainer")])["args"]
    assert container(rendered[("Deployment", "route-cache")])["image"].endswith(":0.1.0")
    assert rendered[("Deployment", "rollout-server")]["spec"]["replicas"] > 1


def _gib(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1.0}
    return float(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.parametrize(
    "file, old, new, folder",
    [
        # A misspelt field: kustomize merges it, strict validation refuses it.
        ("overlays/gpu/gpus.yaml", "tolerations:", "toleration:", None),
        (
            "components/redis-cluster/redis-cluster.yaml",
            "readOnlyRootFilesystem",
            "readOnlyRootFileSystem",
            "overlays/redis-cluster",
        ),
        # A base or a component that is not there: kustomize refuses it.
        ("overlays/cpu-demo/kustomization.yaml", "../../base", "../../bases", None),
        ("base/kustomization.yaml", "../policies", "../policy", None),
        (
            "overlays/redis-cluster/kustomization.yaml",
            "- ../../components/redis-cluster",
            "- ../../components/redis-clusters",
            None,
        ),
    ],
)
def test_a_broken_overlay_fails(file, old, new, folder, tmp_path):
    if not VALIDATE.exists():
        pytest.skip("kubernetes-validate is not installed")
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    text = (copy / file).read_text()
    assert old in text
    (copy / file).write_text(text.replace(old, new, 1))
    folder = folder or str(Path(file).parent)
    if render(copy / folder).returncode == 0:
        assert validate(copy / folder, tmp_path).returncode != 0
    assert validate(K8S / folder, tmp_path).returncode == 0  # the original passes


def cluster_parts(rendered: dict) -> tuple[dict, dict, dict]:
    """The Redis Cluster's StatefulSet, its headless Service and its create Job."""
    (nodes,) = [o for (kind, _), o in rendered.items() if kind == "StatefulSet"]
    return (
        nodes,
        rendered[("Service", nodes["spec"]["serviceName"])],
        rendered[("Job", "redis-cluster-create")],
    )


@pytest.mark.parametrize("overlay", [None, *OVERLAYS])
def test_redis_cluster_component_goes_on_any_overlay(overlay, tmp_path):
    """The component on the base or on another overlay: that overlay's objects, the single
    Redis swapped for the cluster's (its Secret kept), and the render validates strictly."""
    if not VALIDATE.exists():
        pytest.skip("kubernetes-validate is not installed")
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    mine = copy / "overlays" / "with-cluster"
    mine.mkdir()
    under = f"../{overlay}" if overlay else "../../base"
    mine.joinpath("kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{under}]\ncomponents: [../../components/redis-cluster]\n"
    )
    result = validate(mine, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    before = objects(K8S / "overlays" / overlay if overlay else BASE)
    after = objects(mine)
    gone = {("StatefulSet", "redis"), ("Service", "redis")}
    added = {
        ("ConfigMap", "redis-cluster"),
        ("Service", "redis-cluster"),
        ("StatefulSet", "redis-cluster"),
        ("PodDisruptionBudget", "redis-cluster"),
        ("Job", "redis-cluster-create"),
        ("NetworkPolicy", "redis-cluster-create"),
    }
    assert after.keys() == (before.keys() - gone) | added
    assert not [key for key in after if key[0] == "Secret"]  # the existing one is used
    # The overlay's own changes survive (replicas, images).
    for key in (("Deployment", "route-cache"), ("Deployment", "rollout-server")):
        assert container(after[key])["image"] == container(before[key])["image"]
        assert after[key]["spec"].get("replicas") == before[key]["spec"].get("replicas")


def test_route_cache_speaks_cluster_to_the_cluster_service():
    """No drift: the route cache's settings are ones it reads, name cluster mode and the
    headless Service's client port, wait for no more replicas than each master gets, and sign
    in with the Secret the nodes take their password from."""
    from route_cache.config import ENV_PREFIX, Config
    from tests.test_deploy import deployed_settings, env_names

    rendered = objects(CLUSTER)
    nodes, service, job = cluster_parts(rendered)
    settings = rendered[("ConfigMap", "route-cache")]["data"]
    known = env_names(Config, ENV_PREFIX)
    assert set(settings) <= known, set(settings) - known
    used = deployed_settings("\n".join(p.read_text() for p in COMPONENT.glob("*.yaml")))
    assert {"ROUTE_CACHE_REDIS_CLUSTER", "ROUTE_CACHE_WAIT_REPLICAS"} <= used <= known
    assert settings["ROUTE_CACHE_REDIS_CLUSTER"] == "true"
    url = urllib.parse.urlsplit(settings["ROUTE_CACHE_REDIS_URL"])
    assert url.hostname == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert selects(
        {"matchLabels": service["spec"]["selector"]}, pod_labels(rendered)["redis-cluster"]
    )
    (client_port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    assert client_port["targetPort"] in [p["name"] for p in container(nodes)["ports"]]
    # One replica a master (3 masters: half the nodes), and WAIT asks no more of them.
    create = container(job)["command"][-1]
    assert "--cluster-replicas 1" in create
    assert nodes["spec"]["replicas"] == 6
    assert int(settings["ROUTE_CACHE_WAIT_REPLICAS"]) == 1
    # The password: the route cache's file is mounted from the Secret the nodes read.
    cache = rendered[("Deployment", "route-cache")]
    path = Path(settings["ROUTE_CACHE_REDIS_PASSWORD_FILE"])
    (mount,) = [m for m in container(cache)["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    (volume,) = [v for v in pod_spec(cache)["volumes"] if v["name"] == mount["name"]]
    secrets = {v["secret"]["secretName"] for v in pod_spec(nodes)["volumes"] if "secret" in v}
    assert secrets == {volume["secret"]["secretName"]}
    # The Job waits for every node by its stable name.
    env = {e["name"]: e["value"] for e in container(job)["env"]}
    name, headless = nodes["metadata"]["name"], service["metadata"]["name"]
    assert env["NODES"].split() == [f"{name}-{i}.{headless}:{url.port}" for i in range(6)]


def test_only_the_route_cache_and_the_nodes_reach_redis_cluster():
    """The route cache and the create Job reach the nodes' client port; the nodes reach each
    other's client port (replication) and bus port; nothing else reaches them, and no policy is
    left selecting pods that are gone."""
    rendered = objects(CLUSTER)
    labels = pod_labels(rendered)
    nodes, _, _ = cluster_parts(rendered)
    policies = [obj for (kind, _), obj in rendered.items() if kind == "NetworkPolicy"]
    for policy in policies:
        assert any(selects(policy["spec"]["podSelector"], pod) for pod in labels.values())
    (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], labels["redis-cluster"])]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    reach = {
        (app, port["port"])
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
        for app, pod in labels.items()
        if selects(peer["podSelector"], pod)
        for port in rule["ports"]
    }
    assert reach == {
        ("route-cache", 6379),
        ("redis-cluster-create", 6379),
        ("redis-cluster", 6379),
        ("redis-cluster", 16379),
    }
    assert {p["containerPort"] for p in container(nodes)["ports"]} == {6379, 16379}


def test_redis_cluster_pods_are_locked_down_and_drain_one_at_a_time():
    rendered = objects(CLUSTER)
    nodes, _, job = cluster_parts(rendered)
    for workload in (nodes, job):
        assert pod_spec(workload)["securityContext"]["runAsNonRoot"] is True
        security = container(workload)["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        resources = container(workload)["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys()
        assert "memory" in resources["limits"]
    pdb = rendered[("PodDisruptionBudget", "redis-cluster")]
    assert selects(pdb["spec"]["selector"], nodes["spec"]["template"]["metadata"]["labels"])
    # More than one node down at once could be a master and its replica.
    assert pdb["spec"]["maxUnavailable"] == 1
    (claim,) = nodes["spec"]["volumeClaimTemplates"]
    assert "/data" in [m["mountPath"] for m in container(nodes)["volumeMounts"]]
    assert claim["metadata"]["name"] == "data"


def start_node(nodes: dict, redis_conf: str, folder: Path, password: str) -> tuple:
    """One cluster node from the StatefulSet's own start command and configuration, run with
    local folders where the pod mounts its volumes (a restart reuses them, as a pod reuses its
    volume), on free ports on loopback.

    Returns:
        (the sh process, which execs redis-server; the client port)."""
    port, bus = free_ports(2)
    # The mounts by their paths, longest first (/etc/redis-auth before /etc/redis).
    mounts = sorted(container(nodes)["volumeMounts"], key=lambda m: -len(m["mountPath"]))
    local = {m["mountPath"]: folder / m["name"] for m in mounts}
    for path in local.values():
        path.mkdir(parents=True, exist_ok=True)

    def here(text: str) -> str:
        for mount in mounts:
            text = text.replace(mount["mountPath"], str(local[mount["mountPath"]]))
        return text

    local["/etc/redis-auth"].joinpath("password").write_text(password)
    config = here(redis_conf).replace("port 6379\n", f"port {port}\n")
    config += f"cluster-port {bus}\nbind 127.0.0.1\n"  # loopback, so free ports are enough
    local["/etc/redis"].joinpath("redis.conf").write_text(config)
    sh, flag, command = container(nodes)["command"]
    with open(folder / "redis.log", "wb") as log:
        proc = subprocess.Popen([sh, flag, here(command)], stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, password=password)
    for _ in range(200):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            assert proc.poll() is None, (folder / "redis.log").read_text()
            time.sleep(0.05)
    raise AssertionError((folder / "redis.log").read_text())


def run_create_job(job: dict, ports: list[int], password_file: Path):
    script = container(job)["command"][-1]
    env = {"PATH": os.environ["PATH"], "PASSWORD_FILE": str(password_file)}
    env["NODES"] = " ".join(f"127.0.0.1:{port}" for port in ports)
    return subprocess.run(
        ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=300
    )


def cluster_roles(clients: list) -> dict[str, str]:
    """Each node's id and role, once every node sees 6 nodes, every slot served and each
    master's replica linked (replicas join a few seconds after the slots)."""
    for _ in range(600):
        infos = [c.cluster("INFO") for c in clients]
        replication = [c.info("replication") for c in clients]
        if all(i["cluster_state"] == "ok" and int(i["cluster_known_nodes"]) == 6 for i in infos):
            links = [r.get("master_link_status") for r in replication if r["role"] == "slave"]
            if len(links) == 3 and set(links) == {"up"}:
                break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the cluster did not settle: {infos} {replication}")
    assert all(int(i["cluster_slots_assigned"]) == 16384 for i in infos)
    return {
        c.execute_command("CLUSTER", "MYID"): r["role"]
        for c, r in zip(clients, replication, strict=True)
    }


def test_redis_cluster_nodes_and_job_make_a_cluster_the_route_cache_uses(tmp_path):
    """The manifests' own start command, configuration and create Job, run against real
    ``redis-server`` processes: the Job makes 3 masters with a replica each, behind the Secret's
    password (requirepass, and masterauth for the replicas' links); run again, it changes
    nothing and succeeds. Then the route cache, started with the ConfigMap's settings (local
    paths and ports in place of the pod's), writes a record that WAIT 1 saw replicated and
    reads it back. A replica restarted on a new port rejoins alone. Last, every node is killed
    and restarted on new ports with its files: the Job reconnects them, with the same roles,
    and the record reads back."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not installed")
    from route_cache.record_format import record_key
    from routereplay.dev.launch import start_service, stop_process
    from routereplay.dev.synthetic import synthetic_record
    from routereplay.rpc.client import RouteCacheClient
    from routereplay.rpc.security import ClientSecurity
    from tests.route_cache.conftest import SMALL
    from tests.route_cache.test_server import assert_same

    rendered = objects(CLUSTER)
    nodes, _, job = cluster_parts(rendered)
    redis_conf = rendered[("ConfigMap", "redis-cluster")]["data"]["redis.conf"]
    assert {"cluster-enabled yes", "appendonly yes"} <= set(redis_conf.splitlines())
    password = "p@ss-" + os.urandom(8).hex()
    started = []
    cache = None
    try:
        for i in range(nodes["spec"]["replicas"]):
            started.append(start_node(nodes, redis_conf, tmp_path / f"node-{i}", password))
        ports = [port for _, port in started]
        password_file = tmp_path / "node-0" / "auth" / "password"
        clients = [
            redis.Redis(port=port, password=password, decode_responses=True) for port in ports
        ]
        for port in ports:  # no way in without the password
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(port=port).ping()

        first = run_create_job(job, ports, password_file)
        assert first.returncode == 0, first.stdout + first.stderr
        assert "the cluster exists" not in first.stdout
        roles = cluster_roles(clients)
        assert sorted(roles.values()) == ["master"] * 3 + ["slave"] * 3
        again = run_create_job(job, ports, password_file)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "the cluster exists" in again.stdout
        assert cluster_roles(clients) == roles

        settings = dict(rendered[("ConfigMap", "route-cache")]["data"])
        token = tmp_path / "token"
        token.write_text("t-" + os.urandom(8).hex())
        settings |= {
            "ROUTE_CACHE_REDIS_PASSWORD_FILE": str(password_file),
            "ROUTE_CACHE_AUTH_TOKEN_FILE": str(token),
            "ROUTE_CACHE_METRICS_PORT": "0",  # the pod's own port; here any free one
        }
        security = ClientSecurity(token_file=str(token))
        settings["ROUTE_CACHE_REDIS_URL"] = f"redis://127.0.0.1:{ports[0]}/0"
        cache, target = start_service("route_cache", env={**os.environ, **settings}, quiet=True)
        record = synthetic_record("k8s-cluster-1", SMALL, 300, np.random.default_rng(0))
        with RouteCacheClient(target, security=security) as client:
            client.write(record)
            (got,) = client.read_batch([record.sample_id])
        assert_same(got, record)
        # Stored in the cluster, on a master and on its replica.
        key = record_key(record.sample_id)
        slot = clients[0].cluster("KEYSLOT", key)
        holders = [c for c in clients if c.cluster("COUNTKEYSINSLOT", slot) > 0]
        assert sorted(c.info("replication")["role"] for c in holders) == ["master", "slave"]
        stop_process(cache, 5)
        cache = None

        # One node restarted on a new address (a replica: no failover to wait for) rejoins by
        # itself, and the others learn its address.
        i = next(i for i, c in enumerate(clients) if c.info("replication")["role"] == "slave")
        started[i][0].kill()
        started[i][0].wait()
        started[i] = start_node(nodes, redis_conf, tmp_path / f"node-{i}", password)
        clients[i] = redis.Redis(port=started[i][1], password=password, decode_responses=True)
        assert cluster_roles(clients) == roles

        # Every node killed and restarted at once on new addresses (as pods get new IPs): the
        # Job, run again, reconnects them; the cluster and the record come back from disk.
        for proc, _ in started:
            proc.kill()
            proc.wait()
        started = [
            start_node(nodes, redis_conf, tmp_path / f"node-{i}", password)
            for i in range(len(ports))
        ]
        moved = [port for _, port in started]
        clients = [
            redis.Redis(port=port, password=password, decode_responses=True) for port in moved
        ]
        rejoin = run_create_job(job, moved, password_file)
        assert rejoin.returncode == 0, rejoin.stdout + rejoin.stderr
        assert "introducing the nodes" in rejoin.stdout
        assert cluster_roles(clients) == roles
        settings["ROUTE_CACHE_REDIS_URL"] = f"redis://127.0.0.1:{moved[0]}/0"
        cache, target = start_service("route_cache", env={**os.environ, **settings}, quiet=True)
        with RouteCacheClient(target, security=security) as client:
            (got,) = client.read_batch([record.sample_id])
        assert_same(got, record)

        # A replica that lost its volume (a new pod, an empty disk) comes back knowing only
        # itself: the Job, run again, has the others forget its old identity and attaches it
        # as a replica again; all six nodes are in the cluster, three a role.
        i = next(i for i, c in enumerate(clients) if c.info("replication")["role"] == "slave")
        started[i][0].kill()
        started[i][0].wait()
        shutil.rmtree(tmp_path / f"node-{i}" / "data")
        started[i] = start_node(nodes, redis_conf, tmp_path / f"node-{i}", password)
        clients[i] = redis.Redis(port=started[i][1], password=password, decode_responses=True)
        assert int(clients[i].cluster("INFO")["cluster_known_nodes"]) == 1
        reattach = run_create_job(job, [port for _, port in started], password_file)
        assert reattach.returncode == 0, reattach.stdout + reattach.stderr
        assert "attaching the empty node" in reattach.stdout
        assert sorted(cluster_roles(clients).values()) == ["master"] * 3 + ["slave"] * 3
        with RouteCacheClient(target, security=security) as client:
            (got,) = client.read_batch([record.sample_id])
        assert_same(got, record)
    finally:
        if cache is not None:
            stop_process(cache, 5)
        for proc, _ in started:
            proc.kill()
            proc.wait()


def workloads(rendered: dict) -> list[dict]:
    return [o for (kind, _), o in rendered.items() if kind in ("Deployment", "StatefulSet", "Job")]


@pytest.mark.parametrize("overlay", PIPELINES)
def test_an_apply_writes_no_secret_and_starts_no_training(overlay):
    """``kubectl apply -k`` of a pipeline brings no Secret (it would reset the real ones) and
    no trainer Job (it would start before prompts flow); the run's own kustomization has the
    Job, and no Secret either. The pods name only the three Secrets the guide makes."""
    rendered = objects(pipeline(overlay))
    run = objects(RUNS[overlay])
    assert [key for key in rendered if key[0] == "Secret"] == []
    assert [key for key in run if key[0] == "Secret"] == []
    assert [w for w in workloads(rendered) if w["metadata"]["name"] == "trainer"] == []
    assert [w["metadata"]["name"] for w in workloads(run)] == ["trainer"]
    named = {
        volume["secret"]["secretName"]
        for w in workloads(rendered | run)
        for volume in pod_spec(w).get("volumes", [])
        if "secret" in volume
    }
    guide = (ROOT / "docs" / "deployment.md").read_text()
    assert named == {"redis", "route-cache-token", "rollout-server-token"}
    for name in named:
        assert f"kubectl create secret generic {name} " in guide, name


def image_setting(k8s: Path = K8S) -> dict[str, str]:
    """The image setting: each short name and the image it becomes."""
    setting = yaml.safe_load((k8s / "components" / "images" / "kustomization.yaml").read_text())
    return {e["name"]: f"{e['newName']}:{e['newTag']}" for e in setting["images"]}


@pytest.mark.parametrize("overlay", PIPELINES)
def test_every_image_comes_from_the_one_image_setting(overlay, tmp_path):
    """Every container of a pipeline and of its run has an image the setting gives (the
    manifests name short names only); a registry set there moves every one of them."""
    setting = image_setting()
    rendered = with_run(overlay)
    images = [c["image"] for w in workloads(rendered) for c in pod_spec(w)["containers"]]
    assert images and set(images) <= set(setting.values()), set(images) - set(setting.values())
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    component = copy / "components" / "images" / "kustomization.yaml"
    component.write_text(component.read_text().replace("registry.example.com", "reg.internal:5000"))
    moved = objects(copy / pipeline(overlay).relative_to(K8S))
    moved |= objects(copy / RUNS[overlay].relative_to(K8S))
    ours = [
        c["image"]
        for w in workloads(moved)
        for c in pod_spec(w)["containers"]
        if "router-replay/" in c["image"]
    ]
    assert ours and all(i.startswith("reg.internal:5000/router-replay/") for i in ours), ours


@pytest.mark.parametrize("overlay", PIPELINES)
def test_every_pod_meets_the_restricted_pod_security_level(overlay):
    """Non-root with a high uid, the runtime's seccomp profile, no privilege escalation, no
    capabilities, a read-only root filesystem; no service account token mounted."""
    for w in workloads(with_run(overlay)):
        name = w["metadata"]["name"]
        pod = pod_spec(w)
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True, name
        assert security["runAsUser"] >= 10000, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        for c in pod["containers"]:
            assert c["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, name


def service_settings(rendered: dict, c: dict) -> dict[str, str]:
    """A container's environment: its own values and its ConfigMaps', secret files left out
    (they are not on this machine)."""
    settings = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    for source in c.get("envFrom", []):
        settings |= rendered[("ConfigMap", source["configMapRef"]["name"])]["data"]
    return {k: v for k, v in settings.items() if not k.endswith("_FILE")}


def pre_stop_s(c: dict) -> float:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return float(command[1])


def budget_parsers():
    from rollout_server.config import parse_config as rollout_config
    from route_cache.config import parse_config as cache_config

    return {
        "route-cache": (cache_config, "ROUTE_CACHE_GRACE_S"),
        "rollout-server": (rollout_config, "ROLLOUT_SERVER_GRACE_S"),
    }


@pytest.mark.parametrize("overlay", PIPELINES)
def test_termination_grace_exceeds_each_service_shutdown_budget(overlay):
    """The kubelet kills a pod terminationGracePeriodSeconds after it starts stopping it: more
    than the preStop pause plus the service's own shutdown budget, read from its configuration
    with the manifest's settings, so the two cannot drift apart. A longer grace set in the
    manifest alone would fail the check."""
    rendered = objects(pipeline(overlay))
    for name, (parse, grace_setting) in budget_parsers().items():
        deployment = rendered[("Deployment", name)]
        c = container(deployment)
        settings = service_settings(rendered, c)
        assert grace_setting in settings, name  # set where an operator sees it
        budget = parse([], env=settings).shutdown_budget_s
        grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert grace > pre_stop_s(c) + budget, (name, grace, budget)
        longer = parse([], env=settings | {grace_setting: str(grace)}).shutdown_budget_s
        assert not grace > pre_stop_s(c) + longer, name


def test_probes_ask_liveness_of_the_process_and_readiness_of_its_dependencies():
    """Liveness asks the health name that stays SERVING while the process lives (a Redis
    outage restarts no route cache); readiness asks the service's own name, which follows its
    dependencies; the Redis nodes are probed on their port."""
    from rollout_server.server import SERVICE_NAME as ROLLOUT
    from route_cache.server import SERVICE_NAME as ROUTE_CACHE
    from routereplay.rpc.grpc_server import LIVENESS

    rendered = objects(BASE) | objects(CLUSTER)
    for name, service in (("route-cache", ROUTE_CACHE), ("rollout-server", ROLLOUT)):
        c = container(rendered[("Deployment", name)])
        assert c["livenessProbe"]["grpc"]["service"] == LIVENESS, name
        assert c["readinessProbe"]["grpc"]["service"] == service, name
    for key in (("StatefulSet", "redis"), ("StatefulSet", "redis-cluster")):
        assert container(rendered[key])["livenessProbe"]["tcpSocket"] == {"port": "redis"}


@pytest.mark.parametrize("overlay", PIPELINES)
def test_threads_follow_the_cpu_request(overlay):
    """torch and vLLM would size their thread pools to the node's cores: OMP_NUM_THREADS comes
    from the container's CPU request, and vLLM's own core binding is off on the servers."""
    rendered = with_run(overlay)
    for key in (("Deployment", "rollout-server"), ("Job", "trainer")):
        c = container(rendered[key])
        env = {e["name"]: e for e in c["env"]}
        source = env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
        assert source == {"resource": "requests.cpu", "divisor": "1"}, key
        assert "cpu" in c["resources"]["requests"], key
    env = {
        e["name"]: e.get("value")
        for e in container(rendered[("Deployment", "rollout-server")])["env"]
    }
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ENV settings of a Dockerfile's final stage."""
    final = dockerfile.read_text().rsplit("\nFROM ", 1)[1].replace("\\\n", " ")
    return {
        k: v
        for line in re.findall(r"^ENV (.+)$", final, re.M)
        for k, v in re.findall(r"(\w+)=(\S+)", line)
    }


@pytest.mark.parametrize("overlay", [None, "gpu"])
def test_rollout_server_caches_are_on_a_writable_volume(overlay):
    """The root filesystem is read-only: every folder the server's settings name (the image's
    ENV and the manifest's env together: torch.compile, Triton, FlashInfer and vLLM caches,
    vLLM's configuration, the tiny model) lies on a volume mounted from an emptyDir."""
    rendered = objects(pipeline(overlay))
    deployment = rendered[("Deployment", "rollout-server")]
    c = container(deployment)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    dockerfile = ROOT / "rollout_server" / ("Dockerfile.gpu" if overlay == "gpu" else "Dockerfile")
    assert c["image"].endswith(":0.1.0") and ("-gpu" in c["image"]) == (overlay == "gpu")
    env = image_env(dockerfile) | {e["name"]: e["value"] for e in c["env"] if "value" in e}
    folders = {k: v for k, v in env.items() if k.endswith(("_HOME", "_DIR", "_ROOT", "_BASE"))}
    assert {
        "XDG_CACHE_HOME",
        "TRITON_HOME",
        "TORCHINDUCTOR_CACHE_DIR",
        "VLLM_CACHE_ROOT",
        "ROLLOUT_SERVER_TINY_MODEL_DIR",
    } <= folders.keys()
    scratch = {v["name"] for v in pod_spec(deployment)["volumes"] if "emptyDir" in v}
    mounts = [Path(m["mountPath"]) for m in c["volumeMounts"] if m["name"] in scratch]
    for key, folder in folders.items():
        assert any(m == Path(folder) or m in Path(folder).parents for m in mounts), key


SCRAPE = "prometheus.io/scrape"


def announced_port(annotations: dict) -> int:
    """The metrics port a scraper is pointed at by prometheus.io annotations."""
    assert annotations[SCRAPE] == "true" and annotations["prometheus.io/path"] == "/metrics"
    return int(annotations["prometheus.io/port"])


@pytest.mark.parametrize("overlay", PIPELINES)
def test_metrics_are_served_where_the_annotations_point(overlay):
    """Each service's configuration, parsed from the manifest's settings, turns its endpoint
    on at the port its pods' annotations announce and its container declares; the trainer's
    rank 0 serves on the port the trainer-metrics Service announces, and that Service selects
    the Job's pod of completion index 0 (rank 0, the lead)."""
    from trainer.__main__ import parse
    from trainer.config import load_config

    rendered = with_run(overlay)
    served = {}
    for name, (parse_service, _) in budget_parsers().items():
        deployment = rendered[("Deployment", name)]
        c = container(deployment)
        metrics = parse_service([], env=service_settings(rendered, c)).metrics
        assert metrics.metrics is True, name
        port = announced_port(deployment["spec"]["template"]["metadata"]["annotations"])
        assert port == metrics.metrics_port, name
        assert {"name": "metrics", "containerPort": port} in c["ports"], name
        served[name] = port
    job = rendered[("Job", "trainer")]
    c = container(job)
    args = parse(c["args"][c["args"].index("trainer") + 1 :])
    config = load_config(args.config, args.overrides).report
    service = rendered[("Service", "trainer-metrics")]
    (port,) = service["spec"]["ports"]
    assert config.metrics and announced_port(service["metadata"]["annotations"]) == port["port"]
    assert {"name": port["targetPort"], "containerPort": config.metrics_port} in c["ports"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector.pop("batch.kubernetes.io/job-completion-index") == "0"
    assert selects({"matchLabels": selector}, labels)
    # The ports differ: one scraper policy admits them all (k8s/components/metrics-scraping).
    assert len({*served.values(), config.metrics_port}) == 3


def with_components(tmp_path: Path, overlay: str | None, *components: str) -> Path:
    """A copy of k8s/ with an overlay of ``overlay`` (None: the base) plus ``components``."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    mine = copy / "overlays" / "with-components"
    mine.mkdir()
    under = f"../{overlay}" if overlay else "../../base"
    listed = ", ".join(f"../../components/{c}" for c in components)
    mine.joinpath("kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{under}]\ncomponents: [{listed}]\n"
    )
    return mine


@pytest.mark.parametrize("overlay", [None, *OVERLAYS, "redis-cluster"])
def test_metrics_components_go_on_any_overlay(overlay, tmp_path):
    """metrics-scraping adds one policy: the scraper's namespace, and only it, reaches the
    announced metrics ports of the route cache, the rollout servers and the trainer, and no
    other port. route-cache-custom-metrics swaps the autoscaler's CPU target for the per-pod
    metric the Prometheus adapter's rule defines, from counters the route cache exports. The
    render validates strictly and nothing else changes."""
    if not VALIDATE.exists():
        pytest.skip("kubernetes-validate is not installed")
    from route_cache.server import NAMESPACE
    from routereplay.rpc.metrics import ServiceMetrics

    mine = with_components(tmp_path, overlay, "metrics-scraping", "route-cache-custom-metrics")
    result = validate(mine, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    before = objects(pipeline(overlay))
    after = objects(mine)
    assert after.keys() == before.keys() | {("NetworkPolicy", "metrics-scrapers")}
    for key in before:
        if key != ("HorizontalPodAutoscaler", "route-cache"):
            assert after[key] == before[key], key

    policy = after[("NetworkPolicy", "metrics-scrapers")]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert list(peer) == ["namespaceSelector"]  # no pod of this namespace
    labels = pod_labels(with_run(overlay))
    announced = {
        announced_port(after[("Deployment", name)]["spec"]["template"]["metadata"]["annotations"])
        for name in ("route-cache", "rollout-server")
    } | {
        announced_port(
            objects(RUNS[overlay])[("Service", "trainer-metrics")]["metadata"]["annotations"]
        )
    }
    assert {p["port"] for p in rule["ports"]} == announced
    assert {app for app, pod in labels.items() if selects(policy["spec"]["podSelector"], pod)} == {
        "route-cache",
        "rollout-server",
        "trainer",
    }

    hpa = after[("HorizontalPodAutoscaler", "route-cache")]
    assert (
        hpa["spec"]["scaleTargetRef"]
        == before[("HorizontalPodAutoscaler", "route-cache")]["spec"]["scaleTargetRef"]
    )
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    values = K8S / "components" / "route-cache-custom-metrics" / "prometheus-adapter-values.yaml"
    (rule,) = yaml.safe_load(values.read_text())["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    exported = {
        f"{m.name}_total"
        for m in ServiceMetrics(NAMESPACE).registry.collect()
        if m.type == "counter"
    }
    queried = set(re.findall(r"\b(route_cache_\w+)\{", rule["metricsQuery"]))
    assert queried and queried <= exported, queried - exported
