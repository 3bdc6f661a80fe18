"""The route cache: a stateless gRPC service that stores records in Redis or Redis Cluster."""
