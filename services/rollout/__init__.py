"""Rollout service (Rollout-as-a-Service): an inference engine behind gRPC and HTTP."""
