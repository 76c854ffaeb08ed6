"""Local launch mode: the services as child processes on 127.0.0.1."""
