# Training image for A100/V100 clusters: the pinned stack (torch 2.14.1 CUDA build) and this repository.
#   docker build -t slamb-trainer .
#   docker run --gpus all --ipc=host -v /data:/data slamb-trainer experiment=bert_large_phase1 data.path=/data/wiki_books
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    HF_DATASETS_OFFLINE=1

WORKDIR /workspace
COPY requirements.txt .
RUN pip install -r requirements.txt

COPY . .
ENTRYPOINT ["docker/entrypoint.sh"]
