"""Flywheel: the shared library of the four services and the generated API stubs.

`flywheel.<service>.v1` are the gRPC contracts (generated from `protos/`);
`flywheel.runtime` is the server/client plumbing every service uses;
`flywheel.codec` turns state dicts into weight chunks and back;
`flywheel.models` builds tiny test models and converts the demo model.
Importing this package imports nothing heavy (no torch, no vllm).
"""
