"""What the data plane costs: each measurement against a baseline in the same run (the route
cache, the rollout server, the trainer, the layouts, the pipeline, the alternatives)."""
