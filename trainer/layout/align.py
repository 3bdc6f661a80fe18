"""Records to replay indices under the trainer's batch layout (architecture.md, trainer steps 2-3).

A record's routes are layout-free: ``[T - 1, L, k]``, row i computed when token i was the
input, one column per MoE layer (``Geometry.moe_layers``, global layer numbers). The trainer
lays a sample's T tokens at columns ``[start, start + T)`` of a padded row; megatron orders
tokens ``[seq, batch]`` and flattens them, so token (b, s) is row ``s * batch + b`` of a
router's ``[seq * batch, k]`` index tensor. Rows with no route (each sample's final token,
padding, a sample without a record) hold ``replay.MASKED``: they route natively.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from routereplay.domain.record import MASKED, Geometry, Record, replay_dtype
from routereplay.domain.record_checks import MissingRecord, check_geometry, check_tokens
from routereplay.errors import InvalidArgument
from trainer.layout.batch import PaddedBatch

log = logging.getLogger(__name__)


@dataclass
class AlignedRoutes:
    """One batch's replay ids for this rank's routers.

    Attributes:
        indices: One ``[positions * rows, k]`` tensor per router (in the order of
            ``layers``), megatron's token order, in ``replay_dtype`` (int16 up to 32768
            experts); ``MASKED`` rows route natively. ``positions``: every sequence position,
            or this rank's.
        replayed: bool ``[seq, rows]``: True where a recorded route is replayed (every
            rank's rows).
        layers: Global layer number of each entry of ``indices``.
        missing: Sample ids that had no record (routed natively under ``missing="native"``).
    """

    indices: list[torch.Tensor]
    replayed: torch.Tensor
    layers: tuple[int, ...]
    missing: list[str] = field(default_factory=list)


def align_routes(
    batch: PaddedBatch,
    records: Sequence[Record | None],
    geometry: Geometry,
    layers: Sequence[int],
    *,
    missing: str = "error",
    model_id: str | None = None,
    positions: np.ndarray | None = None,
) -> AlignedRoutes:
    """Build per-router replay ids for a padded batch.

    Args:
        batch: The trainer's batch; sample b's tokens sit at columns
            ``[starts[b], starts[b] + lengths[b])``.
        records: One record per sample, in batch order; None where none was found. A
            layer-selected read must hold ``layers``.
        geometry: The model's routing geometry (records must match it).
        layers: Global layer numbers of this rank's routers, ascending (a subset of
            ``geometry.moe_layers`` under pipeline parallelism).
        missing: ``"error"`` refuses a missing record; ``"native"`` routes that sample natively
            and logs a warning.
        model_id: When given, records must carry this model id.
        positions: The sequence positions whose rows this rank keeps, in its order
            (``trainer.sharding.rank_positions``: its CP chunks and SP share); only those rows
            are written. None: every row.

    Returns:
        The ``AlignedRoutes``.

    Raises:
        InvalidArgument: A geometry, token or model mismatch, or a missing record under
            ``missing="error"``.
    """
    if missing not in tuple(MissingRecord):
        raise ValueError(f"missing={missing!r}; expected one of {[m.value for m in MissingRecord]}")
    if len(records) != batch.batch_size:
        raise ValueError(f"{len(records)} records for a batch of {batch.batch_size}")
    unknown = sorted(set(layers) - set(geometry.moe_layers))
    if unknown or not layers:
        raise ValueError(f"router layers {list(layers)} must be MoE layers of the model")
    seq, nrows, k = batch.seq_len, batch.num_rows, geometry.topk
    keep = np.arange(seq) if positions is None else np.asarray(positions)
    local = np.full(seq, -1)  # sequence position -> this rank's position, -1: not its row
    local[keep] = np.arange(len(keep))
    # [routers, local positions, rows, k]: per router, megatron's token order before
    # flattening, so each router's ids are one contiguous block (a view, no second copy).
    out = np.full((len(layers), len(keep), nrows, k), MASKED, replay_dtype(geometry.num_experts))
    replayed = torch.zeros((seq, nrows), dtype=torch.bool)
    absent: list[str] = []
    for b, record in enumerate(records):
        sample_id = batch.sample_ids[b]
        if record is None:
            if missing == MissingRecord.ERROR:
                raise InvalidArgument(f"no record for sample {sample_id!r}")
            absent.append(sample_id)
            continue
        if record.sample_id != sample_id:
            raise InvalidArgument(f"record {record.sample_id!r} is in the slot of {sample_id!r}")
        check_geometry(record.geometry, geometry, sample_id, model_id)
        check_tokens(record, batch.sample_tokens(b).numpy().astype(np.int32))
        start, rows, row = int(batch.starts[b]), record.num_rows, int(batch.rows[b])
        # Row i belongs to token i (its input); the final token has no row and stays MASKED.
        replayed[start : start + rows, row] = True
        columns = _select(record.routes, _columns(record, layers)).transpose(1, 0, 2)
        where = local[start : start + rows]
        first = int(where[0])
        if first >= 0 and np.array_equal(where, np.arange(first, first + rows)):
            out[:, first : first + rows, row] = columns  # all of them, in order: a slice
        else:
            mine = where >= 0
            out[:, where[mine], row] = columns[:, mine]
    if absent:
        log.warning("%d samples have no record; they route natively: %s", len(absent), absent)
    indices = [torch.from_numpy(ids).reshape(len(keep) * nrows, k) for ids in out]
    return AlignedRoutes(indices, replayed, tuple(layers), absent)


def _columns(record: Record, layers: Sequence[int]) -> list[int]:
    """Route columns of ``layers`` in ``record`` (a whole record, or a layer-selected read
    that must hold them)."""
    held = record.moe_layers
    absent = [layer for layer in layers if layer not in held]
    if absent:
        raise InvalidArgument(
            f"record {record.sample_id!r} holds layers {list(held)}, not {absent} that the "
            "routers replay"
        )
    return [held.index(layer) for layer in layers]


def _select(routes: np.ndarray, columns: list[int]) -> np.ndarray:
    """``routes[:, columns]``; a view when the columns are a run (a whole record, a stage's
    read), not a copy."""
    first = columns[0]
    if columns == list(range(first, first + len(columns))):
        return routes[:, first : first + len(columns)]
    return routes[:, columns]


def routes_from_recorded(
    batch: PaddedBatch, recorded: Sequence[torch.Tensor], geometry: Geometry
) -> list[np.ndarray]:
    """The inverse of ``align_routes``: what the routers chose, per sample, layout-free.

    R2 records its own routes in the old-logprob pass and keeps them in the record's form, so
    they can be replayed under any layout, written to ``record_file`` or read by the routes
    tool.

    Args:
        batch: The batch the routes were recorded on.
        recorded: One int64 ``[seq * batch, k]`` tensor per MoE layer of ``geometry`` (all of
            them, in order), megatron's token order.
        geometry: The model's routing geometry.

    Returns:
        Per sample, ``routes`` ``[lengths[b] - 1, L, k]`` in ``geometry.dtype``: row i is the
        routing of token i (the final token's routing is dropped, as in rollout records).
    """
    if len(recorded) != geometry.num_moe_layers:
        raise ValueError(
            f"{len(recorded)} recorded tensors for {geometry.num_moe_layers} MoE layers"
        )
    seq, nrows, k = batch.seq_len, batch.num_rows, geometry.topk
    stacked = torch.stack([r.reshape(seq, nrows, k) for r in recorded], dim=2).cpu().numpy()
    out = []
    for b in range(batch.batch_size):
        start, rows, row = int(batch.starts[b]), int(batch.lengths[b]) - 1, int(batch.rows[b])
        out.append(np.ascontiguousarray(stacked[start : start + rows, row]).astype(geometry.dtype))
    return out
