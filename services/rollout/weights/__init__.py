"""How weight versions reach the rollout, one module per transport (`verify`:
CHECKPOINT directories and the checks every version passes, `memory`: the
synchronizer's MEMORY stream, `nccl`: a broadcast in a transfer group), and
the rollout's link to the synchronizer (`link`, `presence`, `follower`): the
only code of the rollout that talks to the synchronizer."""
