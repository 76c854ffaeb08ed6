"""Plumbing every service shares: configuration, logging, metrics, the gRPC
server bootstrap (health, reflection, auth, error mapping) and client channels."""
