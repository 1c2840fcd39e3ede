#!/usr/bin/env bash
# The prepared GPU check: ./benchmarks/gpu_check.sh --out benchmarks/gpu/$(date +%F)
# With .whl/ (benchmarks/gpu_wheels.sh, run beforehand where there is network), as on the GPU
# machine: its python3 (torch there), the wheels of the packages it lacks installed into a
# temporary folder, nothing from the network. Without .whl: the repo's .venv (tools/setup_env.sh),
# as for the CPU dry run (--device cpu --tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
    SITE=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
    missing=()
    for wheel in .whl/*.whl; do
        name=$(basename "$wheel" | cut -d- -f1)
        python3 -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null \
            || missing+=("$wheel")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing into $SITE: ${missing[*]##*/}"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${missing[@]}"
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    PYTHON=python3
else
    source tools/setup_env.sh
    PYTHON=python
fi
# Then the unit path's host cost on the same device (benchmarks/unit_host.py): kernel launches per
# unit and layer against a plain layer, and host against device time per unit-layer, into the same
# --out as unit_host_<device>.json. The check's exit status wins; 2 (no CUDA device) skips it.
out="" device=cuda
args=("$@")
for i in "${!args[@]}"; do
    case "${args[$i]}" in
        --out) out="${args[$((i + 1))]}" ;;
        --out=*) out="${args[$i]#--out=}" ;;
        --device) device="${args[$((i + 1))]}" ;;
        --device=*) device="${args[$i]#--device=}" ;;
    esac
done
status=0
"$PYTHON" benchmarks/gpu_check.py "$@" || status=$?
if [ "$status" -eq 2 ] || [ -z "$out" ]; then
    exit "$status"
fi
"$PYTHON" benchmarks/unit_host.py --count --device "$device" --repeats "${UNIT_HOST_REPEATS:-25}" --out "$out" \
    || { [ "$status" -ne 0 ] || status=$?; }
exit "$status"
