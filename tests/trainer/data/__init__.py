"""Trainer tests: the step's records: sources, the ready feed, stage reads (trainer/data/)."""
