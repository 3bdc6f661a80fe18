"""Router Replay inside verl: routes go from verl's rollout servers to the route cache and from
the route cache to each Megatron worker, so Ray carries sample ids instead of route tensors.

Two seams (docs/verl.md):

- ``verl_integration.rollout``: each ``generate()`` call of a sample (one turn, or one resume of
  a partial rollout) is written to the route cache as that sample's next turn, with the policy
  version that generated it (``TurnWriter``, ``AsyncTurnWriter``; ``RouteCacheGenerate`` is the
  drop-in for verl's server class).
- ``verl_integration.trainer``: a worker fetches its own micro-batches' records, only the MoE
  layers its pipeline stage replays, and builds ``batch["routed_experts"]`` in verl's layout
  (``RouteFetcher``), which verl's ``align_r3_router_replay_data``, ``build_r3_replay_mask`` and
  ``set_router_replay_data`` consume unchanged.

Neither module imports verl: they speak its data layout (``TokenOutput``'s fields, int16
``[tokens, num_hidden_layers, k]`` routes), so they run in any process that has the project.
"""
