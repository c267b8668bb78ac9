"""Images: the runtime image (the top-level Dockerfile) and one image per environment on top of it.

The runtime image is ``envscaler-runtime:<hash of the project's code>`` (also tagged ``latest``), so a
code change gets a new runtime. An environment image is ``envscaler-env-<env_id>:<spec hash>``: the
runtime image plus the bundle at ``/bundle``, labelled with env_id, spec hash and the runtime it was
built on. Building an environment whose image already exists on the current runtime is a no-op.
"""

from __future__ import annotations

import hashlib
import io
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from envscaler.bundle import load_bundle
from envscaler.data_files import DATA_DIR, data_folders
from envscaler.models import Bundle
from servers.errors import FarmError

RUNTIME_REPOSITORY = "envscaler-runtime"
OFFICIAL_BASE = "python:3.11-slim"
LOCAL_BASE = "envscaler-base:bookworm"
LABEL_ENV, LABEL_HASH, LABEL_RUNTIME, LABEL_FARM = "envscaler.env_id", "envscaler.spec_hash", "envscaler.runtime", "envscaler.farm"
PROJECT_ROOT = Path(__file__).resolve().parents[3]  # servers/farm/backends/images.py


def docker_answers() -> bool:
    """Whether a Docker engine answers on this machine (quietly, within a few seconds)."""
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        client.close()
        return True
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False


def docker_client() -> Any:
    """A client of the local engine; FarmError that says what to do when none answers."""
    import docker

    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as e:  # noqa: BLE001 - every failure here means the same thing to the user
        raise FarmError(f"no Docker engine answers ({e}); start dockerd (see .ci/docker-setup.sh) or use --backend process") from None
    return client


def source_hash() -> str:
    """A hash of the installed project's code: the runtime image is rebuilt whenever it changes."""
    digest = hashlib.sha256()
    files = [PROJECT_ROOT / "pyproject.toml"]
    for package in ("envscaler", "servers", "agent_client", "synth"):
        files += sorted(p for p in (PROJECT_ROOT / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in files:
        digest.update(str(path.relative_to(PROJECT_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def runtime_tag() -> str:
    return f"{RUNTIME_REPOSITORY}:{source_hash()}"


def env_image_tag(env_id: str, spec_hash: str) -> str:
    return f"envscaler-env-{env_id.lower()}:{spec_hash}"


def pick_base(client: Any) -> str:
    """The official Python image when present, else the locally built Debian base."""
    for name in (OFFICIAL_BASE, LOCAL_BASE):
        try:
            client.images.get(name)
            return name
        except Exception:  # noqa: BLE001 - docker.errors.ImageNotFound, or an engine hiccup: try the next
            continue
    return OFFICIAL_BASE  # a registry may still have it


def build_wheels(wheels: Path) -> None:
    """This project as a fresh wheel, plus its dependencies, into ``wheels`` (offline when they are there)."""
    wheels.mkdir(parents=True, exist_ok=True)
    for old in wheels.glob("envscaler_farm-*.whl"):
        old.unlink()
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels), "--find-links", str(wheels)]
    subprocess.run([*pip, "--no-deps", str(PROJECT_ROOT)], check=True)
    if subprocess.run([*pip, "--no-index", str(PROJECT_ROOT)], capture_output=True).returncode != 0:
        subprocess.run([*pip, str(PROJECT_ROOT)], check=True)


def build_runtime(client: Any, base: str | None = None) -> str:
    """Build the runtime image from the top-level Dockerfile; its image id."""
    build_wheels(PROJECT_ROOT / "dist" / "wheels")
    base = base or pick_base(client)
    tag = runtime_tag()
    image, _ = client.images.build(path=str(PROJECT_ROOT), tag=tag, buildargs={"BASE_IMAGE": base}, rm=True, pull=False)
    image.tag(RUNTIME_REPOSITORY, "latest")
    return tag


def current_runtime(client: Any) -> str:
    """The tag of the runtime image for the code as it is now, building it first when it is missing."""
    tag = runtime_tag()
    try:
        client.images.get(tag)
        return tag
    except Exception:  # noqa: BLE001 - missing: build it
        return build_runtime(client)


def requirement_wheels(requires: list[str], wheels: Path) -> None:
    """Wheels of an environment's declared requirements (env.json's ``requires``) and their dependencies, into
    ``wheels``: from the project's wheels when they are all there, else from the host's pip index (its
    configuration: a mirror or a local wheelhouse works offline). The image build itself needs no network."""
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wheels), "--find-links", str(PROJECT_ROOT / "dist" / "wheels")]
    if subprocess.run([*pip, "--no-index", *requires], capture_output=True).returncode != 0:
        subprocess.run([*pip, *requires], check=True)


def _context(bundle: Bundle, bundle_dir: Path, runtime: str, labels: dict[str, str], requires: list[str], wheels: Path | None) -> io.BytesIO:
    """A build context holding the bundle (its data files too), the wheels of its requirements (if any) and a short Dockerfile."""
    label_text = " ".join(f'{k}="{v}"' for k, v in labels.items())
    lines = [f"FROM {runtime}", "COPY --chown=0:0 bundle /bundle"]
    if requires:
        lines += ["USER 0:0", "COPY wheels /tmp/env-wheels",
                  "RUN /opt/envscaler/bin/pip install --no-cache-dir --no-index --find-links /tmp/env-wheels "
                  f"{shlex.join(requires)} && rm -rf /tmp/env-wheels", "USER 10001:10001"]
    dockerfile = "\n".join([*lines, f"LABEL {label_text}", ""]).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
        for name in ("env.json", "scenarios.jsonl"):
            tar.add(bundle_dir / name, arcname=f"bundle/{name}")
        for folder in data_folders(bundle):
            tar.add(folder, arcname=f"bundle/{DATA_DIR}")
        if wheels is not None:
            tar.add(wheels, arcname="wheels")
    buffer.seek(0)
    return buffer


def build_env_image(client: Any, bundle_dir: Path, runtime: str) -> tuple[str, bool]:
    """(tag, built) for one bundle; ``built`` is False when an up-to-date image already existed."""
    bundle = load_bundle(bundle_dir)
    spec_hash = bundle.spec.content_hash()
    tag = env_image_tag(bundle.env_id, spec_hash)
    try:
        if client.images.get(tag).labels.get(LABEL_RUNTIME) == runtime:
            return tag, False
    except Exception:  # noqa: BLE001 - not built yet
        pass
    labels = {LABEL_ENV: bundle.env_id, LABEL_HASH: spec_hash, LABEL_RUNTIME: runtime}
    requires = bundle.spec.requires or []
    with tempfile.TemporaryDirectory(prefix="envscaler-wheels-") as wheels:
        if requires:
            requirement_wheels(requires, Path(wheels))
        context = _context(bundle, Path(bundle_dir), runtime, labels, requires, Path(wheels) if requires else None)
    client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, pull=False)
    return tag, True


def build_images(bundle_dirs: list[Path], *, runtime_only: bool = False, base: str | None = None) -> list[tuple[str, bool, float]]:
    """Build the runtime image if needed (always with ``runtime_only``) and one image per bundle."""
    client = docker_client()
    runtime = build_runtime(client, base) if runtime_only else current_runtime(client)
    results = []
    for directory in bundle_dirs:
        started = time.monotonic()
        tag, built = build_env_image(client, directory, runtime)
        results.append((tag, built, time.monotonic() - started))
    return results
