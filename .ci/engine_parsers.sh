#!/usr/bin/env bash
# CI step: the real engines' argument parsers check every `dflash-zoo serve --dry-run --json` command.
# A fresh venv (nothing cached across runs) gets the pinned vLLM and SGLang wheels with --no-deps, the CPU
# torch wheel, and the packages their parsers import (pinned; found by importing until nothing was missing),
# then runs .ci/engine_parsers.py. docs/serving.md says what runs and what cannot without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false VLLM_TARGET_DEVICE=cpu
ENGINES=(vllm==0.34.0 sglang==0.5.23)   # the newest releases on PyPI (pip index versions vllm / sglang)
PARSER_DEPS=(
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
    anyio==4.16.0 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0
    certifi==2026.10.19.post1 click==8.5.1 cloudpickle==3.1.3 einops==0.8.2 fastapi==0.165.0 h11==0.16.0
    httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 ipython==9.18.1 llguidance==1.9.1
    msgspec==0.23.0 multidict==7.2.1 numpy==2.4.6 openai==3.57.0 openai-harmony==0.0.8
    opentelemetry-api==1.45.2 orjson==3.13.0 packaging==26.4 partial-json-parser==0.2.1.1.post7
    pillow==13.0.0 prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0
    pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4 pyzmq==27.3.0
    regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0 sentencepiece==0.2.3 sniffio==1.3.1
    starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 traitlets==5.16.1 transformers==5.24.0 triton==3.9.0
    truststore==0.10.5 typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0 uvloop==0.23.0
    xgrammar==0.2.9 yarl==1.25.1 frozenlist==1.8.0
)
venv="${TMPDIR:-/tmp}/dflash-zoo-ci-engines"
echo "=== engine parsers: ${ENGINES[*]} ==="
rm -rf "$venv"
python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
pip install -q torch==2.13.0   # the CPU wheel; the engines pin newer CUDA builds, their parsers do not care
pip install -q --no-deps "${ENGINES[@]}" "${PARSER_DEPS[@]}"
pip install -q --no-deps -e .   # dflash-zoo itself; its other imports are among PARSER_DEPS
python .ci/engine_parsers.py
deactivate
rm -rf "$venv"
