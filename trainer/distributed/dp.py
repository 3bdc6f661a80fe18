"""Data parallelism for the RL step: which samples a DP rank trains on, and the collectives
that make the ranks' update equal to one rank's update on the whole batch.

Sharding: the batch is cut into the global micro-batches of ``train.micro_batch_size`` samples
(what a single rank trains on between two optimizer steps) and each DP rank takes its
``sharding.dp_shard`` of every micro-batch. So DP rank r's micro-batch i holds its share of the
single-rank micro-batch i, and every optimizer step sees the same samples as on one rank.

Gradients: a plain all-reduce (sum) of the gradients over the DP group after each backward,
with the loss normalised by the micro-batch's generated-token count over *all* DP ranks, so the
sum is the single-rank token-mean gradient (up to float summation order). One flat buffer per
backward (one collective). Chosen over megatron's ``DistributedDataParallel`` because the model
is built as a plain module and the optimizer is our own AdamW on the CPU; nothing overlaps here.

Model parallel (``ModelParallel``: tensor, pipeline and expert parallelism): the ranks of a
TP group and the stages of a pipeline share a DP rank, hence its samples. Gradients are summed
the way megatron's ``finalize_model_grads`` and ``DistributedDataParallel`` would: over the TP
group for the parameters each TP rank sees only part of the tokens or heads of
(``sequence_parallel`` norms and routers, q/k norms), over the DP group (a stage's own) for the
rest, except expert parameters under expert parallelism (``allreduce`` False), summed over the
expert data-parallel group instead: an expert already received every DP rank's tokens through
the dispatcher. Stages hold disjoint parameters: nothing is summed across them.

With one rank of each kind every method is the identity (no collective runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.data.source import BatchPlan
from trainer.sharding import Parallelism, ParallelismError, RankCoords, dp_shard


@dataclass(frozen=True)
class ModelParallel:
    """This rank's tensor-, pipeline- and expert-parallel place, for the step's collectives.

    Attributes:
        parallelism: The parallel sizes (``sharding.Parallelism``; context parallel 1).
        coords: This rank's coordinates (its TP rank shards the replayed routes, its pipeline
            rank owns a stage's layers).
        tp_group: The TP group: logits are gathered over it.
        expert_dp_group: Expert parameters' gradients are summed over it (with ``ep`` > 1).
        shard: This rank's name among the checkpoint's per-rank files (its PP, TP, EP and DP
            ranks: ``pp0-tp0-ep1-dp0``).
        pp_group: The pipeline group: the last stage's log-probs are broadcast over it.
    """

    parallelism: Parallelism
    coords: RankCoords
    tp_group: object
    expert_dp_group: object
    shard: str = ""
    pp_group: object = None

    @property
    def tp(self) -> int:
        return self.parallelism.tp


class DataParallel:
    """This process's DP rank and the DP group's collectives.

    Args:
        size, rank: DP size and this rank's DP index.
        group: The DP process group (None: the default group, when it is the DP group).
    """

    def __init__(
        self, size: int = 1, rank: int = 0, group=None, model: ModelParallel | None = None
    ):
        self.size = size
        self.rank = rank
        self.group = group
        self.model = model

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def lead(self) -> bool:
        """The one rank that logs and writes files (DP rank 0, TP rank 0, the first stage)."""
        if self.model is None:
            return self.rank == 0
        coords = self.model.coords
        return self.rank == 0 and coords.tp_rank == 0 and coords.pp_rank == 0

    # -- samples ------------------------------------------------------------------------------

    def check(self, batch_size: int, micro_batch_size: int, mini_batch_size: int) -> None:
        """Refuse a batch that does not divide over the DP ranks (raised on every rank alike,
        from the configuration alone, before any collective)."""
        if not self.enabled:
            return
        sizes = (
            ("batch_size", batch_size),
            ("micro_batch_size", micro_batch_size),
            ("mini_batch_size", mini_batch_size),
        )
        for name, n in sizes:
            if n % self.size:
                raise ParallelismError(
                    f"train.{name}={n} does not divide over {self.size} data-parallel ranks"
                )

    def indices(self, num_samples: int, mini_batch_size: int) -> list[int]:
        """Batch positions of this rank's samples, in training order: its share of every
        mini-batch (the samples of one optimizer step)."""
        if not self.enabled:
            return list(range(num_samples))
        out: list[int] = []
        for lo in range(0, num_samples, mini_batch_size):
            n = min(mini_batch_size, num_samples - lo)
            out.extend(lo + i for i in dp_shard(n, self.size, self.rank))
        return out

    def shard_plan(self, plan: BatchPlan, mini_batch_size: int) -> BatchPlan:
        """The part of ``plan`` this rank fetches and trains on."""
        if not self.enabled:
            return plan
        mine = self.indices(len(plan.sample_ids), mini_batch_size)
        samples = None if plan.samples is None else [plan.samples[i] for i in mine]
        return BatchPlan([plan.sample_ids[i] for i in mine], samples, plan.published)

    # -- collectives --------------------------------------------------------------------------

    def sum(self, values: Sequence[float] | torch.Tensor, dtype=torch.float64) -> torch.Tensor:
        """Element-wise sum over the DP ranks."""
        t = torch.as_tensor(values, dtype=dtype).clone()
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        if self.enabled:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.item()

    def from_lead(self, obj):
        """The lead's ``obj`` on every rank of the world (picklable objects). The lead is global
        rank 0: every other coordinate of it is 0 too."""
        if not self.enabled and self.model is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in DP rank order (picklable objects)."""
        if not self.enabled:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Start every rank from DP rank 0's weights (expert parameters under expert
        parallelism: from expert DP rank 0's, the rank holding the same experts)."""
        for params, group in self._grad_groups(model):
            src = dist.get_global_rank(group, 0) if group is not None else 0
            for p in params:
                dist.broadcast(p.data, src=src, group=group)

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum the gradients over the ranks that share each parameter (see the module
        docstring), one flat buffer per group. A parameter without a gradient on this rank but
        with one elsewhere gets zeros first; one without on every rank keeps ``None`` (the
        optimizer skips it, as on one rank)."""
        mp = self.model
        if mp is not None and mp.tp > 1:
            partial = [
                p
                for name, p in model.named_parameters()
                if p.requires_grad and _tp_partial(name, p)
            ]
            _sum_grads(partial, mp.tp_group)
        for params, group in self._grad_groups(model):
            _sum_grads(params, group)

    def _grad_groups(self, model: torch.nn.Module) -> list[tuple[list, object]]:
        """(parameters, the group of ranks holding the same copy) with more than one rank."""
        params = [p for p in model.parameters() if p.requires_grad]
        expert_group = self.model.expert_dp_group if self.model is not None else None
        if expert_group is None or self.model.parallelism.ep == 1:
            return [(params, self.group)] if self.enabled else []
        dense = [p for p in params if getattr(p, "allreduce", True)]
        experts = [p for p in params if not getattr(p, "allreduce", True)]
        out = [(dense, self.group)] if self.enabled else []
        if dist.get_world_size(expert_group) > 1:
            out.append((experts, expert_group))
        return out


def _tp_partial(name: str, param: torch.Tensor) -> bool:
    """Whether each TP rank holds a partial gradient of this replicated parameter: it saw only
    its sequence shard (sequence-parallel norms, routers, row-parallel biases) or its heads
    (q/k norms). Not experts' (gpt-oss's fc2 bias is marked ``sequence_parallel`` by megatron,
    but experts see every token routed to them, gathered from all ranks)."""
    if ".mlp.experts." in name:
        return False
    return getattr(param, "sequence_parallel", False) or name.endswith(
        ("q_layernorm.weight", "k_layernorm.weight")
    )


def _sum_grads(params: list[torch.Tensor], group) -> None:
    """Sum ``params``' gradients over ``group`` (one flat buffer)."""
    has = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64)
    dist.all_reduce(has, group=group)
    for p, n in zip(params, has.tolist(), strict=True):
        if p.grad is None and n > 0:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


SINGLE = DataParallel()


def from_world(world) -> DataParallel:
    """The DP group of a ``world.World``."""
    from megatron.core import parallel_state

    parallelism = world.parallelism
    model = None
    if parallelism.tp > 1 or parallelism.ep > 1 or parallelism.pp > 1:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        coords = world.coords
        # Names without a pipeline stage keep the files of runs without one readable.
        stage = f"pp{coords.pp_rank}-" if parallelism.pp > 1 else ""
        model = ModelParallel(
            parallelism,
            coords,
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_expert_data_parallel_group(),
            f"{stage}tp{coords.tp_rank}-ep{ep_rank}-dp{world.dp_rank}",
            parallel_state.get_pipeline_model_parallel_group(),
        )
    if world.dp_size == 1:
        return DataParallel(model=model)
    group = parallel_state.get_data_parallel_group()
    return DataParallel(world.dp_size, world.dp_rank, group, model)
