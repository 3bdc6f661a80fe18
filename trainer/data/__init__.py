"""A step's data, fetched: samples and their rollout records from a file or the route cache
(``source``: the sources, the batch plan, the prefetcher), and, under model parallelism, each
stage's layers read once and shared with its group (``stage_reads``). Laying them out for a
rank is ``trainer.layout``'s."""
