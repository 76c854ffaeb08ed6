"""Controller service: runs the RL loop and reports on it."""
