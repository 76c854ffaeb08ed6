"""The arithmetic environment's server: OpenEnv's HTTP and WebSocket app (reset, step, state; a
session per WebSocket at /ws).

    .venv-openenv/bin/python -m uvicorn server.app:app --app-dir examples/openenv/arithmetic --port 8000
"""

from openenv.core.env_server.http_server import create_app

try:
    from ..models import ArithmeticAction, ArithmeticObservation
    from .arithmetic_environment import ArithmeticEnvironment
except ImportError:
    from models import ArithmeticAction, ArithmeticObservation
    from server.arithmetic_environment import ArithmeticEnvironment

app = create_app(ArithmeticEnvironment, ArithmeticAction, ArithmeticObservation, env_name="arithmetic",
                 max_concurrent_envs=64)
