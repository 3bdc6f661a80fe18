"""The RL step's passes on megatron-core's own schedules, with router replay per stage and chunk.

Every pass over a list of micro-batches (old-logprob, comparison, update) is one call of the
function ``megatron.core.pipeline_parallel.get_forward_backward_func()`` picks for the parallel
sizes: no pipelining on one stage, 1F1B with pipeline stages, interleaved 1F1B with virtual stages.
The contract is Megatron-LM's: a forward-step function runs the chunk the schedule hands it on
the micro-batch it names and returns the output with a loss function; the loss function runs
on the last stage only. ``forward_only`` passes keep no activations.

Replay:

- **forward**: the forward step runs a chunk inside ``RouterReplayControl.forward`` of that
  chunk's routers, with this rank's ids of that micro-batch (its stage's and chunk's layers,
  its sequence-parallel rows);
- **backward**: with activation recompute the routers run again inside the schedule's
  ``backward_step``; megatron never sets ``REPLAY_BACKWARD``, and leaving ``REPLAY_FORWARD``
  on would replay the last micro-batch's ids for every recompute (wrong gradients, no error).
  ``replay_backward`` wraps ``backward_step`` so recomputed router calls pop their
  micro-batch's ids from the FIFO megatron fills at each ``set_target_indices``: every chunk
  runs its micro-batches' backwards in forward order, the FIFO's order.

What each forward did is observed per router (``RouterReplayControl.observe``: megatron's
natural top-k and the experts its routing map used) on this rank's rows; what the last stage
computes from the logits (log-probs, the loss) reaches every rank of the pipeline group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.layout.batch import PaddedBatch
from trainer.model.build import TrainerModel
from trainer.model.replay import RouterReplayControl

LastStage = Callable[[int, torch.Tensor], tuple[torch.Tensor | None, dict]]
"""``(micro-batch index, full logits [rows, seq, vocab]) -> (loss or None, outputs)``: what the
last stage computes per micro-batch. The loss is the micro-batch's share of the pass's loss
(the pass's loss is their sum); outputs are tensors every rank of the pipeline group gets."""


@contextlib.contextmanager
def replay_backward(
    control: RouterReplayControl, recomputed: dict[int, list[torch.Tensor]] | None = None
) -> Iterator[None]:
    """Run megatron's schedules with every ``backward_step`` under ``control.backward()``
    (restored on exit; not re-entrant); ``recomputed`` gets what each router used in every
    call inside a backward (``RouterReplayControl.observe_calls``).

    Only for a pass whose forward steps all replay (ids loaded for every micro-batch): a
    recompute under ``REPLAY_BACKWARD`` with nothing queued fails (empty FIFO)."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.backward_step
    observe = contextlib.nullcontext
    if recomputed is not None:
        observe = functools.partial(control.observe_calls, recomputed)

    @functools.wraps(original)
    def backward_step(*args, **kwargs):
        with control.backward(), observe():
            return original(*args, **kwargs)

    schedules.backward_step = backward_step
    try:
        yield
    finally:
        schedules.backward_step = original


@dataclass
class PassResult:
    """One pass over the micro-batches.

    Attributes:
        outputs: Per micro-batch, the last stage's outputs (on every rank of the pipeline
            group).
        routes: Per micro-batch, per router of this rank (by global layer), what it did on this
            rank's rows (``RouterReplayControl.observe``); empty when not observed.
        recomputed: Per router of this rank (by global layer), the experts its routing map
            used in each call recomputed in backward (activation recompute), in call order:
            each chunk recomputes its micro-batches in forward order, so call m is micro-batch
            m. Empty without recompute, or when not observed or not replayed.
    """

    outputs: list[dict] = field(default_factory=list)
    routes: list[dict[int, dict[str, torch.Tensor]]] = field(default_factory=list)
    recomputed: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class Schedule:
    """Runs passes of one model through megatron's schedule for its parallel sizes.

    Args:
        built: The model (its chunks: one per virtual stage).
        tp_group: The tensor-parallel group (vocabulary-parallel logits are gathered over it);
            None with one TP rank.
        pp_group: The pipeline group (the last stage's outputs are broadcast over it); None
            with one stage.
    """

    def __init__(self, built: TrainerModel, tp_group=None, pp_group=None):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.built = built
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.func = get_forward_backward_func()

    def _padding_mask(self, chunk, batch: PaddedBatch) -> torch.Tensor:
        """bool ``[rows, seq]``, True on padding (this chunk's sequence-parallel share): megatron
        leaves those tokens out of its routers' counts (the expert-bias update, the aux and z
        losses), so a batch counts the same however it is padded. megatron-core 0.16 cuts the
        mask into the sequence-parallel share on the first pipeline stage only; a later stage
        gets its share here."""
        padding = ~batch.valid
        if chunk.pre_process or not chunk.config.sequence_parallel:
            return padding
        return padding.chunk(self.tp_group.size(), dim=1)[self.tp_group.rank()].contiguous()

    def run(
        self,
        batches: Sequence[PaddedBatch],
        last_stage: LastStage,
        *,
        replay: Sequence[Sequence[torch.Tensor]] | None = None,
        forward_only: bool = True,
        observe: bool = False,
    ) -> PassResult:
        """One pass: a forward (and, unless ``forward_only``, a backward) of every micro-batch.

        Args:
            batches: The micro-batches' tokens as the model reads them, in order.
            last_stage: What the last stage computes from each micro-batch's logits.
            replay: Per micro-batch, this rank's replay ids, one int64 ``[tokens, k]`` tensor
                per router of this rank in ``built.routers`` order (``MASKED`` rows route
                natively); None routes naturally.
            forward_only: No gradients (the old-logprob and comparison passes).
            observe: Keep what every router did (``PassResult.routes``).
        """
        built, n = self.built, len(batches)
        result = PassResult(routes=[{} for _ in range(n)] if observe else [])
        outputs: dict[int, dict] = {}
        per_chunk = self._per_chunk(replay) if replay is not None else None

        def forward_step(data_iterator, model):
            m = next(data_iterator)  # each chunk runs the micro-batches in order
            v = built.vp_stage(model)
            batch = batches[m]
            with contextlib.ExitStack() as stack:
                if per_chunk is not None:
                    stack.enter_context(built.controls[v].forward(per_chunk[v][m]))
                if observe and built.controls is not None:
                    stack.enter_context(built.controls[v].observe(result.routes[m]))
                out = model(
                    batch.token_ids,
                    batch.position_ids(),
                    batch.attention_mask(),
                    padding_mask=self._padding_mask(model, batch),
                )
            return out, functools.partial(loss_func, m)

        def loss_func(m, logits):
            if self.tp_group is not None and self.tp_group.size() > 1:
                from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

                # Vocabulary slices -> full logits (the backward hands each rank its slice).
                logits = gather_from_tensor_model_parallel_region(logits, group=self.tp_group)
            loss, extra = last_stage(m, logits)
            outputs[m] = extra
            if loss is None:
                loss = logits.sum() * 0.0
            # The schedule divides each micro-batch's loss by their number: undo it, so the
            # gradient is that of the sum the caller defined.
            return loss * n, {}

        for chunk in built.chunks:
            chunk.zero_grad(set_to_none=True)
        replaying = per_chunk is not None and not forward_only
        grad = torch.no_grad() if forward_only else contextlib.nullcontext()
        scope = built.replay.step() if built.replay is not None else contextlib.nullcontext()
        backward = contextlib.nullcontext()
        if replaying:
            backward = replay_backward(built.replay, result.recomputed if observe else None)
        with scope, backward, grad:
            self.func(
                forward_step_func=forward_step,
                data_iterator=[iter(range(n)) for _ in built.chunks],
                model=built.chunks,
                num_microbatches=n,
                seq_length=max(b.seq_len for b in batches),
                micro_batch_size=max(b.num_rows for b in batches),
                forward_only=forward_only,
            )
        result.outputs = self._from_last_stage([outputs.get(m) for m in range(n)])
        return result

    def _per_chunk(self, replay) -> list[list[list[torch.Tensor]]]:
        """Per chunk, per micro-batch, the ids of that chunk's routers."""
        built = self.built
        position = {r.layer: j for j, r in enumerate(built.routers)}
        return [
            [[ids[position[layer]] for layer in control.layers] for ids in replay]
            for control in built.controls
        ]

    def _from_last_stage(self, outputs: list) -> list[dict]:
        if self.pp_group is None or self.pp_group.size() == 1:
            return outputs
        last = dist.get_global_rank(self.pp_group, self.pp_group.size() - 1)
        box = [outputs]
        dist.broadcast_object_list(box, src=last, group=self.pp_group)
        return box[0]
