"""docker-compose.yml: valid against the official Compose schema (vendored, see
tests/fixtures/README.md), and wired the way the README promises. No Docker engine runs
here, so this is what CI can check of the stack short of starting it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "compose-spec.json").read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def schema_errors(document: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(document)]


def test_the_compose_file_is_valid_against_the_compose_schema(compose):
    assert schema_errors(compose) == []


def test_the_schema_check_rejects_a_broken_file(compose):
    broken = json.loads(json.dumps(compose))
    broken["services"]["redis"]["helthcheck"] = broken["services"]["redis"].pop("healthcheck")
    broken["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] = [1]
    errors = sorted(schema_errors(broken))
    assert len(errors) == 2
    assert errors[0].startswith("services/redis: 'helthcheck' does not match")
    assert errors[1].startswith("services/worker/deploy/resources/reservations/devices/0/count")


def services_in_profile(compose: dict, profile: str) -> set[str]:
    """The services `docker compose --profile <profile> up` starts."""
    return {name for name, service in compose["services"].items()
            if not service.get("profiles") or profile in service["profiles"]}


def test_each_profile_starts_the_whole_stack_with_one_worker(compose):
    assert services_in_profile(compose, "gpu") == {"redis", "worker", "prometheus", "grafana"}
    assert services_in_profile(compose, "cpu") == {"redis", "worker-cpu", "prometheus", "grafana"}


def test_redis_is_persistent_and_workers_wait_until_it_is_healthy(compose):
    redis = compose["services"]["redis"]
    assert "redis-cli" in redis["healthcheck"]["test"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    for name in ("worker", "worker-cpu"):
        assert compose["services"][name]["depends_on"] == {"redis": {"condition": "service_healthy"}}


def test_the_gpu_worker_reserves_a_gpu_and_the_cpu_worker_does_not(compose):
    gpu, cpu = compose["services"]["worker"], compose["services"]["worker-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in cpu
    assert gpu["build"]["dockerfile"] == "ops/docker/Dockerfile.cuda"
    assert cpu["build"]["dockerfile"] == "ops/docker/Dockerfile.cpu"
    assert '".[gpu]"' in (ROOT / "ops/docker/Dockerfile.cuda").read_text()  # the CUDA image has the gpu extra
    assert "whl/cpu" in (ROOT / "ops/docker/Dockerfile.cpu").read_text()  # the CPU image, torch's CPU wheel


def test_prometheus_finds_the_workers_and_grafana_is_provisioned(compose):
    services = compose["services"]
    prometheus_config = yaml.safe_load((ROOT / "ops/prometheus/prometheus.yml").read_text())
    discovery = prometheus_config["scrape_configs"][0]["dns_sd_configs"][0]
    for name in ("worker", "worker-cpu"):
        worker = services[name]
        assert discovery["names"] == worker["networks"]["default"]["aliases"]
        assert f"--metrics-port {discovery['port']}" in worker["entrypoint"][2]
    assert "./ops/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]

    mounts = dict(volume.rsplit(":", 1)[0].split(":", 1) for volume in services["grafana"]["volumes"]
                  if volume.startswith("./"))
    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((ROOT / "ops/grafana/provisioning/dashboards/inflight.yml").read_text())
    assert mounts["./ops/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    datasource = yaml.safe_load((ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    for relative in mounts:
        assert (ROOT / relative).is_dir(), relative
