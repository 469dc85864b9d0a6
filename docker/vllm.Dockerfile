# vLLM's OpenAI server image with the kvobs plugin installed (ObservedOffloadingSpec,
# ObservedOffloadingConnector). Used by docker/compose.yaml; build from the repository root:
#   make image   (both images, tagged with the kvobs version), or
#   docker build -f docker/vllm.Dockerfile -t kvobs/vllm-openai:<kvobs version> .
# The image's ENTRYPOINT stays vLLM's own (`vllm serve`); pass the model and flags as the command.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.34.0

# kvobs's wheel, its hot path compiled (setup.py, mypyc) for the image's own Python; the build fails
# if it did not compile, so the engine never runs the slower pure-Python form unnoticed.
FROM ${VLLM_IMAGE} AS build
# gcc only builds the wheel in this throwaway stage; its exact version is the base image's, unpinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md setup.py /src/
COPY kvobs /src/kvobs
RUN python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src

FROM ${VLLM_IMAGE}
COPY --from=build /wheels /wheels
# kvobs's dependencies (numpy, prometheus-client, opentelemetry) are vLLM's too: no new packages.
# The engine runs as uid 10001, like the sidecar image: kvobs writes 0600 files the sidecar must read.
# /var/lib/kvobs and the Hugging Face cache are created here owned by that uid, so empty named
# volumes mounted there start with that owner.
RUN python3 -m pip install --no-cache-dir --no-deps /wheels/kvobs-*.whl \
    && rm -rf /wheels \
    && python3 -c "import kvobs.vllm, kvobs.hot_path_loader as r; assert r.HOT_PATH == 'compiled', 'kvobs: hot path not compiled'" \
    && groupadd --system --gid 10001 vllm \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/vllm --create-home --shell /usr/sbin/nologin vllm \
    && mkdir -p /var/lib/kvobs /data/hf \
    && chown 10001:10001 /var/lib/kvobs /data/hf \
    && chmod 0700 /var/lib/kvobs
ENV KVOBS_DIR=/var/lib/kvobs \
    HF_HOME=/data/hf
USER 10001:10001
