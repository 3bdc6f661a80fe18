"""Records in a file, for offline analysis and replay without the cache: the trainer's
``router_replay.record_file`` / ``replay_file`` and the routes tool's export and import.

The form is the record's own (layout-free: routes ``[T - 1, L, k]`` per sample), so any
trainer layout can replay a file and any tool can compare it with the rollout's records.

- ``.npz``: numpy only. ``meta`` holds JSON (format, and per record its id, group, geometry
  and turns); ``tokens/<i>``, ``routes/<i>``, ``logprobs/<i>`` hold record i's arrays.
- ``.pt``: ``torch.save`` of ``{"format": ..., "records": [dict, ...]}`` with tensors, for
  frameworks that pass routes as torch tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from routereplay.domain.record import Geometry, Record, Turn
from routereplay.errors import InvalidArgument

FORMAT = "router-replay-records/1"


def _geometry_dict(geometry: Geometry) -> dict:
    return {
        "moe_layers": list(geometry.moe_layers),
        "topk": geometry.topk,
        "num_experts": geometry.num_experts,
        "model_id": geometry.model_id,
    }


def _geometry(d: dict) -> Geometry:
    return Geometry(tuple(d["moe_layers"]), d["topk"], d["num_experts"], d["model_id"])


def _meta(record: Record) -> dict:
    return {
        "sample_id": record.sample_id,
        "group_id": record.group_id,
        "geometry": _geometry_dict(record.geometry),
        "turns": [
            [t.token_start, t.token_end, t.generated_start, t.policy_version, int(t.logprobs.size)]
            for t in record.turns
        ],
    }


def _record(meta: dict, tokens: np.ndarray, routes: np.ndarray, logprobs: np.ndarray) -> Record:
    turns, offset = [], 0
    for start, end, generated, version, n in meta["turns"]:
        turns.append(Turn(start, end, generated, version, logprobs[offset : offset + n]))
        offset += n
    record = Record(
        meta["sample_id"],
        _geometry(meta["geometry"]),
        np.asarray(tokens, np.int32),
        np.asarray(routes),
        turns,
        meta["group_id"],
    )
    record.validate()
    return record


def save_records(path: str | Path, records: Iterable[Record]) -> Path:
    """Write ``records`` to ``path`` (``.npz`` or ``.pt``, by its suffix)."""
    path = Path(path)
    records = list(records)
    meta = json.dumps({"format": FORMAT, "records": [_meta(r) for r in records]})
    logprobs = [
        np.concatenate([t.logprobs for t in r.turns]).astype(np.float32)
        if r.turns
        else np.zeros(0, np.float32)
        for r in records
    ]
    if path.suffix == ".npz":
        arrays = {"meta": np.frombuffer(meta.encode(), np.uint8)}
        for i, (record, lp) in enumerate(zip(records, logprobs, strict=True)):
            arrays[f"tokens/{i}"] = record.token_ids
            arrays[f"routes/{i}"] = record.routes
            arrays[f"logprobs/{i}"] = lp
        with path.open("wb") as f:
            np.savez(f, **arrays)
    elif path.suffix == ".pt":
        import torch

        torch.save(
            {
                "format": FORMAT,
                "records": [
                    {
                        **_meta(r),
                        "token_ids": torch.from_numpy(np.array(r.token_ids)),
                        "routes": torch.from_numpy(np.array(r.routes)),
                        "logprobs": torch.from_numpy(lp),
                    }
                    for r, lp in zip(records, logprobs, strict=True)
                ],
            },
            path,
        )
    else:
        raise InvalidArgument(f"{path}: a records file ends in .npz or .pt")
    return path


def load_records(path: str | Path) -> list[Record]:
    """Read and validate the records of a ``.npz`` or ``.pt`` file."""
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path) as data:
            meta = json.loads(data["meta"].tobytes())
            _check_format(meta, path)
            return [
                _record(m, data[f"tokens/{i}"], data[f"routes/{i}"], data[f"logprobs/{i}"])
                for i, m in enumerate(meta["records"])
            ]
    if path.suffix == ".pt":
        import torch

        data = torch.load(path, weights_only=True)
        _check_format(data, path)
        return [
            _record(r, r["token_ids"].numpy(), r["routes"].numpy(), r["logprobs"].numpy())
            for r in data["records"]
        ]
    raise InvalidArgument(f"{path}: a records file ends in .npz or .pt")


def _check_format(meta: dict, path: Path) -> None:
    if meta.get("format") != FORMAT:
        raise InvalidArgument(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
