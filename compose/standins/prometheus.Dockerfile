# Stands in for prom/prometheus:v2.55.1: Debian's prometheus (2.42), its data in /prometheus, and
# wget for the compose health check (the official image has busybox's).
FROM llmgw-base:bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
