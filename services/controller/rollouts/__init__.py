"""Rollouts, from a task to scored trajectories in the pool. The manager keeps
many in flight (`manager`), each done by a worker (`workers/`) on a replica
the engine pool picks (`balancer`); which replicas are in the pool is the
synchronizer's registry (`membership`), whether they answer is the health
checks' (`liveness`, which watches the trainer too). Agent sessions are
rebuilt into episodes (`episodes`), and the validator runs the same workers
over the validation set (`validation`)."""
