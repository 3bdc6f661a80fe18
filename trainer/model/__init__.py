"""The model and its weights: the Hugging Face checkpoint in megatron-core, router replay
installed, and the weights back out (export, per-rank shards)."""
