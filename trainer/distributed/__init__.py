"""The world of trainer processes: megatron's process groups over it, and what data-parallel
ranks exchange (the step's collectives). The parallel sizes are ``trainer.sharding.Parallelism``.
"""
