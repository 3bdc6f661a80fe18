"""Stage reads: one rank per (data-parallel rank, pipeline stage) reads its stage's MoE layers
from the route cache and shares them with the rest of its tensor/context-parallel group.

The ranks of one TP/CP group train the same samples with the same routers (their stage's), so
they need the same route bytes, once. The group's fetching rank (TP rank 0, CP rank 0) reads
a layer-selected ``ReadBatch`` of the columns its routers replay (every virtual stage of its
pipeline rank) and broadcasts the batch to the others as a small header (ids, geometry,
turns, array shapes) and one flat byte buffer (every record's token ids, routes and log-probs
back to back); they rebuild the same records from it. The stages' layers partition the
record, so the route cache serves each stored route byte once per step whatever the parallel sizes
(a whole-record read by every rank costs TP x PP x CP times that).

The broadcast runs on a gloo group of its own: the fetch runs in the prefetch thread while the
step's collectives run on megatron's groups in the main thread, and a group used from two
threads at once would interleave their messages. Records stay on the host either way.

A read that fails on the fetching rank fails on every rank of its group with the same error
(nobody is left waiting in the broadcast).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from routereplay.domain.record import Record, Turn


class StageReads:
    """A ``CacheSource`` read by one rank of each TP/CP group, for its stage's layers.

    Args:
        source: The route cache source (``trainer.data.source.CacheSource``).
        layers: Positions in ``geometry.moe_layers`` this rank's routers replay; None when they
            are every MoE layer (a whole-record read).
        group: The TP/CP group's gloo group (None when this rank is alone in it).
        src: Global rank of the group's fetching rank.
    """

    def __init__(self, source, layers: Sequence[int] | None, group=None, src: int = 0):
        self.source = source
        self.layers = None if layers is None else tuple(layers)
        self.group = group
        self.src = src
        self.reads = group is None or dist.get_rank() == src

    @property
    def client(self):
        return self.source.client

    def fetch(self, sample_ids: Sequence[str]) -> list[Record | None]:
        if self.reads:
            try:
                records = self.source.fetch(sample_ids, self.layers)
            except Exception as exc:
                if self.group is not None:
                    self._broadcast(_portable(exc))
                raise
            if self.group is not None:
                self._broadcast(*pack_records(records))
            return records
        header, payload = self._broadcast()
        if isinstance(header, Exception):
            raise header
        return unpack_records(header, payload)

    def _broadcast(self, header=None, payload: np.ndarray | None = None):
        """The fetching rank's header (or the error its read raised) and payload on every rank
        of the group: the header as one pickled object, the payload as one uint8 tensor."""
        size = 0 if payload is None else payload.size
        box = [(header, size)]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        header, size = box[0]
        if not size:
            return header, np.zeros(0, np.uint8)
        buffer = torch.from_numpy(payload) if self.reads else torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buffer, src=self.src, group=self.group)
        return header, buffer.numpy()

    def close(self) -> None:
        self.source.close()


def stage_reads(source, dp, moe_layers: Sequence[int], router_layers: Sequence[int]):
    """Wrap ``source`` so this rank reads only its routers' layers, once per TP/CP group.

    A collective over the world (every rank calls it, in the same order): the TP/CP groups'
    gloo groups are created here.

    Args:
        source: A ``CacheSource``.
        dp: The ``DataParallel`` group, with its ``model`` place (None: one rank per model).
        moe_layers: ``Geometry.moe_layers`` of the model.
        router_layers: Global layer numbers of this rank's routers (its stage's).
    """
    positions = [moe_layers.index(layer) for layer in sorted(router_layers)]
    layers = None if len(positions) == len(moe_layers) else positions
    mp = dp.model
    if mp is None or mp.parallelism.tp * mp.parallelism.cp == 1:
        return StageReads(source, layers)
    coords = mp.coords
    return group_reads(source, layers, (dp.rank, coords.pp_rank, coords.tp_rank, coords.cp_rank))


def group_reads(source, layers: Sequence[int] | None, place: tuple[int, int, int, int]):
    """``StageReads`` shared by each TP/CP group: this rank's ``place`` is (data-parallel rank,
    pipeline rank, tensor-parallel rank, context-parallel rank); ranks of one group share the
    first two, and the group's (0, 0) rank fetches. A collective over the world: the groups'
    gloo groups are created here, in the same order on every rank."""
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, tuple(place))
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, (dp_rank, pp_rank, _, _) in enumerate(places):
        groups.setdefault((dp_rank, pp_rank), []).append(rank)
    mine = None
    for key in sorted(groups):
        group = dist.new_group(groups[key], backend="gloo")
        if key == tuple(place[:2]):
            mine = (group, next(r for r in groups[key] if places[r][2:] == (0, 0)))
    return StageReads(source, layers, *mine)


def _portable(exc: Exception) -> Exception:
    """``exc`` if it pickles (the others raise the same domain error), else its text."""
    try:
        pickle.dumps(exc)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def pack_records(records: Sequence[Record | None]) -> tuple[list, np.ndarray]:
    """Records -> (header, payload): per record its ids, geometry, layer selection, turn spans
    and array shapes (None where missing), and every record's token ids, routes and log-probs
    as one uint8 buffer."""
    header: list = []
    parts: list[np.ndarray] = []
    for record in records:
        if record is None:
            header.append(None)
            continue
        arrays = [record.token_ids, record.routes, *(t.logprobs for t in record.turns)]
        spans = [
            (t.token_start, t.token_end, t.generated_start, t.policy_version) for t in record.turns
        ]
        specs = [(a.dtype.str, a.shape) for a in arrays]
        header.append(
            (record.sample_id, record.group_id, record.geometry, record.layers, spans, specs)
        )
        for a in arrays:
            flat = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            parts += [flat, np.zeros(_aligned(flat.size) - flat.size, np.uint8)]
    payload = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return header, payload


def unpack_records(header: list, payload: np.ndarray) -> list[Record | None]:
    """The inverse of ``pack_records`` (arrays are views of ``payload``)."""
    out: list[Record | None] = []
    offset = 0
    for meta in header:
        if meta is None:
            out.append(None)
            continue
        sample_id, group_id, geometry, layers, spans, specs = meta
        arrays = []
        for dtype, shape in specs:
            dtype = np.dtype(dtype)
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            arrays.append(payload[offset : offset + size].view(dtype).reshape(shape))
            offset += _aligned(size)
        token_ids, routes, *logprobs = arrays
        turns = [Turn(*span, lp) for span, lp in zip(spans, logprobs, strict=True)]
        out.append(Record(sample_id, geometry, token_ids, routes, turns, group_id, layers))
    return out


def _aligned(size: int) -> int:
    """Each array starts on an 8-byte boundary of the payload (aligned views)."""
    return -(-size // 8) * 8
