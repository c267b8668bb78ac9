"""The docker backend on a real engine: images, a hardened farm, OOM restarts, cleanup.

Skipped when no engine answers, unless ENVSCALER_REQUIRE_DOCKER=1 (set by .ci/run): then they fail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading

import httpx
import pytest

from envscaler import default_catalog, load_bundle
from servers.farm.backends.images import LABEL_ENV, LABEL_FARM, LABEL_HASH, docker_answers, env_image_tag
from tests.support.bundles import counter_scenario, counter_spec, write_bundle
from tests.support.cli import envscaler
from tests.support.farm import farm_with_its_port_taken, read_state
from tests.support.gateway import replay_through_gateway
from tests.support.hostile import HOSTILE_CODE, attack, common_attacks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.docker

if not docker_answers():
    if os.environ.get("ENVSCALER_REQUIRE_DOCKER") == "1":
        raise RuntimeError("ENVSCALER_REQUIRE_DOCKER=1 but no Docker engine answers: run .ci/docker-setup.sh")
    pytest.skip("no Docker engine answers (set ENVSCALER_REQUIRE_DOCKER=1 to make this a failure)", allow_module_level=True)

import docker  # noqa: E402 - only once an engine is known to answer

# The counter with the hostile tools (tests.support.hostile) and one that eats memory.
HOG_CODE = HOSTILE_CODE.replace(
    "    def _secret(self) -> dict:",
    '    def hog(self) -> dict:\n        """Allocate memory without bound."""\n'
    "        blocks = []\n        while True:\n            blocks.append(b\"x\" * (64 * 1024 * 1024))\n\n"
    "    def _secret(self) -> dict:",
)
# Building the runtime image after a code change takes minutes.
DOCKER_TIMEOUT_S = 300



@pytest.fixture(scope="module")
def engine():
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture(scope="module")
def farm(tmp_path_factory, engine):
    root = tmp_path_factory.mktemp("docker-farm")
    counter = write_bundle(root / "bundles", counter_spec(env_class_code=HOG_CODE), [counter_scenario()])
    catalog = root / "farm.json"
    up = envscaler("farm", "up", str(counter), str(default_catalog() / "online_retail"), str(default_catalog() / "it_helpdesk"),
                   "--backend", "docker", "--catalog", str(catalog), "--memory-mb", "128", "--probe-period", "1", timeout=600)
    assert up.returncode == 0, up.stderr
    yield catalog
    envscaler("farm", "down", "--catalog", str(catalog), timeout=DOCKER_TIMEOUT_S)


def container_of(engine, catalog, env_id):
    farm_id = read_state(catalog)["farm_id"]
    [container] = engine.containers.list(filters={"label": [f"{LABEL_FARM}={farm_id}", f"{LABEL_ENV}={env_id}"]})
    return container


def test_build_tags_by_spec_hash_and_rebuilding_is_a_no_op(engine):
    bundle = default_catalog() / "library_circulation"
    first = envscaler("build", str(bundle), timeout=DOCKER_TIMEOUT_S)
    assert first.returncode == 0, first.stderr
    spec_hash = load_bundle(bundle).spec.content_hash()
    tag = env_image_tag("library_circulation", spec_hash)
    image = engine.images.get(tag)
    assert image.labels[LABEL_ENV] == "library_circulation" and image.labels[LABEL_HASH] == spec_hash
    again = envscaler("build", str(bundle), timeout=DOCKER_TIMEOUT_S)
    assert again.returncode == 0 and again.stdout.startswith("cached ") and tag in again.stdout
    assert engine.images.get(tag).id == image.id


def test_an_environment_image_installs_the_python_requirements_its_bundle_declares(engine, tmp_path):
    # iniconfig: small, pure Python, installed here (pytest needs it), not in the runtime image.
    bundle = write_bundle(tmp_path, counter_spec(requires=["iniconfig>=1"]), [counter_scenario()])
    built = envscaler("build", str(bundle), timeout=DOCKER_TIMEOUT_S)
    assert built.returncode == 0, built.stderr
    tag = env_image_tag("counter", load_bundle(bundle).spec.content_hash())
    probe = "import iniconfig, os; from envscaler.requirements import unmet; print(os.getuid(), unmet(['iniconfig>=1']))"
    output = engine.containers.run(tag, entrypoint=["python3", "-c", probe], remove=True)
    assert output.decode().split() == ["10001", "[]"]


def test_reference_replay_through_the_gateway_scores_one(farm):
    replay = replay_through_gateway(farm, "it_helpdesk")
    assert replay.mcp_url.startswith(replay.gateway)
    assert replay.score == 1.0


def test_every_container_is_hardened(farm, engine):
    container = container_of(engine, farm, "online_retail")
    config, host = container.attrs["Config"], container.attrs["HostConfig"]
    assert config["User"] == "10001:10001"
    assert host["ReadonlyRootfs"] is True and "/tmp" in host["Tmpfs"]
    assert host["CapDrop"] == ["ALL"] and not host.get("CapAdd")
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["Memory"] == 128 * 1024 * 1024 and host["MemorySwap"] == host["Memory"]
    assert host["NanoCpus"] == 1_000_000_000 and host["PidsLimit"] == 128
    [network_name] = container.attrs["NetworkSettings"]["Networks"]
    network = engine.networks.get(network_name)
    assert network.attrs["Internal"] is True and network.attrs["Labels"][LABEL_FARM] == read_state(farm)["farm_id"]
    assert not container.attrs["NetworkSettings"]["Ports"].get("8000/tcp")  # Docker publishes nothing: the farm does

    probe = container.exec_run(["python3", "-c", "import os, json; print(json.dumps([os.getuid(), os.getgid(), sorted(os.environ)]))"])
    uid, gid, names = json.loads(probe.output)
    assert (uid, gid) == (10001, 10001)
    # Only what the image and the farm set: nothing from the host's environment.
    assert set(names) <= {"ENVSCALER_TOKEN", "HOME", "HOSTNAME", "PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
                          "MALLOC_ARENA_MAX", "LANG", "GPG_KEY", "PYTHON_VERSION", "PYTHON_SHA256", "LC_CTYPE"}
    written = container.exec_run(["python3", "-c", "open('/etc/x', 'w')"])
    assert written.exit_code != 0 and b"Read-only file system" in written.output
    capabilities = container.exec_run(["python3", "-c", "print(open('/proc/self/status').read())"]).output.decode()
    assert "CapEff:\t0000000000000000" in capabilities and "NoNewPrivs:\t1" in capabilities


def test_the_port_is_published_on_loopback_only(farm, engine):
    endpoint = json.loads(farm.read_text())["envs"]["online_retail"]
    url = httpx.URL(endpoint["url"])
    assert url.host == "127.0.0.1"
    assert httpx.get(f"{url}/healthz").json()["env_id"] == "online_retail"
    container = container_of(engine, farm, "online_retail")
    # The host's address on the farm's bridge is one of its own non-loopback addresses.
    host_ip = next(iter(container.attrs["NetworkSettings"]["Networks"].values()))["Gateway"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host_ip, url.port), timeout=3)


def test_no_egress_not_even_to_the_host(farm, engine):
    container = container_of(engine, farm, "online_retail")
    routes = container.exec_run(["python3", "-c", "print(open('/proc/net/route').read())"]).output.decode().splitlines()[1:]
    # Destination 00000000 is the default route: without one, nothing off the container's subnet is routable.
    assert routes and all(line.split()[1] != "00000000" for line in routes if line.strip())
    # So the kernel refuses an off-subnet connect before any packet is sent (TEST-NET-1 would go nowhere anyway).
    unreachable = container.exec_run(["python3", "-c", (
        "import socket\ns = socket.socket(); s.settimeout(3)\n"
        "try:\n    s.connect(('192.0.2.1', 80)); print('CONNECTED')\nexcept OSError as e:\n    print(e.errno)")])
    assert unreachable.output.strip() == b"101"  # ENETUNREACH
    gateway_ip = next(iter(container.attrs["NetworkSettings"]["Networks"].values()))["Gateway"]
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    port = listener.getsockname()[1]
    # The host's own address on the container's bridge: the only place it could route to at all.
    probe = container.exec_run(["python3", "-c", (
        "import socket\ns = socket.socket(); s.settimeout(3)\n"
        f"try:\n    s.connect(('{gateway_ip}', {port})); print('CONNECTED')\nexcept OSError as e:\n    print('refused', e)")])
    listener.close()
    assert b"CONNECTED" not in probe.output and not accepted
    # The same listener is reachable from the host itself, so the probe would have seen it.
    assert gateway_ip and port


def test_hostile_tools_fail_in_their_container_while_others_answer(farm):
    attacks = common_attacks(farm, default_catalog() / "online_retail")
    attacks["write", json.dumps({"path": "/usr/pwned"})] = "Read-only file system"
    attack(farm, "counter", "online_retail", attacks)


def test_a_container_cannot_reach_a_sibling(farm, engine):
    sibling = container_of(engine, farm, "it_helpdesk")
    sibling_ip = next(iter(sibling.attrs["NetworkSettings"]["Networks"].values()))["IPAddress"]
    probe = container_of(engine, farm, "online_retail").exec_run(["python3", "-c", (
        "import socket\ns = socket.socket(); s.settimeout(3)\n"
        f"try:\n    s.connect(('{sibling_ip}', 8000)); print('CONNECTED')\nexcept OSError as e:\n    print('blocked', e)")])
    assert sibling_ip and b"blocked" in probe.output, probe.output
    # The sibling does listen there: the daemon's proxy (on the host) reaches it.
    assert httpx.get(json.loads(farm.read_text())["envs"]["it_helpdesk"]["url"] + "/healthz", timeout=5).status_code == 200


def test_environment_code_out_of_memory_costs_only_its_call_and_the_container_keeps_serving(farm):
    catalog = json.loads(farm.read_text())
    counter = catalog["envs"]["counter"]
    others = [catalog["envs"][e]["url"] for e in ("online_retail", "it_helpdesk")]
    with httpx.Client(base_url=counter["url"], headers={"Authorization": f"Bearer {counter['token']}"}, timeout=60) as http:
        bystander = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
        add = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "add", "arguments": {"item_id": "a"}}}
        assert http.post(bystander["mcp_url"], json=add).json()["result"]["isError"] is False
        episode = http.post("/episodes", json={"scenario_id": "counter_001"}).json()
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "hog", "arguments": {}}}
        result = http.post(episode["mcp_url"], json=body, headers={"MCP-Protocol-Version": "2026-07-28"}).json()["result"]
        # The kernel killed the environment worker (the container's largest process), not the server.
        text = result["content"][0]["text"]
        assert result["isError"] and "out of memory" in text and "the call was undone" in text, result
        for url in others:
            assert httpx.get(url + "/healthz", timeout=5).status_code == 200
        # Nothing else was lost: the bystander was rebuilt in the new worker.
        read = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "get_item", "arguments": {"item_id": "a"}}}
        answer = http.post(bystander["mcp_url"], json=read).json()["result"]
        assert json.loads(answer["content"][0]["text"])["data"]["count"] == 1, answer
        assert http.get("/info").json()["worker_restarts"] == 1
    record = read_state(farm)["envs"]["counter"]
    assert record["restarts"] == 0 and record["status"] == "healthy" and not record["oom_killed"], record
    assert all(r["restarts"] == 0 for r in read_state(farm)["envs"].values())


def test_a_hung_container_is_restarted_and_reported(farm, engine):
    container = container_of(engine, farm, "it_helpdesk")
    before = read_state(farm)["envs"]["it_helpdesk"]["restarts"]
    server = container.attrs["State"]["Pid"]
    os.kill(server, signal.SIGSTOP)  # alive, but answers nothing
    wait_until(lambda: read_state(farm)["envs"]["it_helpdesk"]["restarts"] == before + 1
               and read_state(farm)["envs"]["it_helpdesk"]["status"] == "healthy")
    record = read_state(farm)["envs"]["it_helpdesk"]
    assert record["last_exit"] == "hung: no answer to 3 health probes in a row"
    container.reload()
    assert container.status == "running" and container.attrs["State"]["Pid"] != server
    url = json.loads(farm.read_text())["envs"]["it_helpdesk"]["url"]
    assert httpx.get(url + "/healthz", timeout=5).json()["env_id"] == "it_helpdesk"


def test_a_port_taken_between_planning_and_publishing_is_replaced(tmp_path, engine):
    bundle = default_catalog() / "online_retail"
    with farm_with_its_port_taken(tmp_path, bundle, "docker") as (catalog, planned, thief):
        endpoint = json.loads(catalog.read_text())["envs"]["online_retail"]
        assert httpx.URL(endpoint["url"]).port != planned
        assert read_state(catalog)["envs"]["online_retail"]["url"] == endpoint["url"]
        info = httpx.get(endpoint["url"] + "/info", headers={"Authorization": f"Bearer {endpoint['token']}"}, timeout=10)
        assert info.status_code == 200 and info.json()["env_id"] == "online_retail"
        assert thief.getsockname()[1] == planned


def test_down_leaves_nothing_also_after_kill_9(tmp_path, engine):
    catalog = tmp_path / "farm.json"
    up = envscaler("farm", "up", str(default_catalog() / "library_circulation"), "--backend", "docker", "--catalog", str(catalog),
                   timeout=DOCKER_TIMEOUT_S)
    assert up.returncode == 0, up.stderr
    farm_id = read_state(catalog)["farm_id"]
    label = f"{LABEL_FARM}={farm_id}"
    assert engine.containers.list(filters={"label": label}) and engine.networks.list(filters={"label": label})
    os.kill(read_state(catalog)["daemon_pid"], signal.SIGKILL)
    # Its servers notice that the daemon's heartbeat stopped and stop themselves.
    wait_until(lambda: engine.containers.list(filters={"label": label}, ignore_removed=True) == [], timeout_s=30)
    down = envscaler("farm", "down", "--catalog", str(catalog), timeout=DOCKER_TIMEOUT_S)
    assert down.returncode == 0, down.stderr
    assert engine.containers.list(all=True, filters={"label": label}) == []
    assert engine.networks.list(filters={"label": label}) == []
    rules = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True).stdout
    assert f"es-{farm_id}" not in rules
