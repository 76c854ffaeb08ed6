"""deploy/compose/docker-compose.remote-site.yml, read the way `docker compose -f docker-compose.yml -f
<it>` reads it and resolved through the services' own config code: a relay of the run's synchronizer
and a replica that pulls through it, both only under the remote-site profile."""

from __future__ import annotations

from tests.deploy.manifests import ROOT, compose_containers, compose_mounts, load_compose, resolved

OVERRIDE = ROOT / "deploy" / "compose" / "docker-compose.remote-site.yml"
VARIABLES = {"FLYWHEEL_UPSTREAM": "central.example:50051", "FLYWHEEL_SITE": "eu-west",
             "FLYWHEEL_ROLLOUT_ADDRESS": "far-host.example:50053"}


def _remote_site():
    containers = {c.name: c for c in compose_containers(load_compose(VARIABLES, overrides=(OVERRIDE,)))}
    return containers["relay"], containers["rollout-remote"]


def test_the_relay_relays_the_run_synchronizer_for_its_site_and_is_reached_where_it_says():
    relay, replica = _remote_site()
    config = resolved(relay)
    assert config.relay is not None
    assert (config.relay.upstream, config.relay.site) == ("central.example:50051", "eu-west")
    assert config.shared_memory_dir == ""  # its readers are other containers
    host, port = config.relay.advertise_address.rsplit(":", 1)
    assert host == relay.name and int(port) == config.server.port
    assert relay.raw["healthcheck"]["test"][-1] == f"127.0.0.1:{config.server.port}"


def test_the_far_replica_registers_with_the_run_synchronizer_and_pulls_through_its_sites_relay():
    relay, replica = _remote_site()
    config = resolved(replica)
    assert config.synchronizer.address == "central.example:50051"
    assert config.synchronizer.site == resolved(relay).relay.site
    assert config.synchronizer.advertise_address == "far-host.example:50053"
    assert config.updates.delta_pulls in ("auto", "on")
    assert replica.raw["depends_on"]["relay"]["condition"] == "service_healthy"
    assert all(str(path) != "/weights-shm" for path in compose_mounts(replica))  # no shared memory across the link


def test_the_remote_site_starts_only_under_its_profile():
    for c in _remote_site():
        assert c.raw["profiles"] == ["remote-site"], c.source
