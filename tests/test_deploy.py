"""The deployment files, checked offline: the real Compose binary, Kubernetes schemas in
strict mode, and hadolint on every Dockerfile. Each check is shown to fail on a broken file."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "k8s" / "base"
BIN = Path(sys.executable).parent


def compose_binary() -> Path:
    compose = pytest.importorskip("compose")
    # The package's Python wrapper always exits 0; the binary beside it is the real check.
    return Path(compose.__file__).parent / "docker-compose"


def run(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True)


def test_compose_file_is_valid(tmp_path):
    binary = compose_binary()
    result = run(binary, "-f", "docker-compose.yml", "config", "-q")
    assert result.returncode == 0, result.stderr
    broken = tmp_path / "docker-compose.yml"
    text = (ROOT / "docker-compose.yml").read_text()
    broken.write_text(text.replace("condition: service_healthy", "condition: when_ready"))
    assert run(binary, "-f", broken, "config", "-q", cwd=ROOT).returncode != 0


def manifests() -> list[Path]:
    return sorted(p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("manifest", manifests(), ids=lambda p: p.name)
def test_kubernetes_manifests_are_valid(manifest, tmp_path):
    tool = BIN / "kubernetes-validate"
    if not tool.exists():
        pytest.skip("kubernetes-validate is not installed")
    result = run(tool, "--strict", manifest)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / manifest.name
    broken.write_text(manifest.read_text().replace("containerPort", "containerPorts"))
    assert run(tool, "--strict", broken).returncode != 0


def test_kustomization_lists_every_manifest():
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    result = run("kubectl", "kustomize", BASE)
    assert result.returncode == 0, result.stderr
    for manifest in manifests():
        kinds_and_names = [
            line.split(":", 1)[1].strip()
            for line in manifest.read_text().splitlines()
            if line.startswith("  name:")
        ]
        for name in kinds_and_names:
            assert f"name: {name}" in result.stdout


@pytest.mark.parametrize(
    "dockerfile", sorted(ROOT.glob("*/Dockerfile*")), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_dockerfiles_pass_hadolint(dockerfile, tmp_path):
    tool = BIN / "hadolint"
    if not tool.exists():
        pytest.skip("hadolint is not installed")
    result = run(tool, dockerfile)
    assert result.returncode == 0, result.stdout
    broken = tmp_path / "Dockerfile"
    broken.write_text(dockerfile.read_text().replace("USER 10001", "USER root"))
    assert run(tool, broken).returncode != 0


def test_every_deployment_file_is_checked():
    """The globs above cover every manifest kustomize renders and every service's Dockerfile, so
    a new file cannot escape the checks."""
    yaml = pytest.importorskip("yaml")
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifests()]
    dockerfiles = {str(p.relative_to(ROOT)) for p in ROOT.glob("*/Dockerfile*")}
    for service in ("route_cache", "rollout_server", "trainer"):
        assert f"{service}/Dockerfile" in dockerfiles
    for service in ("rollout_server", "trainer"):
        assert f"{service}/Dockerfile.gpu" in dockerfiles


def compose_services() -> dict:
    result = run(compose_binary(), "-f", "docker-compose.yml", "--profile", "cpu", "--profile",
                 "gpu", "config", "--format", "json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    import json

    return json.loads(result.stdout)["services"]


def trainer_commands() -> list[tuple[str, list[str], list[str]]]:
    """(where, torchrun's argument list, the paths mounted into the container) of every trainer
    in docker-compose.yml and k8s/base/trainer.yaml."""
    yaml = pytest.importorskip("yaml")
    out = []
    for name, service in compose_services().items():
        if name.startswith("trainer"):
            mounts = [v["target"] for v in service.get("volumes", [])]
            mounts += [secret["target"] for secret in service.get("secrets", [])]
            out.append((f"compose {name}", service["command"], mounts))
    for doc in yaml.safe_load_all((BASE / "trainer.yaml").read_text()):
        if doc["kind"] == "Job":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            args = [a.replace("$(NODE_RANK)", "0") for a in container["args"]]
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            out.append(("k8s Job trainer", args, mounts))
    return out


def trainer_config(command: list[str]):
    """(the trainer's parsed arguments, its configuration) from torchrun's argument list, parsed
    with torchrun's own parser, then the trainer's parser and configuration schema (unknown keys
    and invalid combinations fail)."""
    pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from torch.distributed.run import parse_args as torchrun_args

    from trainer.__main__ import parse
    from trainer.config import load_config

    launcher = torchrun_args(command)
    assert launcher.module and launcher.training_script == "trainer", command
    args = parse(launcher.training_script_args)
    return args, load_config(args.config, [*args.overrides, f"train.steps={args.steps}"])


def within(path: str, mounts: list[str]) -> bool:
    return any(Path(path) == Path(m) or Path(m) in Path(path).parents for m in mounts)


def test_trainer_commands_match_the_code():
    """No drift: each trainer's command parses (``trainer_config``), takes whole GRPO groups
    from the route cache's ready feed rather than a list of ids, and reads its token from a
    mounted file. Rank 0 waits for a batch while the other ranks wait in a collective, so the
    feed's wait stays under the process group's timeout (gloo's default; NCCL's is 10 min)."""
    from torch.distributed.constants import default_pg_timeout

    commands = trainer_commands()
    assert {where for where, _, _ in commands} == {
        "compose trainer-cpu", "compose trainer-gpu", "k8s Job trainer"
    }  # fmt: skip
    for where, command, mounts in commands:
        args, config = trainer_config(command)
        assert config.router_replay.mode.value == "R3", where
        assert config.route_cache.target == "route-cache:50051", where
        assert within(config.route_cache.token_file, mounts), where
        assert args.ids is None and config.data.source == "feed", where
        assert config.data.wait_s < min(default_pg_timeout.total_seconds(), 600), where
        if where.startswith("k8s"):  # no push there: its header says why
            assert config.train.push_weights_to is None and config.train.export_dir is None


def test_compose_trainer_pushes_weights_its_rollout_server_reads():
    """The trainer's exports reach the rollout server of its profile: the export folder is a
    named volume the server mounts at the same path (``UpdateWeights`` names the trainer's
    path), made writable for the trainer image's user first; the push goes to the server's
    network alias and port, with the server's own token; the trainer starts (and its wait for
    the feed runs) once the server is healthy."""
    services = compose_services()
    commands = {where: command for where, command, _ in trainer_commands()}
    uid = re.search(r"^USER (\d+)$", (ROOT / "trainer" / "Dockerfile").read_text(), re.M)[1]
    for profile in ("cpu", "gpu"):
        trainer, server = services[f"trainer-{profile}"], services[f"rollout-server-{profile}"]
        _, config = trainer_config(commands[f"compose trainer-{profile}"])
        (export,) = [
            v for v in trainer["volumes"] if within(config.train.export_dir, [v["target"]])
        ]
        assert export["type"] == "volume" and not export.get("read_only"), export
        shared = [v for v in server["volumes"] if v["source"] == export["source"]]
        assert [v["target"] for v in shared] == [export["target"]], profile
        (owner,) = [name for name, dep in trainer["depends_on"].items()
                    if dep["condition"] == "service_completed_successfully"]  # fmt: skip
        assert services[owner]["command"] == ["chown", f"{uid}:{uid}", export["target"]]
        assert export["source"] in [v["source"] for v in services[owner]["volumes"]]
        assert trainer["depends_on"][f"rollout-server-{profile}"]["condition"] == "service_healthy"

        host, port = config.train.push_weights_to.split(":")
        assert host in server["networks"]["default"]["aliases"], profile
        assert port == server["environment"]["ROLLOUT_SERVER_PORT"], profile
        secrets = {s["target"]: s["source"] for s in trainer["secrets"]}
        server_secrets = {s["target"]: s["source"] for s in server["secrets"]}
        server_token = server_secrets[server["environment"]["ROLLOUT_SERVER_AUTH_TOKEN_FILE"]]
        assert secrets[config.train.push_token_file] == server_token, profile


def deployed_settings(text: str) -> set[str]:
    return set(re.findall(r"\b(?:ROUTE_CACHE|ROLLOUT_SERVER)_[A-Z0-9_]+\b", text))


def test_service_settings_match_the_code():
    """No drift: every ROUTE_CACHE_* and ROLLOUT_SERVER_* variable that the compose file and
    the manifests set is one the services read, and a misspelt one is caught."""
    from rollout_server.config import ENV_PREFIX as ROLLOUT_PREFIX
    from rollout_server.config import Config as RolloutConfig
    from route_cache.config import ENV_PREFIX as CACHE_PREFIX
    from route_cache.config import Config as CacheConfig
    from routereplay.service_config import env_names

    known = env_names(CacheConfig, CACHE_PREFIX) | env_names(RolloutConfig, ROLLOUT_PREFIX)
    files = [ROOT / "docker-compose.yml", *manifests()]
    used = deployed_settings("\n".join(p.read_text() for p in files))
    assert {"ROUTE_CACHE_AUTH_TOKEN_FILE", "ROLLOUT_SERVER_ROUTE_CACHE_TOKEN_FILE"} <= used
    assert used <= known, used - known
    misspelt = deployed_settings("ROUTE_CACHE_AUTH_TOKEN_PATH: /run/secrets/route-cache-token")
    assert not misspelt <= known


def test_secret_files_are_mounted():
    """Every *_FILE setting of a compose service names a secret that service mounts; every one
    of a manifest's containers lies in a folder mounted from a Secret."""
    for name, service in compose_services().items():
        targets = {secret["target"] for secret in service.get("secrets", [])}
        for key, value in (service.get("environment") or {}).items():
            if key.endswith("_FILE"):
                assert value in targets, (name, key, value)
    yaml = pytest.importorskip("yaml")
    for manifest in manifests():
        docs = list(yaml.safe_load_all(manifest.read_text()))
        config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs
                       if d["kind"] == "ConfigMap"}  # fmt: skip
        for doc in docs:
            if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            pod = doc["spec"]["template"]["spec"]
            secret_volumes = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
            for container in pod["containers"]:
                settings = {e["name"]: e.get("value") for e in container.get("env", [])}
                for source in container.get("envFrom", []):
                    settings |= config_maps[source["configMapRef"]["name"]]
                mounted = [Path(m["mountPath"]) for m in container.get("volumeMounts", [])
                           if m["name"] in secret_volumes]  # fmt: skip
                for key, value in settings.items():
                    if key.endswith("_FILE"):
                        assert Path(value).parent in mounted, (manifest.name, key, value)


def test_documented_deployment_paths_exist():
    """Every ``k8s/...`` path that the README, the docs and the deployment files name exists, so
    a moved manifest cannot leave a stale instruction behind."""
    texts = [ROOT / "README.md", ROOT / "docker-compose.yml", *(ROOT / "docs").glob("*.md")]
    texts += (ROOT / "k8s").rglob("*.yaml")
    named = {
        (text.name, path)
        for text in texts
        for path in re.findall(r"\bk8s(?:/[\w.-]+)+", text.read_text())
    }
    assert ("README.md", "k8s/base") in named
    assert [item for item in named if not (ROOT / item[1]).exists()] == []
