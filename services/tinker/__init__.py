"""The Tinker gateway: Thinking Machines' Tinker API (SDK `tinker==0.38`) served
over a Flywheel trainer, so the official SDK and its cookbook train on a
self-hosted Flywheel unmodified (docs/tinker.md)."""
