"""The project's benchmarks, by purpose: ``performance/`` (what the data plane costs against
its baselines), ``faults/`` (the fault run and the lifecycle run) and ``stability/`` (the RL
stability study). Each runs from the repository root as ``python -m
benchmarks.<purpose>.<name>``, and all of them through ``make bench`` (``run_all``); the
timing, the machine's description and the docs sections they share are ``common``."""
