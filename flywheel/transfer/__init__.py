"""Weight transport shared by the trainer, rollouts and the synchronizer.

`frames`: push/pull weight-stream frames (protobuf wire bytes) without
re-serializing payloads. `broadcast`: the NCCL/gloo process-group broadcast
of packed weight buckets (trainer = rank 0, rollouts receive, stage, and
apply only when the synchronizer commits the transfer).
"""
