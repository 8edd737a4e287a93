# syntax=docker/dockerfile:1
# Training image: an NGC PyTorch base (CUDA, NCCL, InfiniBand user space, apex where the release ships it) plus this
# repository's pinned runtime dependencies. docker/bases.json names each image's base and the torch it trains with
# (tests/integration/test_image.py replays this install against those torch versions):
#   A100/H100 (default base, its own torch, CUDA 13):  docker build -t slamb-trainer:a100 .
#   V100 (CUDA 12.6 base; PyPI's torch 2.7.1 cu126 replaces the base's 2.6.0a0, which transformers refuses):
#     docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:24.12-py3 \
#       --build-arg TORCH_REQUIREMENTS=docker/requirements-torch-cu126.txt -t slamb-trainer:v100 .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --network host \
#     -v /data:/data -v "$PWD/runs":/workspace/runs slamb-trainer:a100 experiment=bert_large_phase1 data.path=/data/wiki_books
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}
# Empty: keep the base's torch. A requirements file (under docker/): the torch pair installed over it.
ARG TORCH_REQUIREMENTS=""

# The uid that owns /workspace/runs (match the host user that owns the mounted runs directory); not `UID`,
# which bash, the shell of the RUN steps, keeps read-only as the current user's.
ARG RUNS_UID=1000

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1 \
    PYTHONPATH=/opt/slamb

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# NCCL's InfiniBand transport needs the verbs user space: NGC bases ship it; a base without it gets Ubuntu's
# (unpinned: the versions differ between the Ubuntu releases of the A100 and V100 bases).
# hadolint ignore=DL3008
RUN if ! ldconfig -p | grep -q libibverbs.so.1; then \
      apt-get update \
      && apt-get install -y --no-install-recommends ibverbs-providers libibverbs1 librdmacm1 ibverbs-utils \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# Runtime dependencies only (no test or lint tools, no demo model). NGC bases (25.03+) constrain pip to their own
# package versions: only the constraints that refuse one of our pins are lifted (the build log lists them), the rest
# of the base stays as tested, and `pip check` fails the build if anything no longer fits together.
COPY requirements.txt /opt/slamb/requirements.txt
COPY docker/lift_constraints.py docker/requirements-torch-*.txt /opt/slamb/docker/
RUN torch_pins="${TORCH_REQUIREMENTS:+/opt/slamb/${TORCH_REQUIREMENTS}}" \
    && python /opt/slamb/docker/lift_constraints.py "${PIP_CONSTRAINT:-/etc/pip/constraint.txt}" \
       /opt/slamb/requirements.txt ${torch_pins:+"${torch_pins}"} > /opt/slamb/constraints.txt \
    && if [ -n "${torch_pins}" ]; then \
         pip uninstall -y torch torchvision torchaudio torch-tensorrt \
         && PIP_CONSTRAINT=/opt/slamb/constraints.txt pip install -r "${torch_pins}"; \
       fi \
    && torch_before="$(python -c 'import torch; print(torch.__version__)')" \
    && PIP_CONSTRAINT=/opt/slamb/constraints.txt pip install -r /opt/slamb/requirements.txt \
    && test "$(python -c 'import torch; print(torch.__version__)')" = "${torch_before}" \
    && pip check
ENV PIP_CONSTRAINT=/opt/slamb/constraints.txt

RUN useradd --no-log-init --create-home --non-unique --uid "${RUNS_UID}" trainer \
    && mkdir -p /workspace/runs /data \
    && chown trainer /workspace/runs

COPY conf /opt/slamb/conf
COPY data /opt/slamb/data
COPY models /opt/slamb/models
COPY optim /opt/slamb/optim
COPY train /opt/slamb/train
COPY benchmarks /opt/slamb/benchmarks
COPY docker /opt/slamb/docker
# The last check: the modelling stack imports under this torch, and a tiny BERT and a tiny Swin take a CPU step.
RUN python /opt/slamb/docker/smoke.py

USER ${RUNS_UID}
WORKDIR /workspace
# Checkpoints, logs and exports land in /workspace/runs/<name>; datasets are read from /data.
VOLUME ["/workspace/runs", "/data"]
ENTRYPOINT ["/opt/slamb/docker/entrypoint.sh"]
