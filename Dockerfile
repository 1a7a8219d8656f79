# One image for the web server and the engine workers; installs the way `make setup` does.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 KVOPS_DATA_DIR=/data
RUN apt-get update \
 && apt-get install -y --no-install-recommends make redis-tools curl g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
# Same steps as `make setup`: the virtualenv with the pinned dependencies, then the
# default model converted into /data/models (a volume shared by all services). The CPU
# kernels are compiled at first use on the machine that runs the container.
RUN make PYTHON=python3.11 setup-python model
EXPOSE 8000
CMD [".venv/bin/python", "manage.py", "web", "--host", "0.0.0.0", "--port", "8000"]
