"""The OpenAI-compatible HTTP API of the rollout (FastAPI routes in `http_api`):
its protocol models, streaming bodies, the Responses API, chat turns with tools
and output constraints, and agent sessions. Named so as not to shadow the
`openai` package."""
