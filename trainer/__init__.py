"""The Megatron trainer: the served Hugging Face model in megatron-core, with router replay.

Arranged by concern, in the order a step uses them:

- ``data``: samples and their rollout routes fetched (``source``: the sources, the batch plan,
  the prefetcher), a stage's layers read once per model-parallel group (``stage_reads``).
- ``layout``: one step's batch -> this rank's micro-batches and replay ids (``plan_step`` in
  ``plan``): micro-batches (``microbatch``), the batch the model reads (``batch``), per-router
  replay ids and the record checks they apply (``align``, with
  ``routereplay.domain.record_checks``), this rank's rows (``share``), each micro-batch's
  replay reference (``reference``); built on ``sharding``.
- ``sharding``: each rank's share of a batch as pure functions under ``layout`` (no megatron,
  nothing else of the trainer): the parallel sizes and a rank's coordinates
  (``parallel.Parallelism``), the pipeline layer split (``layers``), token-budget grouping
  (``batching``), packing and the CP and SP cuts (``packing``), the rows a rank keeps
  (``rows``). "Layout" names only the step's layout (``layout``); "parallel" only the
  parallel sizes (``Parallelism``).
- ``model``: the Hugging Face checkpoint as a megatron-core ``GPTModel`` (``hf_config``,
  ``hf_weights``, ``build``), router replay installed (``replay``), and the weights back out
  (``export``: a step's export under any parallel sizes, the weights gathered to the lead;
  ``shard_weights``).
- ``rl``: one RL step (``step``: ``RLStep.run``, a short list of stages), what its stages hand
  each other (``stages``: ``PASSES`` and each stage's frozen result), the objective
  (``objective``), the passes on megatron's schedules (``schedule``), the routing counts
  (``counts``), the step's report (``measure``), the routes its update passes used
  (``routes_used``).
- ``report``: the typed ``StepReport`` (``step_report``) and everything done after a step, one
  output each in a table whose order is the rule (``outputs``), Prometheus (``metrics``) and
  TensorBoard (``tensorboard``).
- ``distributed``: the world's process groups (``world``, ``single_process``) and what
  data-parallel ranks exchange (``dp``).
- ``patches``, the ground floor (it imports nothing of the trainer): ``cpu_compat`` and
  ``mla_compat`` let megatron-core run on a CPU-only torch (one rank or many),
  ``megatron_fixes`` mends its bugs the trainer meets.
- Here: ``config`` (YAML with dotted overrides), ``train`` (the loop), ``optim`` (AdamW with
  float32 master weights), ``checkpoint`` (save and resume), ``policy_sync`` (exports loaded
  by the rollout servers).

Imports point down this list's concerns: ``rl`` uses ``layout``, ``model``, ``distributed`` and
``report``'s types; ``report.outputs`` uses ``model``, ``data``, ``optim`` and ``checkpoint``;
nothing below ``train`` imports it. ``python -m trainer`` runs steps. Nothing runs at import.
"""
