# The runtime image of every environment server: the project, installed offline from wheels built
# on the host (dist/wheels, see .ci/docker-setup.sh or `envscaler build`). One image per environment
# is then this image plus its bundle at /bundle (`envscaler build ENV_DIR`).
#
#   docker build --build-arg BASE_IMAGE=python:3.11-slim -t envscaler-runtime .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

COPY dist/wheels /tmp/wheels
RUN python3 -m venv /opt/envscaler \
    && /opt/envscaler/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels envscaler-farm \
    && rm -rf /tmp/wheels

ENV PATH=/opt/envscaler/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MALLOC_ARENA_MAX=2

# An unprivileged user with no home; the farm also drops every capability and mounts / read-only.
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "servers.cli"]
CMD ["/bundle", "--host", "0.0.0.0", "--port", "8000"]
