# The kvturn router (no vLLM, no torch): `kvturn router`, configured by --config, flags and
# KVTURN_* variables. Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t kvturn/router:demo .
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY server ./server
COPY integrations ./integrations
# A regular (non-editable) install, then the sources go: the image holds the wheel's files only.
RUN pip install --no-cache-dir ".[router,redis]" && rm -rf /src
WORKDIR /
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvturn", "router"]
CMD ["--help"]
