"""The allocator setting: freed megabyte buffers are reused without page-faulting again."""

from __future__ import annotations

import subprocess
import sys

# Rounds of two live 16 MiB buffers (a joined record and a copy of it), touched and freed;
# prints the minor page faults of the last rounds (the first faults in whatever it gets).
_PROBE = """
import resource, sys
from routereplay.allocator import keep_large_buffers
if sys.argv[1] == "tuned":
    assert keep_large_buffers()
def one_round():
    a = bytearray(16 << 20)
    b = bytearray(a)
    del a, b
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = {"PYTHONPATH": "."}  # no GLIBC_TUNABLES from the caller
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, env=env
    )
    return int(out.stdout)


def test_freed_large_buffers_are_reused_without_page_faults():
    pages = 4 * 2 * (16 << 20) // 4096
    assert _faults("default") > pages // 2  # glibc's default: each round faults anew
    assert _faults("tuned") < pages // 100


def test_user_malloc_tunables_win(monkeypatch):
    from routereplay.allocator import keep_large_buffers

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=1048576")
    assert keep_large_buffers() is False
