"""What a run records about itself: work in flight and busy time per
component (`activity`), every error met and the policy that stops the run
on them (`errors_report`), per-step metrics and where they go (`metrics_log`:
JSONL, TensorBoard, W&B, Prometheus, memory), and the Prometheus families
(`metrics`)."""
