"""Helpers the tests and the benchmarks share, kept out of the shipped packages: each one
builds inputs or reads outputs the way a test wants them, and production never calls it."""
