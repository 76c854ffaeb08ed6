"""The local launch mode's run-specific parts: the run file's launch section, preparing
the model and data, supervising the service processes it starts, progress and the
final report. Starting one service process is shared (`flywheel.launcher.processes`)."""
