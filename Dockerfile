# syntax=docker/dockerfile:1
# Two images from one wheel (docs/operations.md, "Container images"):
#   docker build -t federation-sender:latest .                 # the worker (default target)
#   docker build -t federation-sender-batch:latest --target batch .   # + Java and Spark
# Both run as the non-root user 991, as Synapse's image does: beside Synapse, the worker
# reads Synapse's signing key (mode 0640, owned by Synapse's user) from a shared volume.

# The wheel, built as an operator would build it (sdist, then the wheel from the sdist).
FROM python:3.11-slim AS build
WORKDIR /src
RUN pip install --no-cache-dir "build>=1.2"
COPY pyproject.toml README.md ./
COPY federation_sender ./federation_sender
RUN python -m build --outdir /dist . && rm /dist/*.tar.gz

# What both images share: the interpreter, the user, the data directory.
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --system --uid 991 --home-dir /app --no-create-home fedsender \
    && mkdir -p /app/data && chown fedsender /app/data
WORKDIR /app

# The Spark batch jobs: Java, the JDBC drivers for PostgreSQL and SQLite, the batch extra.
FROM base AS batch
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
       libpostgresql-jdbc-java libxerial-sqlite-jdbc-java \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=build,source=/dist,target=/dist \
    pip install "$(ls /dist/federation_sender-*.whl)[batch]"
USER fedsender
CMD ["federation-sender", "batch", "--help"]

# The worker: the wheel and its runtime dependencies only, no Java, no Spark.
FROM base AS worker
RUN --mount=type=bind,from=build,source=/dist,target=/dist \
    pip install /dist/federation_sender-*.whl
USER fedsender
CMD ["federation-sender", "worker"]
