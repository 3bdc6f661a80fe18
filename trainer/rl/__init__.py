"""The RL step: the objective, the passes on megatron's schedules, the consistency report's
measurements and the optimizer."""
