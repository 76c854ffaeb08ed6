"""The local launch mode: `python -m services.controller run FILE` (`launch`:
its options), a run driven from this process (`local_run`), and its parts:
the run file's launch section, preparing the model and data, supervising the
service processes it starts, a deployment's services, healing, progress and
the final report. Starting one service process is shared
(`flywheel.launcher.processes`)."""
