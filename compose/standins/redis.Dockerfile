# Stands in for redis:7.4-alpine: Debian's redis-server (7.0), in /data, reachable from the compose
# network as the official image makes it (protected mode off when started without a config file).
FROM llmgw-base:bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data \
 && printf '#!/bin/sh\nif [ "$1" = redis-server ]; then shift; exec redis-server --protected-mode no "$@"; fi\nexec "$@"\n' \
    > /usr/local/bin/docker-entrypoint.sh \
 && chmod 0755 /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
CMD ["redis-server"]
