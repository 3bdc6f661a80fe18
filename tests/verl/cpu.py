"""verl on the CPU, for tests: verl ships no CPU platform (it falls back to CUDA's), so this
registers one through its own plugin interface (``verl.plugin.platform``) before any verl module
that moves tensors to ``get_device_name()`` is imported. Call ``use_cpu()`` first thing."""

from __future__ import annotations

import os

import pytest
import torch


def needs_verl():
    """Skip the calling test module where verl is not installed (the project's environment)."""
    pytest.importorskip(
        "verl",
        reason="verl is not installed here; `make test` runs these tests in verl's own "
        "environment (make verl)",
    )


def use_cpu() -> None:
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    from verl.plugin.platform import PlatformBase, set_platform

    class CpuPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index=None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def communication_backend_name(self) -> str:
            return "gloo"

    # What a CPU has no use for (profilers, IPC, Ray's accelerator resources) is refused.
    for name in PlatformBase.__abstractmethods__ - set(vars(CpuPlatform)):
        setattr(CpuPlatform, name, _unsupported(name))
    CpuPlatform.__abstractmethods__ = frozenset()
    set_platform(CpuPlatform())


def _unsupported(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"verl's platform method {name} on the CPU test platform")

    return method
