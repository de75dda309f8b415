#!/usr/bin/env bash
# The GPU check of issue 32, run on a GPU machine from the repository root (README, "GPU check"):
# installs the carried wheels (.whl/, from scripts/gpu-wheels.sh) into $SITE, runs the GPU suite
# (pytest -m gpu tests/gpu) and the serving benchmark (benchmarks/serving_gpu.py), and writes
# $OUT/gpu-<kind>.json (device, tests {passed, failed, skipped}, figures, the commit; scripts/gpu_report.py),
# a copy in $RESULTS (benchmarks/results/, with serving-gpu.json; not for a CPU run), the junit XML, the
# benchmark's JSON and the log. A partial run (GPU_CHECK_TESTS narrows the suite, or BENCH_S=0) writes
# gpu-<kind>-partial.json instead: it never replaces the whole run's record. The commit is GPU_CHECK_COMMIT
# (a device machine's copy has no .git: pass it) or git's HEAD, "-dirty" when the tree has changes.
# At most about 8 minutes (the suite is stopped at SUITE_S seconds, the benchmark at BENCH_S), so that a
# 15-minute device lease holds the machine's start, one run and a rerun of part of it. Without a GPU
# every test skips and the record says device "cpu" (no benchmark). Usage: scripts/gpu-check.sh [KIND]
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${OUT:-bench-out/gpu-check}"
WHEELS="${WHEELS:-.whl}"
SITE="${SITE:-/tmp/site}"
SUITE_S="${SUITE_S:-300}"
BENCH_S="${BENCH_S:-150}"
RESULTS="${RESULTS:-benchmarks/results}"
mkdir -p "$OUT" "$RESULTS"
log="$OUT/gpu-check.log"
exec > >(tee "$log") 2>&1

gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
case "${1:-$gpu_name}" in
  nvidia-*|cpu) kind="$1" ;;
  *H200*) kind=nvidia-h200 ;;
  *H100*) kind=nvidia-h100-x1 ;;
  "") kind=cpu ;;
  *) kind="gpu-$(echo "$gpu_name" | tr -c 'A-Za-z0-9\n' '-')" ;;
esac
commit="${GPU_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
[[ -z "${GPU_CHECK_COMMIT:-}" && -n "$(git status --porcelain 2>/dev/null)" ]] && commit="$commit-dirty"
record="gpu-$kind"
[[ -n "${GPU_CHECK_TESTS:-}" || "$BENCH_S" == 0 ]] && record="gpu-$kind-partial"  # never the whole run's file
echo "gpu-check: kind $kind, card '${gpu_name:-none}', commit $commit, record $record, $(date -u +%FT%TZ)"

install_wheels() {  # install_wheels DIR TARGET: every wheel of DIR, no index, no dependency resolution
  local dir="$1" target="$2"
  compgen -G "$dir/*.whl" >/dev/null || { echo "no wheels in $dir: using what is installed"; return 0; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$dir"/*.whl
}
[[ "${GPU_CHECK_INSTALL_ONLY:-}" == 1 ]] && { install_wheels "$WHEELS" "$SITE"; exit $?; }

t0=$SECONDS
install_wheels "$WHEELS" "$SITE" || { echo "gpu-check: installing the wheels failed"; exit 2; }
# the repository first: opacus' wheel carries a top-level `benchmarks` package
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
install_s=$((SECONDS - t0))
"$PY" -c "import zoo_gym.server.cli, zoo_gym.client.cli, zoo_gym.gym_train, trl, opacus, bitsandbytes, triton" ||
  echo "gpu-check: an import failed (above); the suite will say which tests it stops"

t1=$SECONDS
# GPU_CHECK_TESTS narrows a rerun (pytest arguments, e.g. tests/gpu/test_serving_cuda.py); BENCH_S=0 skips the benchmark
read -ra tests <<<"${GPU_CHECK_TESTS:-tests/gpu}"
timeout -s INT -k 20 "$SUITE_S" "$PY" -m pytest -m gpu "${tests[@]}" -q -rs -p no:cacheprovider -o timeout=150 \
  --junitxml "$OUT/gpu-junit.xml"
suite_rc=$?
suite_s=$((SECONDS - t1))

t2=$SECONDS
bench=()
if [[ "$kind" != cpu && "$BENCH_S" != 0 ]]; then
  timeout -s INT -k 10 "$BENCH_S" "$PY" benchmarks/serving_gpu.py --size 0.6b --out "$OUT/serving-gpu.json"
  bench=(--bench "$OUT/serving-gpu.json")
fi
bench_s=$((SECONDS - t2))

"$PY" scripts/gpu_report.py --kind "$kind" --junit "$OUT/gpu-junit.xml" "${bench[@]}" \
  --extra "suite_exit=$suite_rc" --extra "install_seconds=$install_s" --extra "suite_seconds=$suite_s" \
  --extra "bench_seconds=$bench_s" --commit "$commit" $([[ $record == *-partial ]] && echo --partial) \
  --out "$OUT/$record.json"
if [[ "$kind" != cpu ]]; then  # a CPU run is no GPU figure
  cp "$OUT/$record.json" "$RESULTS/"
  [[ -s "$OUT/serving-gpu.json" ]] && cp "$OUT/serving-gpu.json" "$RESULTS/serving-gpu.json"
fi
echo "gpu-check: wrote $OUT/$record.json in $((SECONDS - t0)) s"
