"""The swarm backend: the farm as services of an existing Docker Swarm, the engine doing the rest.

``envscaler farm up --backend swarm --registry HOST:PORT [--replicas N]`` talks to a swarm manager (the
local engine, or ``DOCKER_HOST``) and:

1. builds the runtime image and one image per environment there (as ``envscaler build`` does) and
   pushes them to the registry that every node pulls from; services name their image by digest;
2. creates an internal overlay network (no route out), an edge network for the gateway alone, one
   secret per environment (its control token, a file in the container: never an environment
   variable or an argument) and one config (the gateway's routes);
3. creates one service per environment, ``N`` replicas spread over the nodes by the scheduler, with
   the docker backend's hardening (non-root, read-only root, no capabilities, no new privileges,
   memory, CPU and pids limits), and the gateway service, published on the swarm's ingress or,
   with ``--gateway-publish host``, on the same port of every node;
4. waits until the gateway sees every replica healthy and writes the catalog.

Nothing of the farm runs on this machine once ``up`` returns: Swarm restarts and reschedules
replicas, and the gateway finds them (``servers.farm.gateway.routing``). Every object carries the farm's
label, so ``down`` removes them all, also after an interrupted ``up``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ValidationError

from envscaler.errors import EXIT_FAILED, EXIT_OK
from envscaler.wire import EnvEndpoint, FarmCatalog, GatewayHealth
from servers.errors import FarmError
from servers.farm.backends.docker import SERVER_PORT, SERVER_USER
from servers.farm.backends.images import LABEL_ENV, LABEL_FARM, build_env_image, current_runtime, docker_client
from servers.farm.models import EnvPlan, FarmPaths, FarmPlan, read_json, write_json
from servers.farm.gateway.swarm import GATEWAY_PORT, GatewayRoutes

PublishMode = Literal["ingress", "host"]

SECRET_PATH = "/run/secrets/envscaler_token"
ROUTES_PATH = "/etc/envscaler/routes.json"
# A farm's gateway port in host mode when none is given: derived from the farm id, in Swarm's own
# range for published ports, so that two farms on one swarm rarely ask for the same one.
_HOST_PORTS = (30000, 32767)
_BUILDERS = 4
_POLL_S = 0.25
_DOWN_TIMEOUT_S = 90.0
_STOP_GRACE_NS = 5_000_000_000
_RESTART_DELAY_NS = 1_000_000_000


class SwarmFarm(BaseModel):
    """What ``farm up`` made on the swarm, kept next to the catalog for ``status`` and ``down``."""

    farm_id: str
    docker_host: str | None = None
    registry: str
    replicas: int
    gateway: str
    gateway_publish: PublishMode
    gateway_service: str
    services: dict[str, str]


def swarm_file(paths: FarmPaths) -> Path:
    return paths.dir / "swarm.json"


def object_name(farm_id: str, suffix: str) -> str:
    """``envscaler-<farm>-<suffix>``, made a valid service/secret name (letters, digits, '-'; at most 63)."""
    slug = re.sub(r"[^a-z0-9]+", "-", suffix.lower()).strip("-")[:40].strip("-") or "env"
    return f"envscaler-{farm_id}-{slug}"


def _client(docker_host: str | None) -> Any:
    if docker_host is None:
        return docker_client()
    import docker

    try:
        client = docker.DockerClient(base_url=docker_host, timeout=120)
        client.ping()
    except Exception as e:  # noqa: BLE001 - every failure here means the same thing to the user
        raise FarmError(f"the swarm manager at {docker_host} does not answer ({e})") from None
    return client


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """What the engine answered, as a FarmError: no traceback reaches the user."""
    import docker.errors
    import requests

    try:
        yield
    except docker.errors.DockerException as e:
        raise FarmError(f"swarm: {getattr(e, 'explanation', None) or e}") from None
    except requests.RequestException as e:
        raise FarmError(f"swarm: the manager stopped answering ({e})") from None


def _manager(client: Any) -> dict[str, Any]:
    swarm = client.info().get("Swarm") or {}
    if swarm.get("LocalNodeState") != "active" or not swarm.get("ControlAvailable"):
        where = os.environ.get("DOCKER_HOST", "the local engine")
        raise FarmError(f"{where} is not a swarm manager: run 'docker swarm init' there, or point DOCKER_HOST at a manager")
    return swarm


# -- images ----------------------------------------------------------------------------------------


def push(client: Any, local_tag: str, registry: str) -> str:
    """Push ``local_tag`` to ``registry``; the reference nodes pull it by (``registry/repo:tag@digest``)."""
    repository, tag = local_tag.rsplit(":", 1)
    remote = f"{registry}/{repository}"
    client.images.get(local_tag).tag(remote, tag)
    digest = None
    for line in client.api.push(remote, tag, stream=True, decode=True):
        if "error" in line:
            raise FarmError(f"pushing {remote}:{tag} failed: {line['error']} (the engine must reach {registry}; a plain-HTTP "
                            "registry must be in its insecure-registries)")
        digest = (line.get("aux") or {}).get("Digest") or digest
    return f"{remote}:{tag}@{digest}" if digest else f"{remote}:{tag}"


def push_images(client: Any, envs: list[EnvPlan], registry: str) -> tuple[str, dict[str, str]]:
    """Build (when missing) and push the runtime image and every environment's image; their references."""
    runtime = current_runtime(client)
    with ThreadPoolExecutor(_BUILDERS) as pool:
        gateway_image = pool.submit(push, client, runtime, registry)
        refs = pool.map(lambda env: push(client, build_env_image(client, Path(env.bundle_dir), runtime)[0], registry), envs)
        images = {env.env_id: ref for env, ref in zip(envs, refs)}
        return gateway_image.result(), images


# -- services --------------------------------------------------------------------------------------


def _resources(plan: FarmPlan) -> Any:
    from docker.types import Resources

    limits = plan.limits
    resources = Resources(cpu_limit=int(limits.cpus * 1e9), mem_limit=limits.memory_mb * 1024 * 1024)
    resources["Limits"]["Pids"] = limits.pids  # Engine API 1.41; docker-py has no argument for it
    return resources


def _hardened(image: str, *, command: list[str] | None, args: list[str], labels: dict[str, str], **extra: Any) -> Any:
    """A container spec with the docker backend's hardening; no environment variables at all."""
    from docker.types import ContainerSpec, Mount

    return ContainerSpec(
        image, command=command, args=args, user=SERVER_USER, read_only=True, cap_drop=["ALL"], labels=labels,
        mounts=[Mount("/tmp", None, type="tmpfs", tmpfs_size=16 * 1024 * 1024)], stop_grace_period=_STOP_GRACE_NS, **extra,
    )


def create_env_service(client: Any, plan: FarmPlan, env: EnvPlan, image: str, name: str, network: str, replicas: int) -> None:
    """One service per environment: ``replicas`` servers, each its own replica id, the token a secret file."""
    from docker.types import EndpointSpec, NetworkAttachmentConfig, RestartPolicy, SecretReference, ServiceMode, TaskTemplate

    labels = {LABEL_FARM: plan.farm_id, LABEL_ENV: env.env_id}
    secret = client.secrets.create(name=name, data=env.token.encode(), labels=labels)
    spec = _hardened(
        image, command=None, labels=labels,
        args=["/bundle", "--host", "0.0.0.0", "--port", str(SERVER_PORT), "--token-file", SECRET_PATH,
              "--replica-id", "auto", "--log-level", "warning", *plan.limits.serve_flags()],
        secrets=[SecretReference(secret.id, name, filename=Path(SECRET_PATH).name, uid="10001", gid="10001", mode=0o400)],
    )
    template = TaskTemplate(spec, resources=_resources(plan), networks=[NetworkAttachmentConfig(network)],
                            restart_policy=RestartPolicy(condition="any", delay=_RESTART_DELAY_NS))
    # dnsrr: the gateway resolves each replica's own address (tasks.<service>); no virtual IP needed.
    client.api.create_service(template, name=name, labels=labels, mode=ServiceMode("replicated", replicas=replicas),
                              endpoint_spec=EndpointSpec(mode="dnsrr"))


def create_gateway_service(client: Any, plan: FarmPlan, image: str, name: str, routes: GatewayRoutes, networks: list[str],
                           publish: PublishMode, port: int, replicas: int) -> None:
    """The gateway: replicas on the ingress, or one per node on its own port (``host``)."""
    from docker.types import ConfigReference, DNSConfig, EndpointSpec, NetworkAttachmentConfig, RestartPolicy, ServiceMode, TaskTemplate

    labels = {LABEL_FARM: plan.farm_id}
    config = client.configs.create(name=name, data=routes.model_dump_json().encode(), labels=labels)
    spec = _hardened(
        image, command=["python3", "-m", "servers.farm.gateway.swarm"], args=[ROUTES_PATH, "--port", str(GATEWAY_PORT)],
        labels=labels, configs=[ConfigReference(config.id, name, filename=ROUTES_PATH, uid="10001", gid="10001", mode=0o440)],
        # Replicas are looked up every second: a lookup must fail fast, never hang a poll or a stop.
        dns_config=DNSConfig(options=["timeout:1", "attempts:1"]),
    )
    template = TaskTemplate(spec, resources=_resources(plan), networks=[NetworkAttachmentConfig(n) for n in networks],
                            restart_policy=RestartPolicy(condition="any", delay=_RESTART_DELAY_NS))
    if publish == "host":
        ports = [{"Protocol": "tcp", "TargetPort": GATEWAY_PORT, "PublishedPort": port, "PublishMode": "host"}]
        mode, endpoint = ServiceMode("global"), EndpointSpec(mode="dnsrr", ports=ports)
    else:
        ports = [{"Protocol": "tcp", "TargetPort": GATEWAY_PORT, "PublishMode": "ingress", **({"PublishedPort": port} if port else {})}]
        mode, endpoint = ServiceMode("replicated", replicas=replicas), EndpointSpec(mode="vip", ports=ports)
    client.api.create_service(template, name=name, labels=labels, mode=mode, endpoint_spec=endpoint)


def _published_port(client: Any, service: str) -> int:
    for _ in range(50):
        ports = (client.api.inspect_service(service).get("Endpoint") or {}).get("Ports") or []
        if ports and ports[0].get("PublishedPort"):
            return int(ports[0]["PublishedPort"])
        time.sleep(0.1)
    raise FarmError(f"swarm published no port for the gateway service {service}")


# -- up ----------------------------------------------------------------------------------------------


def swarm_up(args: argparse.Namespace, paths: FarmPaths, plan: FarmPlan) -> int:
    """Deploy ``plan`` to the swarm, wait until every replica is healthy, write the catalog; 0 or 1."""
    with _engine_errors():
        return _up(args, paths, plan)


def _up(args: argparse.Namespace, paths: FarmPaths, plan: FarmPlan) -> int:
    if not args.registry:
        raise FarmError("the swarm backend needs --registry HOST:PORT, a registry that every node pulls the farm's images from")
    if args.replicas < 1 or args.gateway_replicas < 1:
        raise FarmError("--replicas and --gateway-replicas must be at least 1")
    started = time.monotonic()
    docker_host = os.environ.get("DOCKER_HOST")
    client = _client(docker_host)
    swarm = _manager(client)
    farm_id = plan.farm_id
    services = {env.env_id: object_name(farm_id, env.env_id) for env in plan.envs}
    port = args.gateway_port
    if not port and args.gateway_publish == "host":
        port = _HOST_PORTS[0] + int(farm_id, 16) % (_HOST_PORTS[1] - _HOST_PORTS[0])
    host = args.gateway_host or swarm.get("NodeAddr") or "127.0.0.1"
    farm = SwarmFarm(farm_id=farm_id, docker_host=docker_host, registry=args.registry, replicas=args.replicas, gateway="",
                     gateway_publish=args.gateway_publish, gateway_service=object_name(farm_id, "gateway"), services=services)
    paths.dir.mkdir(parents=True, exist_ok=True)
    # Written before anything exists on the swarm: 'down' can clean up after an 'up' that died halfway.
    write_json(paths.plan, plan)
    write_json(swarm_file(paths), farm)
    try:
        print(f"farm: building and pushing {len(plan.envs) + 1} image(s) to {args.registry}", file=sys.stderr)
        gateway_image, images = push_images(client, plan.envs, args.registry)
        network = client.networks.create(object_name(farm_id, "net"), driver="overlay", internal=True, labels={LABEL_FARM: farm_id})
        edge = client.networks.create(object_name(farm_id, "edge"), driver="overlay", labels={LABEL_FARM: farm_id})
        print(f"farm: images ready after {time.monotonic() - started:.1f} s; creating {len(plan.envs)} service(s) "
              f"x {args.replicas} replica(s)", file=sys.stderr)
        for env in plan.envs:
            create_env_service(client, plan, env, images[env.env_id], services[env.env_id], network.id, args.replicas)
        routes = GatewayRoutes(services=services, port=SERVER_PORT)
        create_gateway_service(client, plan, gateway_image, farm.gateway_service, routes, [network.id, edge.id],
                               args.gateway_publish, port, args.gateway_replicas)
        farm.gateway = f"http://{host}:{port or _published_port(client, farm.gateway_service)}"
        write_json(swarm_file(paths), farm)
        problem = _wait_ready(client, farm, time.monotonic(), args.timeout)
    except BaseException:
        remove_swarm_farm(paths, farm_id)
        raise
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        remove_swarm_farm(paths, farm_id)
        return EXIT_FAILED
    catalog = FarmCatalog(envs={env.env_id: EnvEndpoint(url=f"{farm.gateway}/envs/{env.env_id}", token=env.token) for env in plan.envs},
                          gateway=farm.gateway, backend="swarm", farm_id=farm_id)
    write_json(paths.catalog, catalog)
    print(f"farm: ready after {time.monotonic() - started:.1f} s; catalog {paths.catalog}, gateway {farm.gateway}", file=sys.stderr)
    print(paths.catalog)
    return EXIT_OK


def _gateway_view(gateway: str) -> dict[str, int] | None:
    """env_id -> replicas the gateway sees answering; None while it does not answer."""
    try:
        return GatewayHealth.model_validate_json(httpx.get(gateway + "/healthz", timeout=2.0, trust_env=False).content).replicas
    except (httpx.HTTPError, ValidationError):
        return None


def _gateway_urls(client: Any, farm: SwarmFarm) -> list[str]:
    """Every URL a client may be given: the farm's one URL, and in host mode that port on every node that runs tasks.

    A host-mode gateway runs once per node and each one starts on its own; the farm is ready only
    when every one of them answers, not just the one in the catalog.
    """
    if farm.gateway_publish != "host":
        return [farm.gateway]
    port = httpx.URL(farm.gateway).port
    urls = [farm.gateway]
    for node in client.api.nodes():
        if node["Spec"].get("Availability") != "active" or node["Status"].get("State") != "ready":
            continue
        address = node["Status"].get("Addr") or ""
        if address in ("", "0.0.0.0"):  # a manager may report no address of its own here, only in ManagerStatus
            address = (node.get("ManagerStatus") or {}).get("Addr", "").rpartition(":")[0]
        url = f"http://{address}:{port}"
        if address and url not in urls:
            urls.append(url)
    return urls


def _gateways_view(client: Any, farm: SwarmFarm) -> tuple[dict[str, int], list[str]]:
    """What every gateway URL sees (the smallest count of each environment), and the URLs that do not answer."""
    views = {url: _gateway_view(url) for url in _gateway_urls(client, farm)}
    silent = [url for url, view in views.items() if view is None]
    answering = [view for view in views.values() if view is not None]
    seen = {env_id: min(view.get(env_id, 0) for view in answering) for env_id in farm.services} if answering else {}
    return seen, silent


def _wait_ready(client: Any, farm: SwarmFarm, started: float, timeout_s: float) -> str | None:
    """None once every gateway URL sees ``replicas`` healthy replicas of every environment, else what went wrong."""
    interactive = sys.stderr.isatty()
    last_line, last_print = "", 0.0
    while True:
        view, silent = _gateways_view(client, farm)
        ready = sum(view.get(env_id, 0) >= farm.replicas for env_id in farm.services)
        waiting = f" (gateway not answering yet at {', '.join(silent)})" if silent else ""
        line = f"farm: {ready}/{len(farm.services)} environments at {farm.replicas} replica(s){waiting} after {time.monotonic() - started:.1f} s"
        if interactive or line.split(" after")[0] != last_line or time.monotonic() - last_print > 5:
            print(("\r" + line) if interactive else line, end="" if interactive else "\n", file=sys.stderr, flush=True)
            last_line, last_print = line.split(" after")[0], time.monotonic()
        if not silent and ready == len(farm.services):
            if interactive:
                print(file=sys.stderr)
            return None
        if time.monotonic() - started > timeout_s:
            if interactive:
                print(file=sys.stderr)
            late = [name for env_id, name in farm.services.items() if view.get(env_id, 0) < farm.replicas]
            errors = _task_errors(client, [*late, farm.gateway_service])
            detail = "; ".join(errors[:5]) or (f"no gateway answers at {', '.join(silent)}" if silent else f"gateway {farm.gateway} answers")
            hint = "" if not silent or farm.gateway_publish == "host" else (
                " (no answer on the ingress: if the nodes' kernels lack IPVS, Swarm's routing mesh cannot work; "
                "use --gateway-publish host)")
            return f"not every replica was healthy within {timeout_s:g} s: {detail}{hint}"
        time.sleep(_POLL_S)


def _task_errors(client: Any, services: list[str]) -> list[str]:
    found = []
    for service in services:
        try:
            tasks = client.api.tasks(filters={"service": service})
        except Exception:  # noqa: BLE001 - only for the error message
            continue
        for task in sorted(tasks, key=lambda t: t.get("UpdatedAt", ""), reverse=True):
            status = task.get("Status") or {}
            if status.get("Err"):
                found.append(f"{service}: {status.get('State')}: {status['Err']}")
                break
    return found


# -- status and down ---------------------------------------------------------------------------------


def swarm_status(paths: FarmPaths, as_json: bool) -> int:
    """Each environment's running replicas and nodes, and what the gateway sees; 0 when all are healthy."""
    with _engine_errors():
        return _status(paths, as_json)


def _status(paths: FarmPaths, as_json: bool) -> int:
    farm = read_json(swarm_file(paths), SwarmFarm)
    if farm is None:
        print(f"no swarm farm at {paths.catalog}", file=sys.stderr)
        return EXIT_FAILED
    client = _client(farm.docker_host)
    nodes = {node["ID"]: node["Description"]["Hostname"] for node in client.api.nodes()}
    view, silent = _gateways_view(client, farm)
    rows = {}
    for env_id, service in farm.services.items():
        running = [t for t in client.api.tasks(filters={"service": service, "desired-state": "running"})
                   if (t.get("Status") or {}).get("State") == "running"]
        rows[env_id] = {"service": service, "desired": farm.replicas, "running": len(running), "healthy": view.get(env_id, 0),
                        "nodes": sorted({nodes.get(t.get("NodeID"), t.get("NodeID", "?")) for t in running})}
    healthy = bool(view) and not silent and all(r["running"] >= farm.replicas and r["healthy"] >= farm.replicas for r in rows.values())
    if as_json:
        print(json.dumps({"farm_id": farm.farm_id, "backend": "swarm", "gateway": farm.gateway, "gateways_not_answering": silent,
                          "ready": healthy, "envs": rows}, indent=2))
    else:
        answering = f"NOT ANSWERING at {', '.join(silent)}" if silent else "answering"
        print(f"farm {farm.farm_id}: swarm backend, gateway {farm.gateway} {answering}, {'ready' if healthy else 'not ready'}")
        print(f"{'env_id':<28} {'running':>7} {'healthy':>7}  nodes")
        for env_id, row in rows.items():
            print(f"{env_id:<28} {row['running']:>3}/{row['desired']:<3} {row['healthy']:>7}  {', '.join(row['nodes'])}")
    return 0 if healthy else 1


def remove_swarm_farm(paths: FarmPaths, farm_id: str) -> int:
    """Remove every service, secret, config and network of the farm and wait until the nodes let go; how many."""
    with _engine_errors():
        return _remove(paths, farm_id)


def _remove(paths: FarmPaths, farm_id: str) -> int:
    farm = read_json(swarm_file(paths), SwarmFarm) if swarm_file(paths).exists() else None
    client = _client(farm.docker_host if farm else None)
    label = {"label": f"{LABEL_FARM}={farm_id}"}
    removed = 0
    service_ids = []
    for service in client.api.services(filters=label):
        client.api.remove_service(service["ID"])
        service_ids.append(service["ID"])
        removed += 1
    deadline = time.monotonic() + _DOWN_TIMEOUT_S
    # The nodes stop and remove the containers; the manager forgets a task once its node reports it gone.
    while service_ids and time.monotonic() < deadline:
        if not any(task.get("ServiceID") in service_ids for task in client.api.tasks()):
            break
        time.sleep(_POLL_S)
    for secret in client.api.secrets(filters=label):
        client.api.remove_secret(secret["ID"])
        removed += 1
    for config in client.api.configs(filters=label):
        client.api.remove_config(config["ID"])
        removed += 1
    networks = client.api.networks(filters=label)
    while networks and time.monotonic() < deadline:
        for network in networks:
            try:
                client.api.remove_network(network["Id"])
                removed += 1
            except Exception:  # noqa: BLE001 - still in use by a container that is stopping: try again
                continue
        networks = client.api.networks(filters=label)
        if networks:
            time.sleep(_POLL_S)
    if networks:
        raise FarmError(f"swarm still holds the farm's network(s) {', '.join(n['Name'] for n in networks)} after "
                        f"{_DOWN_TIMEOUT_S:g} s; run 'envscaler farm down' again")
    return removed

