#!/bin/bash
# Builds .gpu/ in the repository root: the packages verst needs that a bare GPU image (Python 3.12 with its own
# torch, transformers, peft, accelerate, safetensors, numpy, pyarrow, tensorboard, httpx, rich, uvloop, pytest)
# lacks, for `make test-gpu` on a machine without network: wheels for Python 3.12 on x86-64 Linux, and Ray
# without its jars, RLlib, Tune, Train, Serve, Data and LLM libraries (verst uses its core), xz-compressed.
# The whole stays under 64 MiB. Run from the repository root on a machine that reaches PyPI:
#   make gpu-bundle        # then carry .gpu/ with the repository and run `make test-gpu` there
set -euo pipefail
G=$PWD/.gpu
LIMIT_MIB=64
mkdir -p "$G/whl"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pydantic pins its core: bump the two together
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection typing-extensions==4.16.0
        fastapi starlette uvicorn httptools opentelemetry-api gguf math-verify latex2sympy2_extended==1.11.0
        antlr4-python3-runtime==4.13.2 plotly jsonschema jsonschema-specifications referencing rpds-py)
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$G/whl" "${WHEELS[@]}" ${EXTRA_WHEELS:-}
if [ ! -f "$G/ray.tar.xz" ]; then
  T=$(mktemp -d)
  python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$T" "ray==${RAY_VERSION:-2.60.0}"
  (cd "$T" && python3 -m zipfile -e ray-*.whl . && rm ray-*.whl \
     && rm -rf ray/jars ray/rllib ray/llm ray/tune ray/train ray/serve ray/data \
     && tar cf - ray ray-*.dist-info | xz -T2 -6 > "$G/ray.tar.xz")
  rm -rf "$T"
fi
size=$(du -sm "$G" | cut -f1)
echo "$G: ${size} MiB"
if [ "$size" -gt "$LIMIT_MIB" ]; then
  echo "the bundle is over ${LIMIT_MIB} MiB" >&2
  exit 1
fi
