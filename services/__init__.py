"""The four Flywheel services; run one with `python -m services.<name>`."""
