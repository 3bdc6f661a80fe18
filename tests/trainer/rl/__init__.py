"""Trainer tests: the RL step (trainer/rl/) and its optimizer."""
