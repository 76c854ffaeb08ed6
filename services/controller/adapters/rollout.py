"""A rollout service behind the controller's `RolloutEngine` protocol: a thin
user of the typed client (`flywheel.rollout.client`).

Prompts go out as token ids, text or chat messages, each generation tagged
with its run step and least weight version (the context's RUN_STEP and
MIN_WEIGHT_VERSION); samples come back as the controller's `Generation`s.
The controller moves no weights (the replica follows the synchronizer). The
replica's HTTP server (OpenAI API, agent sessions) is found from GetStatus's
`http_port` on the host of the gRPC address.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from flywheel.codec.dtypes import tensor_from_proto
from flywheel.common.kept import KeptSet, check_kept
from flywheel.common.provenance import VersionSpan, check_spans
from flywheel.common.types import SampledDistribution, finish_reason_from_pb, logprobs_mode_to_pb
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import DataLoss, FailedPrecondition
from flywheel.rollout.client import RolloutClient
from flywheel.rollout.v1 import rollout_pb2 as pb
from flywheel.runtime.tls import process_tls, scheme as tls_scheme
from services.controller.adapters.sessions import SessionClient
from services.controller.domain import (
    MIN_WEIGHT_VERSION,
    RUN_STEP,
    FinishReason,
    Generation,
    PromptInput,
    SamplingSpec,
)


def finish_reason(value: int) -> FinishReason:
    """An UNSPECIFIED or unknown reason (a newer rollout's) counts as an engine error."""
    try:
        return finish_reason_from_pb(value)
    except ValueError:
        return FinishReason.ERROR


#: SamplingSpec fields the wire's SamplingParams carries under the same name.
_SAMPLING_FIELDS = frozenset(cpb.SamplingParams.DESCRIPTOR.fields_by_name)


def prompt_like(p: PromptInput):
    if p.token_ids is not None:
        return list(p.token_ids)
    if p.messages is not None:
        return list(p.messages)
    return p.text or ""


def sampling_params(s: SamplingSpec) -> dict:
    """The spec as SamplingParams fields (unset seed left out; tuples as lists)."""
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(s).items() if k in _SAMPLING_FIELDS}
    if fields.get("seed") is None:
        fields.pop("seed", None)
    fields["logprobs_mode"] = logprobs_mode_to_pb(s.logprobs_mode)
    return fields


def http_host(address: str) -> str:
    """The host of a gRPC address ("host:port", "[::1]:port", "dns:///host:port")."""
    return address.split("///", 1)[-1].rsplit(":", 1)[0]


def generation(sample: cpb.Sample) -> Generation:
    spans = [VersionSpan(s.version, s.start, s.end) for s in sample.weight_version_spans]
    if spans:
        try:
            check_spans(spans, len(sample.completion_token_ids))
        except ValueError as exc:
            raise DataLoss(f"the rollout returned a sample whose {exc}") from None
    kept = [KeptSet(k.position, k.size, tuple(k.token_ids), k.constrained) for k in sample.kept_sets]
    routed = tensor_from_proto(sample.routed_experts).numpy() if sample.HasField("routed_experts") else None
    try:
        check_kept(kept, sample.completion_token_ids)
        if routed is not None and (routed.ndim != 3 or routed.shape[0] != max(
                len(sample.prompt_token_ids) + len(sample.completion_token_ids) - 1, 0)):
            raise ValueError(f"routed_experts of shape {list(routed.shape)} do not cover the "
                             f"{len(sample.prompt_token_ids)} + {len(sample.completion_token_ids)} - 1 tokens fed")
    except ValueError as exc:
        raise DataLoss(f"the rollout returned a sample whose {exc}") from None
    return Generation(
        prompt_token_ids=list(sample.prompt_token_ids),
        completion_token_ids=list(sample.completion_token_ids),
        completion_logprobs=list(sample.completion_logprobs),
        finish_reason=finish_reason(sample.finish_reason),
        version_start=sample.weight_version_start,
        version_end=sample.weight_version_end,
        text=sample.text,
        distribution=SampledDistribution.from_pb(sample.logprobs_distribution),
        version_spans=spans,
        kept_sets=kept,
        routed_experts=routed,
    )


class GrpcRolloutEngine:
    def __init__(
        self, address: str, *, token: str | None = None, timeout: float = 600.0, name: str | None = None,
        max_attempts: int = 2,
    ) -> None:
        self.name = name or address
        self.address = address
        # Few transport retries: the engine pool fails over to another replica
        # faster than backing off on a dead one.
        self.client = RolloutClient(address, token=token, timeout=timeout, max_attempts=max_attempts)
        self._token = token
        self._sessions: SessionClient | None = None

    async def close(self) -> None:
        await self.client.close()
        if self._sessions is not None:
            await self._sessions.close()

    async def generate(self, prompts: Sequence[PromptInput], sampling: SamplingSpec) -> list[list[Generation]]:
        results = await self.client.generate(
            [prompt_like(p) for p in prompts], request_ids=[p.request_id for p in prompts],
            run_step=RUN_STEP.get(), min_weight_version=MIN_WEIGHT_VERSION.get(), **sampling_params(sampling),
        )
        return [[generation(s) for s in samples] for samples in results]

    async def tokenize(
        self, *, text: str | None = None, messages: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        if messages is not None:
            return await self.client.tokenize(messages, add_generation_prompt=add_generation_prompt)
        return await self.client.tokenize(text or "")

    async def http_url(self) -> str:
        """The replica's HTTP root, "http://host:port" ("https" when this process calls with TLS)."""
        port = (await self.client.status()).http_port
        if not port:
            raise FailedPrecondition(f"rollout {self.name} reports no HTTP port: its OpenAI-compatible API is not up")
        return f"{tls_scheme(process_tls())}://{http_host(self.address)}:{port}"

    async def sessions(self) -> SessionClient:
        # The port is asked for every time (one small call per episode): a replica that
        # restarts on the same id may serve HTTP on another port (http_port 0 picks a free one).
        url = await self.http_url()
        previous = self._sessions
        if previous is None or previous.http_url != url:
            self._sessions = SessionClient(url, token=self._token)  # set before awaiting: one client per URL
            if previous is not None:
                await previous.close()
        return self._sessions
