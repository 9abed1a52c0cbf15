"""Mesh, logical sharding rules, sharded wrappers of the rollout and the update, multi-host start-up."""
