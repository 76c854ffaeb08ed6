"""The controller as a service, seen by an operator: the runs it holds
(`runs`: start one from YAML, stop it, its status) and the status page that
follows one live (`status_page`, `static/status.html`). The gRPC servicer
and the assembly of the service stay at the top (`servicer.py`, `app.py`)."""
