"""The controller's status page and what feeds it: the synchronizer's view of
every component (observer), the run's milestones, and the JSON the page polls,
with the run's services simulated."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import yaml

from flywheel.runtime.auth import Scope, TokenScopes
from flywheel.runtime.server_config import ServerConfig
from flywheel.synchronizer.client_types import WatchEvent
from flywheel.synchronizer.types import Component, EventKind, Identity, Method, Role, State
from services.controller.assemble import Services, build_pipeline
from services.controller.loop import run
from services.controller.weights.observer import SynchronizerObserver
from services.controller.run_config import run_config_from_yaml
from services.controller.ops.runs import RunManager
from services.controller.testing.simulated import SimulatedRolloutEngine, SimulatedTrainer, constant, simulated_services
from services.controller.ops.status_page import create_app, status_json, status_link
from tests.unit.controller.controller_helpers import items


def event(kind: EventKind, component: Component | None = None, version: int = 0, seq: int = 1) -> WatchEvent:
    return WatchEvent(kind, seq, 1_000 * seq, version, component, version,
                      Method.MEMORY if kind == EventKind.VERSION_COMMITTED else None, "", None, None, "")


def rollout(cid: str, version: int, state: State = State.RUNNING) -> Component:
    return Component(Identity(Role.ROLLOUT, cid, address=f"{cid}:50053"), state=state, weight_version=version)


def test_the_observer_keeps_every_component_and_a_timeline_of_syncs(tmp_path: Path) -> None:
    async def none(_: bool):
        yield  # pragma: no cover

    observer = SynchronizerObserver(none, tmp_path)
    observer.observe(event(EventKind.COMPONENT_REGISTERED, rollout("r0", 0), seq=1))
    observer.observe(event(EventKind.COMPONENT_REGISTERED, rollout("r1", 0), seq=2))
    observer.observe(event(EventKind.VERSION_COMMITTED, version=1, seq=3))
    observer.observe(event(EventKind.STATE_CHANGED, rollout("r0", 1), seq=4))
    observer.observe(event(EventKind.STATE_CHANGED, rollout("r0", 1, State.REQUIRE_SYNC), seq=5))  # same version
    observer.observe(event(EventKind.COMPONENT_EXPIRED, rollout("r1", 0, State.STOPPED), seq=6))

    assert {c: (v.weight_version, v.state) for c, v in observer.components.items()} == {
        "r0": (1, State.REQUIRE_SYNC), "r1": (0, State.STOPPED)}
    kinds = [(e["kind"], e.get("id"), e.get("version")) for e in observer.timeline]
    assert kinds == [
        ("COMPONENT_REGISTERED", "r0", None), ("COMPONENT_REGISTERED", "r1", None), ("VERSION_COMMITTED", None, 1),
        ("WEIGHTS_APPLIED", "r0", 1), ("COMPONENT_EXPIRED", "r1", None),
    ]
    assert (tmp_path / "synchronizer_events.jsonl").read_text().count("\n") == 6  # every event is still logged


def simulated(cfg) -> Services:
    return simulated_services(SimulatedTrainer(train_time=constant(0.002)),
                    [SimulatedRolloutEngine(gen_time=constant(0.001), rng=random.Random(0))])


RUN = {
    "run": {"name": "page", "max_steps": 6},
    "data": {"train": {"items": items(400)}, "validation": {"items": items(8)}},
    "worker": {"type": "math", "group_size": 2, "max_in_flight": 4},
    "algorithm": {"train_batch_size": 4},
    "validation": {"interval": 3, "before_training": True},
    "checkpoint": {"interval": 2, "at_end": True},
    "metrics": {"jsonl": False},
}


async def test_an_adopted_run_is_reported_live_then_completed(tmp_path: Path) -> None:
    cfg = run_config_from_yaml(yaml.safe_dump(RUN))
    pipeline = build_pipeline(cfg, simulated(cfg), run_dir=tmp_path)
    # A synchronizer's view, as the observer would have it.
    async def none(_: bool):
        yield  # pragma: no cover

    pipeline.observer = SynchronizerObserver(none, None)
    pipeline.observer.observe(event(EventKind.COMPONENT_REGISTERED, rollout("rollout-a", 0), seq=1))

    runs = RunManager(tmp_path, simulated)
    task = asyncio.ensure_future(run(pipeline))
    runs.adopt("page-run", tmp_path, pipeline, task)
    assert runs.status().phase == "running"
    await task
    await asyncio.sleep(0)  # the done callback
    s = runs.status()
    assert s.phase == "completed" and s.step == 6 and "max_steps" in s.message

    page = status_json(s)
    assert [c["id"] for c in page["components"]] == ["rollout-a"]
    assert page["components"][0]["behind"] == 6  # the simulated replica never moved past version 0
    assert [step for step, _ in page["curves"]["reward"]] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in page["curves"]["validation"]] == [0, 3, 6]
    assert page["curves"]["validation_metric"] == "val/accuracy"
    milestones = [(e["kind"], e["step"]) for e in page["timeline"] if e["kind"] in ("VALIDATION", "CHECKPOINT")]
    assert milestones == [("VALIDATION", 0), ("CHECKPOINT", 2), ("VALIDATION", 3), ("CHECKPOINT", 4),
                          ("VALIDATION", 6), ("CHECKPOINT", 6)]
    assert set(page["staleness"]) == {"mean", "min", "max"}


async def test_the_page_and_its_json_are_served(tmp_path: Path) -> None:
    runs = RunManager(tmp_path, simulated)
    app = create_app(runs, TokenScopes())  # auth off (local development): the JSON is open
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://page") as client:
        html = await client.get("/")
        assert html.status_code == 200 and "text/html" in html.headers["content-type"]
        assert 'id="components"' in html.text and "api/status" in html.text
        idle = await client.get("/api/status")
        assert idle.status_code == 200 and idle.headers["cache-control"] == "no-store"
        assert idle.json()["phase"] == "idle" and idle.json()["components"] == []
        await runs.start(yaml.safe_dump(RUN), "live")
        for _ in range(500):
            body = (await client.get("/api/status")).json()
            if body["phase"] in ("completed", "failed"):
                break
            await asyncio.sleep(0.01)
        assert body["run_id"] == "live" and body["phase"] == "completed", body
        assert len(body["curves"]["reward"]) == 6
        assert (await client.post("/api/status")).status_code == 405  # read-only


async def test_with_tokens_the_json_needs_a_viewer_token_and_the_page_holds_no_data(tmp_path: Path) -> None:
    runs = RunManager(tmp_path, simulated)
    await runs.start(yaml.safe_dump(RUN), "private")
    tokens = TokenScopes.of({Scope.VIEWER: ["v1"], Scope.AGENT: ["a1"], Scope.OPERATOR: ["o1"]})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(runs, tokens)),
                                 base_url="http://page") as client:
        html = await client.get("/")
        assert html.status_code == 200 and "private" not in html.text  # the shell only: data comes with a token
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "v1"}):
            refused = await client.get("/api/status", headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer", headers
            assert refused.json() == {"error": "missing or wrong bearer token"} and "private" not in refused.text
        for token in ("v1", "a1", "o1"):  # viewer, and every scope above it
            served = await client.get("/api/status", headers={"authorization": f"Bearer {token}"})
            assert served.status_code == 200 and served.json()["run_id"] == "private", token
    await runs.close()


def test_the_launcher_links_the_page_with_a_viewer_token_only(tmp_path: Path) -> None:
    url = "http://127.0.0.1:8080/"
    assert status_link(url, ServerConfig()) == url  # auth off: nothing to add
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("viewer: v1\nagent: a1\noperator: o1\n")
    assert status_link(url, ServerConfig(tokens_file=tokens)) == url + "#token=v1"
    tokens.write_text("agent: a1\noperator: o1\n")
    linked = status_link(url, ServerConfig(tokens_file=tokens))
    assert "a1" not in linked and "o1" not in linked and "#token=<a viewer token>" in linked


def test_a_quarantined_replica_and_its_update_results_show_on_the_page(tmp_path: Path) -> None:
    from dataclasses import replace

    from flywheel.synchronizer.types import UpdateOutcome, UpdatePhase, UpdateRecord, UpdateTimings
    from services.controller.ops.runs import RunStatus

    async def none(_: bool):
        yield  # pragma: no cover

    observer = SynchronizerObserver(none, tmp_path)
    bad = replace(rollout("r1", 2), quarantined=True, quarantine_reason="verify of version 2 failed: 1 tensor(s) differ")
    failed = UpdateRecord("r1", 2, UpdateOutcome.FAILED, failed_phase=UpdatePhase.VERIFY, reason="1 tensor(s) differ")
    ok = UpdateRecord("r0", 2, UpdateOutcome.VERIFIED, resident_identity=b"\x01" * 16,
                      timings=UpdateTimings(0.01, 0.2, 0.03, 0.02, 0.001, 0.061))
    observer.observe(replace(event(EventKind.UPDATE_REPORTED, rollout("r0", 2), version=2, seq=1), update=ok))
    observer.observe(replace(event(EventKind.UPDATE_REPORTED, bad, version=2, seq=2), update=failed))
    timeline = observer.timeline
    assert [(e["kind"], e["update"]["outcome"]) for e in timeline] == [
        ("UPDATE_REPORTED", "VERIFIED"), ("UPDATE_REPORTED", "FAILED")]
    assert timeline[0]["update"]["pause_seconds"] == 0.061 and timeline[1]["update"]["failed_phase"] == "VERIFY"
    assert timeline[1]["quarantined"].startswith("verify of version 2 failed")
    # The JSON the page renders: the replica's row says why it takes no traffic.
    fields = {f for f in RunStatus.__dataclass_fields__}
    s = RunStatus(**{f: None for f in fields})
    s = replace(s, components=list(observer.components.values()), trainer_version=2, history=[], timeline=list(timeline),
                errors=[], run_id="r", phase="running", mode="sync", message="", step=2, total_steps=4, pool_size=0,
                in_flight=0)
    page = status_json(s)
    rows = {c["id"]: c for c in page["components"]}
    assert rows["r1"]["quarantined"].startswith("verify of version 2 failed") and rows["r0"]["quarantined"] is None
