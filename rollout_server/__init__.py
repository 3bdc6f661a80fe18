"""Rollout server: the gRPC service around the generation engine."""
