"""Synchronizer service: component states, sync policy, versioned weight buffers."""
