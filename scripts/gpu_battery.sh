#!/usr/bin/env bash
# Issue #37's GPU rows: the battery on full-size random-weight shapes in bf16 at two prompt lengths
# (per probe: wall time, peak GPU memory, measured / plain forward, measured / floor), and the check
# that a device map splitting the layers between cuda:0 and the CPU writes the single-device records.
#
#   bash scripts/gpu_battery.sh OUT [TOKENIZER [OVERRIDE ...]]   # from the repository root, on a CUDA machine
#
# OUT gets one log and one --json file per model (named <model>$TAG). TOKENIZER is model.random_init.tokenizer: the
# embedded smollm2-135m (default) or a directory of its tokenizer files (a node without the embedded
# package). Further arguments are overrides for every job (KEY=VALUE or PROBE:KEY=VALUE, e.g.
# budget_mb=4096), after the script's own. Environment: MODELS (default "qwen3-8b gemma-3-4b qwen3-30b-a3b"), LENGTHS (default
# 1024,8192), SECONDS_PER_MODEL (default 170; a model's battery is stopped there, and what it printed
# stays in its log), SHRINK (false; true runs the same commands on the CPU-sized shapes, as a dry run),
# DEVICE (cuda), PROBES (default every probe the suite runs; a list runs those only).
#
# Random weights decide nothing: flips are counted with flip_rule=synthetic (the zoo lane's margin),
# on one scenario's pairs, with the zoo lane's work bounds for the probes whose work multiplies
# (every method and arm still runs). The timings are of random weights.
set -u
out=${1:?usage: gpu_battery.sh OUT [TOKENIZER [OVERRIDE ...]]}
tok=${2:-smollm2-135m}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
models=${MODELS:-qwen3-8b gemma-3-4b qwen3-30b-a3b}
lengths=${LENGTHS:-1024,8192}
limit=${SECONDS_PER_MODEL:-170}
shrink=${SHRINK:-false}
device=${DEVICE:-cuda}

common=(model.random_init.enabled=true "model.random_init.shrink=$shrink" "model.random_init.tokenizer=$tok"
        flip_rule=synthetic min_effect=0.005 scenario.families=null "scenario.ids=[favourite_colour]"
        scenario.n_instances=2 probe.n_boot=50)   # 2: heads, direction and suffix_recovery need a held-out split
bounds=("heads:probe.random.n_draws=1" "heads:probe.max_map_pairs_per_family=1" "heads:probe.ks=[1,4]"
        "suffix_recovery:probe.random.n_draws=1" "suffix_recovery:probe.grid.fractions=[0.5,1.0]"
        "suffix_recovery:probe.grid.counts=[1,4]" "suffix_recovery:probe.layer_bands=2"
        "edit:probe.ks=[0,4]" "edit:probe.max_pairs=4" "edit:probe.sweep_max_pairs=1" "edit:probe.max_control_pairs=2"
        "direction:probe.n_layers_scan=2" "direction:probe.random.n_draws=1" "direction:probe.max_pairs_per_family=1"
        "direction:probe.fit_scope=scenario")

for m in $models; do
    echo "== $m ($(date -u +%H:%M:%S))"
    PYTHONUNBUFFERED=1 timeout "$limit" python3 -m kvnotes battery --model "$m" --scenario small --device "$device" \
        --floor --lengths "$lengths" --json "$out/$m${TAG:-}.json" "${common[@]}" "${bounds[@]}" "$@" \
        ${PROBES:+--probes $PROBES} 2>&1 | tee "$out/$m${TAG:-}.log"
    echo "== $m exit ${PIPESTATUS[0]}"
done
