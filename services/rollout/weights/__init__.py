"""How weight versions reach the rollout: the one door a new version comes in by
(`arrival`), the update transaction it runs (`transaction`: transfer, admit,
apply, verify, reopen; the verify phase's judgement in `measure`), where the
bytes come from (`sources`: CHECKPOINT directories, the synchronizer's MEMORY
stream, the base model; `verify`: the checks every staged version passes;
`nccl`: a broadcast in a transfer group; `peers`: a site's replicas as
sources; `staging`, `deltas`: what lives between updates), and the rollout's
link to the synchronizer (`link`, `presence`, `follower`): with the MEMORY
pull of `engine/pull.py`, the only code of the rollout that talks to the
synchronizer."""
