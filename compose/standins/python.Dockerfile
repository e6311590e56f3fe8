# Stands in for python:3.11-slim-bookworm: Python 3.11 at /usr/local/bin/python, CA certificates.
FROM llmgw-base:bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && ln -s /usr/bin/python3 /usr/local/bin/python \
 && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
