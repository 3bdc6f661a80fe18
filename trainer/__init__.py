"""The Megatron trainer: the served Hugging Face model in megatron-core, with router replay.

Arranged by concern, in the order a step uses them:

- ``data``: samples and their rollout routes fetched (``source``), a stage's layers read once
  per model-parallel group (``stage_reads``).
- ``layout``: one step's batch -> this rank's micro-batches and replay ids (``plan_step``):
  micro-batches (``microbatch``), the batch the model reads (``batch``), per-router replay ids
  (``align``), this rank's rows (``share``); on ``reshard``'s pure layout functions.
- ``model``: the Hugging Face checkpoint as a megatron-core ``GPTModel`` (``hf_config``,
  ``hf_weights``, ``build``), router replay installed (``replay``), and the weights back out
  (``export``, ``shard_weights``); ``cpu_compat`` lets megatron-core run on a CPU-only torch,
  ``megatron_fixes`` mends its bugs the trainer meets.
- ``rl``: the objective (``objective``), the passes on megatron's schedules (``schedule``), one
  RL step and its consistency report (``step``, ``metrics``), the optimizer (``optim``).
- ``parallel``: the world's process groups (``world``, ``single_process``) and what
  data-parallel ranks exchange (``dp``); ``reshard``: a batch cut for a layout, pure functions
  (no megatron, nothing else of the trainer).
- Here: ``config`` (YAML with dotted overrides), ``train`` (the loop), ``checkpoint``, ``tb``.

``python -m trainer`` runs steps. Nothing runs at import.
"""
