"""Test-tier: integration tests: start real processes (router, replicas, MPI ranks, launch)."""
