"""Mooncake's store, driven the way its users drive it: the measuring side of
``bench_mooncake.py``, run in Mooncake's own environment (``make mooncake``: numpy and
``mooncake-transfer-engine-non-cuda``, nothing of this project).

``--holder``: a store client that mounts the segment holding the objects and waits (the role
Redis has beside the route cache). Otherwise: a store client with no segment of its own that
loads the records' bytes (``--records``, an ``.npz`` of uint8 arrays), prints one JSON line
(``bytes``, ``stage_bytes``) and then serves one call per line of its standard input, so the
benchmark can take turns with the route cache call by call:

- ``write``: puts the records under fresh keys (the previous ones removed first, untimed);
- ``read``: reads the last written records back whole (checked against what was put,
  untimed);
- ``stage_read``: reads a byte range of each (a pipeline stage of layer-major routes);

each answered with the seconds the Mooncake call itself took (no pipe in the timing).

Calls: ``batch_put_from`` and ``batch_get_into`` from and into registered buffers (no copy
through Python objects: Mooncake's fastest path), ``get_into_ranges`` for the stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

import numpy as np


def store(args, segment_bytes: int, buffer_bytes: int):
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup(
        "127.0.0.1",
        args.metadata,
        segment_bytes,
        buffer_bytes,
        "tcp",
        "",
        args.master,
    )
    if rc != 0:
        raise SystemExit(f"MooncakeDistributedStore.setup returned {rc}")
    return client


def serve(args) -> None:
    records = np.load(args.records)
    values = [records[name] for name in sorted(records.files)]
    sizes = [int(v.nbytes) for v in values]
    src = np.concatenate(values)
    dst = np.zeros_like(src)
    client = store(args, 0, 256 << 20)
    for buffer in (src, dst):
        if client.register_buffer(buffer.ctypes.data, buffer.nbytes) != 0:
            raise SystemExit("register_buffer failed")
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    stage = [int(s * args.stage_fraction) for s in sizes]
    keys: list[str] = []

    def put():
        codes = client.batch_put_from(keys, [src.ctypes.data + o for o in offsets], sizes)
        if any(c != 0 for c in codes):
            raise SystemExit(f"batch_put_from: {codes}")

    def get():
        got = client.batch_get_into(keys, [dst.ctypes.data + o for o in offsets], sizes)
        if got != sizes:
            raise SystemExit(f"batch_get_into: {got}")

    def get_stage():
        got = client.get_into_ranges(
            [dst.ctypes.data],
            [keys],
            [[[o] for o in offsets]],
            [[[0] for _ in keys]],
            [[[s] for s in stage]],
        )
        if [g[0] for g in got[0]] != stage:
            raise SystemExit(f"get_into_ranges: {got}")

    calls = {"write": put, "read": get, "stage_read": get_stage}
    print(json.dumps({"bytes": sum(sizes), "stage_bytes": sum(stage)}), flush=True)
    for line in sys.stdin:
        op = line.strip()
        if op == "write":
            if keys:
                client.batch_remove(keys)  # the segment holds only the batch being measured
            keys[:] = [f"{uuid.uuid4().hex}-{i}" for i in range(len(values))]
        if op == "read":
            dst[:] = 0
        start = time.perf_counter()
        calls[op]()
        elapsed = time.perf_counter() - start
        if op == "read" and not np.array_equal(src, dst):
            raise SystemExit("Mooncake returned other bytes")
        print(elapsed, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--master", required=True)
    parser.add_argument("--metadata", required=True)
    parser.add_argument("--holder", action="store_true")
    parser.add_argument("--segment-mib", type=int, default=2048)
    parser.add_argument("--records", default="")
    parser.add_argument("--stage-fraction", type=float, default=0.25)
    args = parser.parse_args()
    if args.holder:
        holder = store(args, args.segment_mib << 20, 16 << 20)  # kept: freeing it unmounts
        print("ready", flush=True)
        sys.stdin.read()  # until the benchmark closes our stdin
        holder.close()
        return 0
    serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
