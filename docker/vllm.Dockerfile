# vLLM's OpenAI server image with the kvobs plugin installed (ObservedOffloadingSpec,
# ObservedOffloadingConnector). Used by docker/compose.yaml; build from the repository root:
#   docker build -f docker/vllm.Dockerfile -t kvobs/vllm-openai:v0.33.0 .
# The image's ENTRYPOINT stays vLLM's own (`vllm serve`); pass the model and flags as the command.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /opt/kvobs/
COPY kvobs /opt/kvobs/kvobs
# kvobs's dependencies (numpy, prometheus-client, opentelemetry) are vLLM's too: no new packages.
# The engine runs as uid 10001, like the sidecar image: kvobs writes 0600 files the sidecar must read.
# /var/lib/kvobs and the Hugging Face cache are created here owned by that uid, so empty named
# volumes mounted there start with that owner.
RUN python3 -m pip install --no-cache-dir --no-deps /opt/kvobs \
    && python3 -c "import kvobs.vllm" \
    && groupadd --system --gid 10001 vllm \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/vllm --create-home --shell /usr/sbin/nologin vllm \
    && mkdir -p /var/lib/kvobs /data/hf \
    && chown 10001:10001 /var/lib/kvobs /data/hf \
    && chmod 0700 /var/lib/kvobs
ENV KVOBS_DIR=/var/lib/kvobs \
    HF_HOME=/data/hf
USER 10001:10001
