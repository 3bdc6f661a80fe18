"""What megatron-core 0.16.1 needs beyond the model mapping, each applied by ``build``:
``cpu_compat`` (a CPU-only torch, applied only without CUDA), ``mla_compat`` (multi-head
latent attention with local modules, and its gradient under tensor parallelism) and
``megatron_fixes`` (its bugs the trainer meets, on every device)."""
