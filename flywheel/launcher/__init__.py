"""Starting a service as a local child process (`processes`): free ports, a
ready file and a log, stopped by process group. `flywheel up`, the local run
(services/controller/launcher/), benchmarks and tests all start services this way.
"""
