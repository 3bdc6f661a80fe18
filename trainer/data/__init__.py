"""A step's data: samples and their rollout routes fetched, laid out as the batch the model
reads, and aligned to per-router replay indices."""
