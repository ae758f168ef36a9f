# GPU vLLM with the kvturn connector: `vllm serve MODEL --kv-transfer-config ...` as in
# docs/connector.md. Build from the repository root:
#   docker build -f deploy/docker/vllm-connector.Dockerfile -t kvturn/vllm-connector:0.1.0 .
# The base is vLLM's own CUDA image; its vLLM version must be one the [gpu] extra allows
# (pyproject.toml, docs/deploy.md "Compatibility").
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY server ./server
COPY integrations ./integrations
# kvturn itself plus the NIXL build its connector is tested with; vLLM and torch stay the
# image's (no [gpu] extra here: pip would be free to replace them).
RUN python3 -m pip install --no-cache-dir . "nixl==1.5.1" && rm -rf /src
WORKDIR /
EXPOSE 8100 8101 5600
ENTRYPOINT ["vllm", "serve"]
