"""The arithmetic environment's action and observation (OpenEnv types)."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class ArithmeticAction(Action):
    """The model's reply: its final answer is the last \\boxed{} in it, else its last number."""

    message: str = Field(..., description="the model's reply")


class ArithmeticObservation(Observation):
    """What the model is shown: the question, then a word on its answer."""

    prompt: str = Field(default="", description="text shown to the model")
