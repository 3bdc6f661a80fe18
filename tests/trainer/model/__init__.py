"""Trainer tests: megatron-core model mapping, weights and router replay (trainer/model/)."""
