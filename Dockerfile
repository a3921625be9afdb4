# syntax=docker/dockerfile:1
# Build stage: build the wheel (which carries sql/ and triggers/) and install it into a venv,
# with the versions constraints.txt pins (the ones CI tested) and no extra: neither the
# embedded PostgreSQL (`embedded`) nor the test tools (`dev`).
FROM python:3.11-slim AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
COPY pyproject.toml README.md constraints.txt ./
COPY service ./service
COPY sql ./sql
COPY triggers ./triggers
# Extras only when asked: `--build-arg AQ_EXTRAS=otel` adds tracing (docs/operations.md).
ARG AQ_EXTRAS=""
RUN /opt/venv/bin/pip wheel --no-deps --wheel-dir /tmp/dist . \
    && /opt/venv/bin/pip install --no-compile --constraint constraints.txt \
       "$(echo /tmp/dist/*.whl)${AQ_EXTRAS:+[$AQ_EXTRAS]}"

# Runtime stage: the venv only, no build tools, a non-root user.
FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    AQ_HOST=0.0.0.0 \
    AQ_PORT=8080 \
    AQ_DATA_DIR=/var/lib/analysis-queue
RUN groupadd --system --gid 10001 aq \
    && useradd --system --uid 10001 --gid aq --home-dir /var/lib/analysis-queue --create-home aq
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8080
# The probe asks the port the service listens on: AQ_PORT, as set when the container runs.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os,sys,urllib.request; port = os.environ.get('AQ_PORT', '8080'); sys.exit(urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=2).status != 200)"]
# Exec form: SIGTERM reaches the service, which drains and stops gracefully.
ENTRYPOINT ["analysis-queue"]
CMD ["serve"]
