"""The project's benchmarks: each runs from the repository root as
``python -m benchmarks.<name>``, and all of them through ``make bench`` (``run_all``)."""
