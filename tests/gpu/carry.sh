#!/usr/bin/env bash
# What the GPU machine needs beside the working tree, built here (see tests/gpu/README.md):
#   .whl/                  cp312 wheels the machine lacks: pyzmq and msgspec (kvdepot), and the
#                          pure-import dependencies of vLLM 0.33's Python files
#   .carry/vllm-py.tar.xz  vLLM 0.33's Python files (no compiled modules: vllm_stubs.py)
#   .kbuild/libkvdepot_kernels.so  the kernel library for sm_90
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .carry .kbuild
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl \
  pyzmq==27.3.0 msgspec==0.22.0 \
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 cachetools==8.0.2 \
  cbor2==6.3.0 pybase64==1.5.1 openai==3.57.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.6.1 fastapi==0.165.0 starlette==1.10.0 \
  opentelemetry-api==1.45.2 orjson==3.13.0 sniffio==1.3.1 jiter==0.19.0 distro==1.9.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
if [ ! -s .carry/vllm-py.tar.xz ]; then
  site=$(python3 -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("vllm").origin).parents[1])')
  (cd "$site" && find vllm -name '*.py' ! -path '*/tests/*' | tar cf - -T - vllm-*.dist-info) | xz -T2 -6 > .carry/vllm-py.tar.xz
fi
kvdepot build-kernels --arch 90 --out .kbuild/libkvdepot_kernels.so
du -sh .whl .carry .kbuild
