"""The Kubernetes base (``k8s/base``), its overlays (``k8s/overlays/cpu-demo``,
``k8s/overlays/gpu``, ``k8s/overlays/redis-cluster``), its policies and the Redis Cluster
component (``k8s/components/redis-cluster``), checked offline: rendered by kustomize (``kubectl
kustomize``, with its default load restrictions), every object validated by
``kubernetes-validate --strict``, and what each overlay promises read back from the render. A
broken overlay is shown to fail both checks. The cluster's start command, configuration and
create Job run for real against local ``redis-server`` processes, and the route cache runs with
the manifest's settings against the cluster they made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
import redis

from routereplay.launch import free_ports

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
BASE = K8S / "base"
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
OVERLAYS = ("cpu-demo", "gpu")
CLUSTER = K8S / "overlays" / "redis-cluster"
COMPONENT = K8S / "components" / "redis-cluster"
NAME = "app.kubernetes.io/name"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def render(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True)


def objects(folder: Path) -> dict[tuple[str, str], dict]:
    result = render(folder)
    assert result.returncode == 0, result.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(result.stdout)}


def validate(folder: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    result = render(folder)
    assert result.returncode == 0, result.stderr
    rendered = tmp_path / f"{folder.name}.yaml"
    rendered.write_text(result.stdout)
    return subprocess.run([str(VALIDATE), "--strict", str(rendered)], capture_output=True,
                          text=True)  # fmt: skip


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


@pytest.mark.parametrize("overlay", [*OVERLAYS, "redis-cluster"])
def test_overlay_renders_and_validates_strictly(overlay, tmp_path):
    if not VALIDATE.exists():
        pytest.skip("kubernetes-validate is not installed")
    result = validate(K8S / "overlays" / overlay, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_the_base_plus_patches(overlay):
    """Same objects as the base (none lost, none added): the base folder is its only resource."""
    mine = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    assert mine["resources"] == ["../../base"]
    assert "components" not in mine  # the base brings the policies
    assert objects(K8S / "overlays" / overlay).keys() == objects(BASE).keys()


def test_only_clients_reach_the_route_cache_and_only_it_reaches_redis():
    rendered = objects(BASE)
    labels = pod_labels(rendered)
    policies = [obj for (kind, _), obj in rendered.items() if kind == "NetworkPolicy"]
    for target, allowed, port in (
        ("route-cache", {"rollout-server", "trainer"}, 50051),
        ("redis", {"route-cache"}, 6379),
    ):
        (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], labels[target])]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        (rule,) = policy["spec"]["ingress"]
        sources = {
            app for app, pod in labels.items() for peer in rule["from"]
            if selects(peer["podSelector"], pod)
        }  # fmt: skip
        assert sources == allowed, target
        assert [p["port"] for p in rule["ports"]] == [port]
        # The port is the one the target's container serves.
        workload = next(o for o in rendered.values() if o["kind"] != "Service"
                        and o.get("spec", {}).get("template", {}).get("metadata", {})
                        .get("labels", {}).get(NAME) == target)  # fmt: skip
        assert port in [p["containerPort"] for p in container(workload)["ports"]]


@pytest.mark.parametrize("overlay", [None, *OVERLAYS, "redis-cluster"])
def test_route_cache_scales_and_keeps_a_replica_through_drains(overlay):
    rendered = objects(K8S / "overlays" / overlay if overlay else BASE)
    deployment = rendered[("Deployment", "route-cache")]
    hpa = rendered[("HorizontalPodAutoscaler", "route-cache")]
    pdb = rendered[("PodDisruptionBudget", "route-cache")]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "route-cache")
    spec = hpa["spec"]
    assert 1 <= spec["minReplicas"] <= deployment["spec"]["replicas"] <= spec["maxReplicas"]
    assert "cpu" in container(deployment)["resources"]["requests"]  # utilisation needs it
    assert selects(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    # A budget that allows no eviction at the overlay's replica count would block drains.
    replicas = deployment["spec"]["replicas"]
    allowed = pdb["spec"].get("maxUnavailable", replicas - pdb["spec"].get("minAvailable", 0))
    assert allowed >= 1


def test_cpu_demo_is_one_small_replica_each():
    rendered = objects(K8S / "overlays" / "cpu-demo")
    base = objects(BASE)
    for name in ("route-cache", "rollout-server"):
        assert rendered[("Deployment", name)]["spec"]["replicas"] == 1
    for key, obj in rendered.items():
        if key[0] in ("Deployment", "Job"):
            image = container(obj)["image"]
            assert image.endswith(":0.1.0") and "-gpu" not in image, image
            assert "nvidia.com/gpu" not in container(obj)["resources"].get("limits", {})
            mem = container(obj)["resources"]["limits"]["memory"]
            assert _gib(mem) < _gib(container(base[key])["resources"]["limits"]["memory"])


def test_gpu_overlay_gives_each_rollout_server_and_trainer_rank_a_gpu():
    rendered = objects(K8S / "overlays" / "gpu")
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
    }
    assert after.keys() == (before.keys() - gone) | added
    assert ("Secret", "redis") in after
    # The overlay's own changes survive (replicas, images).
    for key in (("Deployment", "route-cache"), ("Deployment", "rollout-server")):
        assert container(after[key])["image"] == container(before[key])["image"]
        assert after[key]["spec"]["replicas"] == before[key]["spec"]["replicas"]


def test_route_cache_speaks_cluster_to_the_cluster_service():
    """No drift: the route cache's settings are ones it reads, name cluster mode and the
    headless Service's client port, wait for no more replicas than each master gets, and sign
    in with the Secret the nodes take their password from."""
    from route_cache.config import ENV_PREFIX, Config
    from routereplay.service_config import env_names
    from tests.test_deploy import deployed_settings

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
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


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
    from route_cache.store import record_key
    from routereplay.client import RouteCacheClient
    from routereplay.launch import start_service, stop_process
    from routereplay.security import ClientSecurity
    from routereplay.synthetic import synthetic_record
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
        clients = [redis.Redis(port=port, password=password, decode_responses=True)
                   for port in ports]  # fmt: skip
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
        started = [start_node(nodes, redis_conf, tmp_path / f"node-{i}", password)
                   for i in range(len(ports))]  # fmt: skip
        moved = [port for _, port in started]
        clients = [redis.Redis(port=port, password=password, decode_responses=True)
                   for port in moved]  # fmt: skip
        rejoin = run_create_job(job, moved, password_file)
        assert rejoin.returncode == 0, rejoin.stdout + rejoin.stderr
        assert "introducing the nodes" in rejoin.stdout
        assert cluster_roles(clients) == roles
        settings["ROUTE_CACHE_REDIS_URL"] = f"redis://127.0.0.1:{moved[0]}/0"
        cache, target = start_service("route_cache", env={**os.environ, **settings}, quiet=True)
        with RouteCacheClient(target, security=security) as client:
            (got,) = client.read_batch([record.sample_id])
        assert_same(got, record)
    finally:
        if cache is not None:
            stop_process(cache, 5)
        for proc, _ in started:
            proc.kill()
            proc.wait()
