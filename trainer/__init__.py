"""The Megatron trainer: the served Hugging Face model in megatron-core, with router replay.

Modules (one job each): ``cpu_compat`` (megatron-core on a CPU-only torch), ``hf_config`` (the
Hugging Face config as megatron's ``TransformerConfig``), ``hf_weights`` (the two-way weight
mapping), ``model`` (build a ``GPTModel`` with replay installed), ``replay`` (drive megatron's
``RouterReplay`` with a replay mask), ``batch`` (the padded batch layout), ``align`` (records to
per-router replay indices under that layout, and back), ``r2`` (R2's record pass), ``config``
(YAML with dotted overrides), ``distributed`` (the single-process group), ``data`` (records per
batch, prefetched), ``rl`` (reward, advantages, PPO loss), ``step`` (one RL step and its
consistency report), ``metrics``, ``optim``, ``train`` (the loop), ``hf_rollout`` (reference
rollout records from transformers). ``python -m trainer`` runs steps. Nothing runs at import.
"""
