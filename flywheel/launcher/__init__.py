"""Local launch mode: the services as child processes on 127.0.0.1.

- `processes`: one child service on free ports, its ready file and log, stop by process group;
- `supervisor`: the children of a run, started, awaited, watched and stopped together;
- `spec`: the `launch:` section of a run file and the `resume:` shorthands;
- `prepare` / `dataset`: the model directory and the generated arithmetic data;
- `progress` / `report`: the live progress line, summary.json and progress.png.

The run itself (the controller's pipeline driven in the launcher's process)
is `services/controller/local_run.py`, started by `python -m services.controller run`.
"""
