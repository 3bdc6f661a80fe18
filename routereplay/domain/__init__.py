"""The domain: the record and its checks, the route codec, a model's MoE geometry, records
files, route statistics and the Rollout's request and event types. No gRPC, no protobuf."""
