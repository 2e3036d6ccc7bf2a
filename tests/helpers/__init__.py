"""Helpers shared by the test tiers: envs, agents and hints named by Hydra targets, scripts, data."""
