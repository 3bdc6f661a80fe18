"""The rendered Kubernetes pod specs run for real with ``podman kube play`` (tools/compose_e2e.sh
--kube, after the compose run built the images; podman is the engine, no cluster needed).

What it does, and why each step:

- renders ``k8s/overlays/cpu-demo`` and its trainer with kustomize, as ``kubectl apply -k``
  would, and points the images at the locally built ones (the manifests name a registry);
- plays each workload kind as shipped and records what podman does with it (podman 4.3 plays
  Pods, Deployments and PersistentVolumeClaims; a StatefulSet or a Job it refuses);
- plays what it cannot play as the Pod its controller would create, spec unchanged: Redis's
  StatefulSet as ``redis-0`` with its volume claim, the trainer's indexed Job as ``trainer-0``
  and ``trainer-1`` (their completion index annotation set, as the Job controller sets it);
- stands in for the cluster's Services and DNS: one podman network, a fixed address per pod,
  and ``hostAliases`` for the Service names the pods dial (redis, route-cache, rollout-server,
  trainer-0.trainer); the Secrets are podman secrets holding Kubernetes Secret objects;
- does what the kubelet does and podman 4.3 does not (each place says so): emptyDirs per pod,
  world-writable, in memory for medium Memory; fsGroup on the claim; ``$(VAR)`` in args and
  fieldRef to annotations; an unset secret ``optional``; containerPorts kept off the host's
  addresses;
- checks from the host: each pod's containers run as the manifest says (uid, read-only root,
  capabilities), readiness by the probes' own checks (Redis's command, gRPC health by service
  name), generation through the rollout server (examples/generate.py), and the trainer pods'
  exit status and step lines after a short run (``--steps`` lowered to TRAINER_STEPS).

Prints a table of what ran; exit status 0 when every played pod did its part.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
NETWORK = "router-replay-kube"
SUBNET = "10.89.177.0/24"
ADDRESSES = {
    "redis-0": "10.89.177.10",
    "route-cache": "10.89.177.11",
    "rollout-server": "10.89.177.12",
    "trainer-0": "10.89.177.20",
    "trainer-1": "10.89.177.21",
}
# The Service names the pods dial, and the pod behind each.
ALIASES = {
    "redis": "redis-0",
    "route-cache": "route-cache",
    "rollout-server": "rollout-server",
    "trainer-0.trainer": "trainer-0",
}
SECRETS = {"redis": "password", "route-cache-token": "token", "rollout-server-token": "token"}
STEPS = int(os.environ.get("TRAINER_STEPS", "2"))
GROUPS = int(os.environ.get("E2E_GROUPS", "4"))
PYTHON = sys.executable


def sh(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def log(message: str) -> None:
    print(f"[kube-play {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Table(list):
    """The report's rows, each logged as it comes."""

    def append(self, row: tuple[str, str]) -> None:
        super().append(row)
        log(f"{row[0]}: {row[1]}")


def render(folder: str) -> list[dict]:
    return [
        d for d in yaml.safe_load_all(sh("kubectl", "kustomize", str(ROOT / folder)).stdout) if d
    ]


def local_image(image: str) -> str:
    """The manifests' registry name -> the image compose built here."""
    name = image.rsplit("/", 1)[-1]
    if name.startswith(("redis:", "busybox:")):
        return f"docker.io/library/{name}"
    return f"docker.io/router-replay/{name}"


def prime_volume(volume: str, script: str) -> None:
    """Mount a volume once where no image has a folder, then set its mode: podman 4.3 gives a
    volume, on its first mount, the owner and mode of the image's folder at the mount point
    (root, 0755 for /dev/shm), where the kubelet makes an emptyDir world-writable and applies
    fsGroup. Later mounts keep what this sets."""
    sh(
        "podman",
        "run",
        "--rm",
        "--network",
        "none",
        "-v",
        f"{volume}:/claim",
        local_image("busybox:1.36"),
        "/bin/sh",
        "-c",
        script,
    )


def pod_template(doc: dict, pod_name: str) -> dict:
    spec = copy.deepcopy(doc["spec"]["template"]["spec"])
    for container in spec["containers"]:
        container["image"] = local_image(container["image"])
    # podman 4.3 makes an emptyDir a named volume called after the pod spec's volume name,
    # shared by every pod using that name, on disk even for medium Memory. Each pod gets its
    # own (prefixed with the pod's name), in memory where the manifest says so, world-writable
    # as the kubelet makes them (sizeLimit is not enforced: podman's tmpfs volumes take no size).
    renamed = {}
    for volume in spec.get("volumes", []):
        if "emptyDir" not in volume:
            continue
        name = renamed[volume["name"]] = f"{pod_name}-{volume['name']}"
        volume["name"] = name
        sh("podman", "volume", "rm", "-f", name, check=False)
        if volume["emptyDir"].get("medium") == "Memory":
            sh(
                "podman",
                "volume",
                "create",
                "--opt",
                "type=tmpfs",
                "--opt",
                "device=tmpfs",
                "--opt",
                "o=mode=1777",
                name,
            )
            prime_volume(name, "chmod 1777 /claim")
        else:
            sh("podman", "volume", "create", name)
            prime_volume(name, "chmod 0777 /claim")
    for container in spec["containers"]:
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])
    # podman 4.3 turns a tcpSocket liveness probe on a named port into `nc -z -v '' 0`, which
    # never passes (and the images have no nc), and restarts the container whenever it fails:
    # with the health-check loop running, Redis was killed twice within a minute and every
    # record write after that failed. The kubelet would open a TCP connection; here readiness
    # is checked from the host instead, so such a probe is left out.
    for container in spec["containers"]:
        if "tcpSocket" in container.get("livenessProbe", {}):
            del container["livenessProbe"]
    # podman 4.3 dereferences a secret volume's unset `optional` and panics (podman issue
    # 16636, fixed in 4.4): spell out what an unset field means, false.
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            volume["secret"].setdefault("optional", False)
    return spec


def on_loopback(spec: dict, pod_name: str) -> dict:
    """podman 4.3 publishes every containerPort on the host (Kubernetes publishes none): pin
    each pod's to a loopback address of its own, so that they clash neither with each other
    nor with anything of the host's."""
    host_ip = "127.0.0." + ADDRESSES[pod_name].rsplit(".", 1)[1]
    for container in spec["containers"]:
        for port in container.get("ports", []):
            port.setdefault("hostIP", host_ip)
    return spec


def with_host_aliases(spec: dict) -> dict:
    by_address: dict[str, list[str]] = {}
    for alias, pod in ALIASES.items():
        by_address.setdefault(ADDRESSES[pod], []).append(alias)
    spec["hostAliases"] = [{"ip": ip, "hostnames": names} for ip, names in by_address.items()]
    return spec


def expand_like_kubelet(spec: dict, annotations: dict) -> dict:
    """podman 4.3 neither expands ``$(VAR)`` in args nor resolves a fieldRef to the pod's
    annotations; the kubelet does both (the trainer's ``--node-rank=$(NODE_RANK)``, from the
    Job's completion index annotation). Do it here, from the manifest's own env."""
    for container in spec["containers"]:
        values = {}
        for env in container.get("env", []):
            path = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
            match = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
            if match:
                env.pop("valueFrom")
                env["value"] = annotations[match.group(1)]
            if "value" in env:
                values[env["name"]] = env["value"]

        def expand(arg: str, values: dict = values) -> str:
            return re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), arg)

        for key in ("command", "args"):
            if key in container:
                container[key] = [expand(arg) for arg in container[key]]
    return spec


def pod(name: str, spec: dict, labels: dict, annotations: dict | None = None) -> dict:
    meta = {"name": name, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def play(
    docs: list[dict], workdir: Path, name: str, address: str | None
) -> subprocess.CompletedProcess:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    args = ["podman", "kube", "play", "--network", NETWORK]
    if address:
        args += ["--ip", address]
    return sh(*args, str(path), check=False)


def make_secrets(workdir: Path) -> dict[str, Path]:
    """Podman secrets holding Kubernetes Secret objects (what a secret volume reads), and the
    same values in files for the host's clients."""
    files = {}
    for name, key in SECRETS.items():
        value = secrets.token_hex(32)
        files[name] = workdir / name
        files[name].write_text(value)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            # podman 4.3 writes a `data` value into the volume as it stands (not decoded from
            # base64) and ignores stringData: the podman secret holds the value itself.
            "data": {key: value},
        }
        sh("podman", "secret", "rm", name, check=False)
        sh("podman", "secret", "create", name, "-", input=yaml.safe_dump(secret))
    return files


def outcome(result: subprocess.CompletedProcess) -> str:
    """A play's result: its status, and podman's last error line when it failed."""
    if result.returncode == 0:
        return "played (rc 0)"
    lines = [line for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    return f"rc {result.returncode}: {lines[-1] if lines else 'no output'}"


def containers_of(pod_name: str) -> list[dict]:
    out = sh("podman", "ps", "-a", "--filter", f"pod={pod_name}", "--format", "json").stdout
    return [c for c in json.loads(out or "[]") if not c.get("IsInfra")]


def inspect(container: str) -> dict:
    return json.loads(sh("podman", "inspect", container).stdout)[0]


def wait_for(what: str, ok, limit_s: float, every_s: float = 3.0) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"{what}: not after {limit_s:.0f} s")
        time.sleep(every_s)
    return time.monotonic() - t0


def grpc_healthy(address: str, service: str) -> bool:
    result = sh(PYTHON, "-m", "routereplay.rpc.healthcheck", address, service, check=False)
    return result.returncode == 0


def describe(container: str) -> str:
    info = inspect(container)
    config, host = info["Config"], info["HostConfig"]
    mounts = sorted(m["Destination"] for m in info["Mounts"])
    check = config.get("Healthcheck") or {}
    return (
        f"user {config.get('User') or 'image default'}, read-only root "
        f"{host.get('ReadonlyRootfs')}, {len(host.get('CapDrop') or [])} capabilities dropped, "
        f"mounts {mounts}, health check {check.get('Test') or 'none'}"
    )


def teardown(workdir: Path) -> None:
    for name in [*ADDRESSES, "route-cache-pod-0", "rollout-server-pod-0"]:
        sh("podman", "pod", "rm", "-f", "-t", "5", name, check=False)
    # The claim, the pods' emptyDirs, and the volumes podman 4.3 makes for secret volumes
    # (named after the Secret); a volume a removed pod's container still held is retried.
    names = sh("podman", "volume", "ls", "--format", "{{.Name}}").stdout.split()
    ours = [
        v
        for v in names
        if v in SECRETS or v == "data-redis-0" or v.startswith(tuple(f"{p}-" for p in ADDRESSES))
    ]
    for volume in ours:
        for _ in range(5):
            if sh("podman", "volume", "rm", "-f", volume, check=False).returncode == 0:
                break
            time.sleep(2)
    sh("podman", "network", "rm", "-f", NETWORK, check=False)
    for name in SECRETS:
        sh("podman", "secret", "rm", name, check=False)


def main() -> int:
    # A stopped run still removes what it played (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = Table()
    pipeline = render("k8s/overlays/cpu-demo")
    trainer_docs = render("k8s/overlays/cpu-demo/trainer")
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in pipeline + trainer_docs}
    configmaps = [d for d in pipeline if d["kind"] == "ConfigMap"]
    workdir = Path(tempfile.mkdtemp(prefix="kube-play."))
    teardown(workdir)
    sh("podman", "network", "create", "--subnet", SUBNET, NETWORK)
    files = make_secrets(workdir)
    failed = False
    try:
        # The kinds as shipped: which does podman play?
        for kind, name in [("StatefulSet", "redis"), ("Job", "trainer")]:
            doc = copy.deepcopy(by_kind[(kind, name)])
            result = play([doc], workdir, f"as-shipped-{name}", None)
            made = sh("podman", "pod", "ps", "--format", "{{.Name}}").stdout.split()
            note = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
            rows.append(
                (
                    f"{kind} {name} as shipped",
                    f"rc {result.returncode}, pods {made or 'none'}: {note}",
                )
            )

        # Redis: the StatefulSet's pod and its claim.
        sts = by_kind[("StatefulSet", "redis")]
        spec = on_loopback(with_host_aliases(pod_template(sts, "redis-0")), "redis-0")
        claim = sts["spec"]["volumeClaimTemplates"][0]
        spec["volumes"].append(
            {
                "name": claim["metadata"]["name"],
                "persistentVolumeClaim": {"claimName": "data-redis-0"},
            }
        )
        pvc = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data-redis-0"},
            "spec": claim["spec"],
        }
        spec["hostname"], spec["subdomain"] = "redis-0", sts["spec"]["serviceName"]
        result = play([pvc], workdir, "data-redis-0", None)
        rows.append(("PersistentVolumeClaim data-redis-0", outcome(result)))
        # podman 4.3 ignores the pod's fsGroup, and its first mount copies the image's /data,
        # owner and all, into the volume: Redis (uid 10999) could not write there. Do what
        # the kubelet does for fsGroup (group, setgid, group-writable) before Redis starts.
        fs_group = spec["securityContext"]["fsGroup"]
        prime_volume("data-redis-0", f"chgrp {fs_group} /claim && chmod 2775 /claim")
        result = play(
            [pod("redis-0", spec, sts["spec"]["template"]["metadata"]["labels"])],
            workdir,
            "redis-0",
            ADDRESSES["redis-0"],
        )
        rows.append(
            (
                "StatefulSet redis -> Pod redis-0",
                outcome(result),
            )
        )

        # The route cache and the rollout server: their Deployments as shipped (with the
        # Services' names as host aliases, the images local).
        for name in ("route-cache", "rollout-server"):
            deployment = copy.deepcopy(by_kind[("Deployment", name)])
            deployment["spec"]["template"]["spec"] = on_loopback(
                with_host_aliases(pod_template(deployment, name)), name
            )
            deployment["spec"]["replicas"] = 1
            result = play([*configmaps, deployment], workdir, name, ADDRESSES[name])
            rows.append((f"Deployment {name}", outcome(result)))

        redis = containers_of("redis-0")
        if not redis:
            raise RuntimeError("redis-0 has no container")

        def redis_ok() -> bool:
            ping = sh(
                "podman",
                "exec",
                redis[0]["Names"][0],
                "sh",
                "-c",
                'REDISCLI_AUTH="$(cat /etc/redis-auth/password)" redis-cli ping',
                check=False,
            )
            return "PONG" in ping.stdout

        rows.append(
            (
                "redis-0 ready (readiness probe's command)",
                f"{wait_for('redis', redis_ok, 120):.0f} s",
            )
        )
        rows.append(("redis-0 container", describe(redis[0]["Names"][0])))
        cache = f"{ADDRESSES['route-cache']}:50051"
        waited = wait_for(
            "route cache", lambda: grpc_healthy(cache, "routereplay.v1.RouteCache"), 180
        )
        rows.append(("route-cache ready (gRPC routereplay.v1.RouteCache)", f"{waited:.0f} s"))
        rows.append(
            ("route-cache container", describe(containers_of("route-cache-pod-0")[0]["Names"][0]))
        )
        rollout = f"{ADDRESSES['rollout-server']}:50052"
        waited = wait_for(
            "rollout server", lambda: grpc_healthy(rollout, "routereplay.v1.Rollout"), 900, 5
        )
        rows.append(("rollout-server ready (gRPC routereplay.v1.Rollout)", f"{waited:.0f} s"))
        rows.append(
            (
                "rollout-server container",
                describe(containers_of("rollout-server-pod-0")[0]["Names"][0]),
            )
        )

        # Samples for the trainer, through the documented client.
        stored = 0
        for g in range(GROUPS):
            out = sh(
                PYTHON,
                str(ROOT / "examples/generate.py"),
                "--target",
                rollout,
                "--n",
                "4",
                "--token-file",
                str(files["rollout-server-token"]),
                f"Group {g}: a haiku",
            ).stdout
            stored += sum(" done (" in line and "stored=True" in line for line in out.splitlines())
        rows.append(("generate (examples/generate.py)", f"{stored} samples stored"))

        # The trainer's indexed Job as the two pods its controller would create.
        job = by_kind[("Job", "trainer")]
        for index in range(job["spec"]["completions"]):
            pod_name = f"trainer-{index}"
            spec = on_loopback(with_host_aliases(pod_template(job, pod_name)), pod_name)
            annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
            spec = expand_like_kubelet(spec, annotations)
            spec["hostname"] = f"trainer-{index}"
            args = spec["containers"][0]["args"]
            args[args.index("--steps") + 1] = str(STEPS)
            labels = job["spec"]["template"]["metadata"]["labels"]
            result = play(
                [pod(f"trainer-{index}", spec, labels, annotations)],
                workdir,
                f"trainer-{index}",
                ADDRESSES[f"trainer-{index}"],
            )
            rows.append(
                (
                    f"Job trainer -> Pod trainer-{index}",
                    outcome(result),
                )
            )

        def trainers_done() -> bool:
            states = [c["State"] for p in ("trainer-0", "trainer-1") for c in containers_of(p)]
            return bool(states) and all(s == "exited" for s in states)

        waited = wait_for("trainer pods", trainers_done, 1200, 5)
        for p in ("trainer-0", "trainer-1"):
            container = containers_of(p)[0]["Names"][0]
            code = inspect(container)["State"]["ExitCode"]
            failed |= code != 0
            rows.append(
                (f"{p} exit status", f"{code} after {waited:.0f} s ({describe(container)})")
            )
            logs = sh("podman", "logs", container, check=False)
            steps = [
                ln
                for ln in (logs.stdout + logs.stderr).splitlines()
                if "step " in ln and "reward" in ln
            ]
            if p == "trainer-0":  # rank 0 reports the steps
                rows.append((f"{p} steps", " | ".join(line[:60] for line in steps) or "none"))
            if code != 0:
                print((logs.stdout + logs.stderr)[-4000:])
    except Exception as exc:  # report what ran, then the failure
        failed = True
        rows.append(("FAILED", str(exc)[-600:]))
        for p in ADDRESSES | {"route-cache-pod-0": 0, "rollout-server-pod-0": 0}:
            for c in containers_of(p):
                logs = sh("podman", "logs", "--tail", "30", c["Names"][0], check=False)
                print(
                    f"----- {c['Names'][0]} ({c['State']})\n{(logs.stdout + logs.stderr)[-3000:]}"
                )
    finally:
        if os.environ.get("KEEP") != "1":
            teardown(workdir)
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("KUBE PLAY " + ("FAIL" if failed else "PASS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
