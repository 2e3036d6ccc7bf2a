"""Test-tier: cluster tests: need the local Slurm cluster or vLLM's CPU build."""
