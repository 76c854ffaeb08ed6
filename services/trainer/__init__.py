"""Trainer service (Training-as-a-Service): policy, RL losses, checkpoints, weight export."""
