"""Prints docs/deployment.md's table "Sizing Redis for a run": real models' route bytes and
the Redis memory a run of theirs needs, against the shipped maxmemory defaults.

    .venv/bin/python tools/sizing_table.py

The models are the MoE fields of their published config.json
(tests/routereplay/sizing_configs/); the defaults are read from docker-compose.yml and
k8s/. tests/routereplay/test_sizing.py checks that the docs hold this output.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from routereplay.sizing import (  # noqa: E402
    Run,
    geometry_of,
    human,
    id_bytes,
    parse_memory,
    read_config,
    size_run,
)

CONFIGS = ROOT / "tests/routereplay/sizing_configs"
# A GRPO step of 512 samples of 8K tokens; rollouts one step ahead, a checkpoint every step.
RUN = Run(tokens=8192, samples_per_step=512, steps_ahead=1, checkpoint_interval=1)
MODELS = (
    "Qwen3-30B-A3B",
    "Qwen3-235B-A22B",
    "DeepSeek-V3",
    "Kimi-K2-Instruct",
    "GLM-4.5",
    "Mixtral-8x7B-v0.1",
    "gpt-oss-120b",
)


def _found(pattern: str, path: str) -> str:
    (value,) = re.findall(pattern, (ROOT / path).read_text(), re.MULTILINE)
    return value


def shipped_defaults() -> dict[str, tuple[str, int]]:
    """Each deployment's maxmemory per Redis node (as written) and the nodes its records
    spread over."""
    cluster = "k8s/components/redis-cluster/redis-cluster.yaml"
    nodes = int(_found(r"^  replicas: (\d+)", cluster))
    replicas = int(_found(r"--cluster-replicas (\d+)", cluster))
    return {
        "compose": (_found(r"--maxmemory \$\{REDIS_MAXMEMORY:-(\w+)\}", "docker-compose.yml"), 1),
        "k8s": (_found(r"--maxmemory (\w+)", "k8s/base/redis.yaml"), 1),
        "cluster": (_found(r"^\s*maxmemory (\w+)", cluster), nodes // (1 + replicas)),
    }


def _held(steps: int) -> str:
    return f"**{steps}**" if steps < 2 else str(steps)


def table() -> str:
    (compose, _), (k8s, _), (cluster, masters) = shipped_defaults().values()
    lines = [
        "| model | MoE layers x top-k (experts, id bytes) | route B/token | per 8K sample "
        "| per step, routes | per step in Redis | maxmemory for the run "
        f"| steps held: compose {compose} | k8s {k8s} | Cluster {masters} x {cluster} |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in MODELS:
        config, model_id = read_config(CONFIGS / name)
        geometry = geometry_of(config, model_id)
        sizing = size_run(geometry, RUN)
        lines.append(
            f"| {name} | {geometry.num_moe_layers} x {geometry.topk} ({geometry.num_experts}, "
            f"{id_bytes(geometry)}) | {sizing.route_bytes_per_token} "
            f"| {human(sizing.route_bytes_per_sample)} | {human(sizing.route_bytes_per_step)} "
            f"| {human(sizing.redis_bytes_per_step)} | {human(sizing.maxmemory_needed())} "
            f"| {_held(sizing.steps_held(parse_memory(compose)))} "
            f"| {_held(sizing.steps_held(parse_memory(k8s)))} "
            f"| {_held(sizing.steps_held(parse_memory(cluster), masters))} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
