# One image for every Python role of llmgw, chosen by the command it runs:
#   extproc        llmgw serve --config /etc/llmgw/llmgw.yaml --host 0.0.0.0 --metrics-port 9464 --run-dir /tmp/llmgw
#   coordinator    llmgw coordinator --config /etc/llmgw/llmgw.yaml --host 0.0.0.0
#   simulated pod  python -m llmgw_sim --host 0.0.0.0 --port 8000
# Build from the repository root: docker build -t llmgw:dev .
# Behind a proxy that re-signs TLS (a corporate one; this project's build machines), give pip its CA:
#   docker build --build-arg EXTRA_CA_CERTS="$(cat /usr/local/share/ca-certificates/*.crt)" -t llmgw:dev .
FROM python:3.11-slim-bookworm
ARG EXTRA_CA_CERTS=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/llmgw \
    PATH=/opt/llmgw/bin:$PATH \
    HOME=/tmp \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt

RUN if [ -n "$EXTRA_CA_CERTS" ]; then \
      printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/llmgw-build-extra.crt \
      && update-ca-certificates; \
    fi
RUN groupadd --system --gid 10001 llmgw \
 && useradd --system --uid 10001 --gid llmgw --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin llmgw

WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY llmgw_sim ./llmgw_sim
COPY config ./config
# Editable, so the package's data files (Lua filters, .pyi) come along as they are in the tree.
# xds-protos ships an older opentelemetry/proto/common (Envoy's API imports it); the OTLP exporter
# needs opentelemetry-proto's own, so that package is installed again last (as the Makefile does).
RUN python -m venv "$VIRTUAL_ENV" \
 && pip install --upgrade pip \
 && pip install -e . \
 && pip install --force-reinstall --no-deps "opentelemetry-proto==$(python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')" \
 && python -m compileall -q extproc llmgw_sim \
 && python -c "import extproc.app, extproc.coordinator.server, llmgw_sim.server, extproc.telemetry.tracing"

# Root owns the code; the processes run as llmgw and write only to /tmp (read-only root in compose and Kubernetes).
USER 10001:10001
EXPOSE 50051 9464 8081 8000
CMD ["llmgw", "serve", "--config", "/etc/llmgw/llmgw.yaml", "--host", "0.0.0.0", "--metrics-port", "9464", "--run-dir", "/tmp/llmgw"]
