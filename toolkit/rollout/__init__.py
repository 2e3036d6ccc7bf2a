"""Rollout ranks: sessions against the router, merged into samples on the rank, gathered over MPI."""
