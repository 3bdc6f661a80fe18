"""The engine failing under a real rollout server process (``python -m rollout_server``): with no
C++ compiler, as in the CPU image, and SIGKILLed while the server runs.

One process serves both tests, in order (the second kills its engine); it uses none of the
session engine's fixtures, so run alone the module holds one engine."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_server.server import SERVICE_NAME
from routereplay.dev.launch import stop_process
from routereplay.domain.rollout import SampleDone, SamplingOptions
from routereplay.rpc.grpc_server import LIVENESS
from routereplay.rpc.rollout_client import AsyncRolloutClient
from tests.rollout_server.conftest import start_rollout_process

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow  # a vLLM engine of its own

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING


def image_env(dockerfile: Path, root: Path) -> dict[str, str]:
    """The ``ENV`` settings of ``dockerfile``'s final stage, with the image's own folders
    (``/cache``, ``/home/app``) moved under ``root``; PATH is left to this machine."""
    final = dockerfile.read_text().rsplit("\nFROM ", 1)[1].replace("\\\n", " ")
    env = {}
    for line in re.findall(r"^ENV (.+)$", final, re.MULTILINE):
        for name, value in re.findall(r"(\w+)=(\S*)", line):
            for folder in ("/cache", "/home/app"):
                if value.startswith(folder):
                    value = str(root / folder.strip("/")) + value[len(folder) :]
            env[name] = value
    env.pop("PATH", None)
    return env


@pytest.fixture(scope="module")
def server_without_compiler(tiny_model_dir, route_cache, tmp_path_factory):
    """The rollout server with the CPU image's environment (its Inductor cache a new, empty
    folder, so nothing compiled earlier is reused) and ``CXX`` naming no compiler, in its own
    process group so that the teardown can reap whatever a kill leaves behind."""
    root = tmp_path_factory.mktemp("image")
    env = {
        **os.environ,
        **image_env(ROOT / "rollout_server" / "Dockerfile", root),
        "CXX": str(root / "no-such-compiler"),
    }
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(root))
    proc, target = start_rollout_process(
        tiny_model_dir,
        route_cache.target,
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "2",
        "--grace-s",
        "5",
        env=env,
    )
    try:
        yield proc, target
    finally:
        stop_process(proc, 5)


def test_samples_without_a_compiler(server_without_compiler, cache_reader, loop):
    """A sampled request (temperature 1, no seed: vLLM's compiled sampler path) generates and
    stores its record. Without compilation turned off the engine died on it: Inductor could not
    build the sampler's C++."""
    proc, target = server_without_compiler

    async def sample():
        async with AsyncRolloutClient(target, timeout_s=120) as client:
            options = SamplingOptions(temperature=1.0, max_tokens=4)
            return [e async for e in client.generate("Sample me.", options, "no-compiler")]

    events = loop.run_until_complete(sample())
    done = events[-1]
    assert isinstance(done, SampleDone) and done.stored and done.generated_tokens == 4
    assert cache_reader.stat("no-compiler").num_tokens == done.num_tokens
    assert proc.poll() is None


def engine_core(proc: subprocess.Popen) -> psutil.Process:
    """vLLM's engine core process under the server (it names itself VLLM::EngineCore)."""
    (core,) = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "EngineCore" in " ".join(p.cmdline())
    ]
    return core


def test_a_dead_engine_turns_health_off_and_the_server_exits(
    server_without_compiler, record_property
):
    """The engine core SIGKILLed: within seconds liveness (and readiness) stop answering
    SERVING, the container health check fails, and the server exits with an error, so
    Kubernetes and compose restart it. Before, every health name stayed SERVING for good."""
    proc, target = server_without_compiler
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest
        for service in (LIVENESS, SERVICE_NAME, ""):
            assert health.Check(request(service=service), timeout=1).status == SERVING
        engine_core(proc).send_signal(signal.SIGKILL)
        killed = time.monotonic()
        answers = {}
        while time.monotonic() - killed < 10:
            for service in (LIVENESS, SERVICE_NAME):
                try:
                    status = health.Check(request(service=service), timeout=1).status
                    answers[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                except grpc.RpcError as exc:  # the server has stopped listening
                    answers[service] = exc.code().name
            if SERVING not in {
                getattr(health_pb2.HealthCheckResponse, a, None) for a in answers.values()
            }:
                break
            time.sleep(0.1)
    unhealthy_s = time.monotonic() - killed
    record_property("health_off_after_kill_s", round(unhealthy_s, 3))
    print(f"health {answers} {unhealthy_s:.2f} s after the engine was killed")
    assert set(answers.values()) <= {"NOT_SERVING", "UNAVAILABLE"}, answers
    check = subprocess.run(
        [sys.executable, "-m", "routereplay.rpc.healthcheck", target],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 1, check
    assert proc.wait(60) == 1
    record_property("exited_after_kill_s", round(time.monotonic() - killed, 3))
