FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jre-headless libpostgresql-jdbc-java \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY federation_sender ./federation_sender
COPY migrations ./migrations
RUN pip install --no-cache-dir -e .
# UID 991 as in Synapse's image: beside Synapse, the worker reads Synapse's signing key
# (mode 0640, owned by Synapse's user) from the shared data volume.
RUN useradd --system --uid 991 --home /app fedsender && mkdir -p /app/data && chown fedsender /app/data
USER fedsender
ENTRYPOINT []
CMD ["federation-sender", "worker"]
