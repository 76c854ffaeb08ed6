"""The HTTP side of a remote judge (services/controller/tasks/judge.py): one
pooled client that POSTs a judgement's JSON body to `reward.judge.url` and
returns the parsed JSON answer (https verified against the system's CAs:
a judge is the user's service, not one of the cluster's). A non-2xx answer, a connection error or an
answer that is not JSON raises (the judge counts it as a failed call and
retries); the client's own timeout is the judge's per-call deadline, so no
socket outlives it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from services.controller.adapters.sessions import error_of
from services.controller.run_config import JudgeConfig


class HttpJudge:
    def __init__(self, config: JudgeConfig) -> None:
        self.url = config.url
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.timeout_seconds),
            limits=httpx.Limits(max_connections=config.max_concurrency,
                                max_keepalive_connections=config.max_concurrency),
        )

    async def post(self, body: dict[str, Any]) -> Any:
        # default=str: a dataset row may hold dates or other non-JSON values; the judge sees their text.
        response = await self._client.post(self.url, content=json.dumps(body, default=str),
                                           headers={"content-type": "application/json"})
        if response.is_error:
            raise error_of(response, f"judge {self.url}")
        try:
            return response.json()
        except ValueError:
            raise ValueError(f"judge {self.url}: the answer is not JSON: {response.text[:200]!r}") from None

    async def close(self) -> None:
        await self._client.aclose()
