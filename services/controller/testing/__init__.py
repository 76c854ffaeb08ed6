"""Stand-ins for tests and the pipeline benchmark only: simulated trainer,
rollout replicas and synchronizer behind the controller's Protocols
(`simulated`). Nothing a run is built from imports this package."""
