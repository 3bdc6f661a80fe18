"""Trainer tests: layouts across ranks: data, tensor, context, pipeline and expert parallelism."""
