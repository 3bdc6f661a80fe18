"""Router Replay inside verl: routes go from verl's rollout servers to the route cache and from
the route cache to each Megatron worker, so Ray carries sample ids instead of route tensors.

Two seams (docs/verl.md), installed by ``plugin`` (verl's ``verl.plugins`` entry point):

- ``rollout``: each ``generate()`` call of a sample (one turn, or one resume of a partial
  rollout) is written to the route cache as that sample's next turn, with the policy version
  that generated it (``TurnWriter``; ``RouteCacheGenerate`` in front of verl's server class),
  under the agent loop's sample id, which verl's client carries in its request ids.
- ``engine``: verl's Megatron engine (``RouteCacheEngine``) fetches each batch's routes
  (``fetch.RouteFetcher``: this stage's layers, one read per TP/CP group) before megatron's
  schedule, and routes natively where no route was recorded.

``contract`` holds what both sides agree on (the id field, the geometry, the route cache's
address). ``rollout``, ``fetch`` and ``contract`` import no verl module: they speak its data
layout (``TokenOutput``'s fields, int16 ``[tokens, num_hidden_layers, k]`` routes).
"""
