"""The Kubernetes base (``k8s/base``), its overlays (``k8s/overlays/cpu-demo``,
``k8s/overlays/gpu``) and its policies, checked offline: rendered by kustomize (``kubectl
kustomize``, with its default load restrictions), every object validated by
``kubernetes-validate --strict``, and what each overlay promises read back from the render. A
broken overlay is shown to fail both checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
BASE = K8S / "base"
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
OVERLAYS = ("cpu-demo", "gpu")
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


@pytest.mark.parametrize("overlay", OVERLAYS)
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


@pytest.mark.parametrize("overlay", [None, *OVERLAYS])
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
    "file, old, new",
    [
        # A misspelt field: kustomize merges it, strict validation refuses it.
        ("overlays/gpu/gpus.yaml", "tolerations:", "toleration:"),
        # A base or a component that is not there: kustomize refuses it.
        ("overlays/cpu-demo/kustomization.yaml", "../../base", "../../bases"),
        ("base/kustomization.yaml", "../policies", "../policy"),
    ],
)
def test_a_broken_overlay_fails(file, old, new, tmp_path):
    if not VALIDATE.exists():
        pytest.skip("kubernetes-validate is not installed")
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    text = (copy / file).read_text()
    assert old in text
    (copy / file).write_text(text.replace(old, new, 1))
    folder = copy / Path(file).parent
    if render(folder).returncode == 0:
        assert validate(folder, tmp_path).returncode != 0
    assert validate(K8S / Path(file).parent, tmp_path).returncode == 0  # the original passes
