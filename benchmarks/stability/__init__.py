"""The RL stability study: real RL runs per replay mode through the pipeline, and the
per-step records and summaries they write."""
