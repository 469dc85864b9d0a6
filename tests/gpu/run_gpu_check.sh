#!/usr/bin/env bash
# kvobs in vLLM 0.34.0's GPU build, with vLLM's own CPUOffloadingSpec and CUDA transfer worker (issue 27, item 5).
# Run from anywhere on a machine with CUDA (`make test-gpu` calls it; on the lent GPU machine, which has no
# network, it is the one command): unpacks the bundle tests/gpu/bundle.py built (.gpu-carry: a trimmed vLLM
# 0.34.0 and the wheels the image lacks) into $WORK, installs the wheels there (--no-index --no-deps), patches
# the unpacked vLLM (tests/gpu/patch_vllm.py), checks that everything loads (tests/gpu/preflight.py), then runs
# the engines and checks (tests/gpu/gpu_check.py). Every step is bounded and says what is missing when it fails.
#
# Environment: OUT (results: summary.json, preflight.json, progress.log, logs.tar.gz; default /tmp/kvobs-gpu-out),
# PY (the python with torch+CUDA; default python3), CARRY (default <repo>/.gpu-carry), WORK (default
# /tmp/kvobs-gpu), TOTAL_S (the whole run's time, default 450), and gpu_check.py's SERVERS, SKIP, BUDGET_S, ...
# Exit status: gpu_check.py's (0 all checks passed, 1 one failed, 2 no engine started), 2 when something needed
# is not there, 3 when the preflight failed, 124 when a step ran out of time.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export OUT=${OUT:-/tmp/kvobs-gpu-out}
PY=${PY:-python3}
CARRY=${CARRY:-$ROOT/.gpu-carry}
WORK=${WORK:-/tmp/kvobs-gpu}
TOTAL_S=${TOTAL_S:-450}
START=$(date +%s)
mkdir -p "$OUT" "$WORK"

say() { echo "[$(( $(date +%s) - START ))s] run_gpu_check: $*" | tee -a "$OUT/progress.log"; }
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }
fail() { local rc=$1; shift; say "FAILED: $*"; echo "{\"failed\": \"$(echo "$*" | tr -d '"\\' | head -c 1500)\"}" >"$OUT/run.json"; exit "$rc"; }

command -v "$PY" >/dev/null || fail 2 "no $PY here"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
  || fail 2 "$PY has no torch that sees a CUDA device: the GPU check needs one"
ARCHIVE=$(ls "$CARRY"/vllm-*-trimmed.tar.xz 2>/dev/null | head -1)
[ -n "$ARCHIVE" ] && [ -d "$CARRY/wheels" ] && [ -f "$CARRY/torch_symbols.txt" ] \
  || fail 2 "no bundle in $CARRY: build it with 'python3 tests/gpu/bundle.py' (needs PyPI) and carry .gpu-carry"
say "$("$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")' 2>&1)"

say "unpacking $(basename "$ARCHIVE") into $WORK/vllm-tree"
rm -rf "$WORK/vllm-tree" "$WORK/site"
mkdir -p "$WORK/vllm-tree"
if command -v xz >/dev/null; then
  timeout 120 tar -xJf "$ARCHIVE" -C "$WORK/vllm-tree" || fail $? "unpacking $ARCHIVE"
else
  timeout 120 "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    "$ARCHIVE" "$WORK/vllm-tree" || fail $? "unpacking $ARCHIVE (Python's tarfile; no xz here)"
fi

say "installing $(ls "$CARRY"/wheels/*.whl | wc -l) wheels into $WORK/site (--no-index --no-deps)"
timeout 180 "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
  --target "$WORK/site" "$CARRY"/wheels/*.whl >"$OUT/pip.log" 2>&1 \
  || { tail -n 20 "$OUT/pip.log"; fail 2 "pip install of .gpu-carry/wheels failed: $(tail -n 3 "$OUT/pip.log" | tr '\n' ' ')"; }

"$PY" "$ROOT/tests/gpu/patch_vllm.py" "$WORK/vllm-tree" | tee -a "$OUT/progress.log"
[ "${PIPESTATUS[0]}" = 0 ] || fail 2 "patching the unpacked vLLM failed (another release?)"

export PYTHONPATH="$WORK/vllm-tree:$WORK/site:$ROOT:$ROOT/tests/gpu${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TRITON_CACHE_DIR="$WORK/triton" VLLM_CACHE_ROOT="$WORK/vllm-cache" \
  VLLM_EXPECTED=${VLLM_EXPECTED:-0.34.0} MODE=gpu
export PATH="$WORK/site/bin:$PATH"

say "preflight (torch symbols, kernels, imports)"
timeout 240 "$PY" "$ROOT/tests/gpu/preflight.py" "$CARRY" "$WORK/vllm-tree" 2>&1 | tee "$OUT/preflight.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || fail "$rc" "preflight (rc $rc): $(grep -a '^preflight FAILED' "$OUT/preflight.log" | tail -n 1)"

remaining=$(left)
[ "$remaining" -gt 150 ] || fail 124 "only ${remaining} s left of TOTAL_S=${TOTAL_S} for the engines"
export BUDGET_S=${BUDGET_S:-$(( remaining - 100 < 360 ? remaining - 100 : 360 ))}
say "gpu_check.py: budget ${BUDGET_S} s, hard limit $(( remaining - 10 )) s"
WORK="$WORK/run" timeout -k 10 $(( remaining - 10 )) "$PY" "$ROOT/tests/gpu/gpu_check.py"
rc=$?
if [ $rc = 124 ] || [ $rc = 137 ]; then
  say "gpu_check.py ran out of time (its summary.json holds what it finished)"
  [ -f "$OUT/logs.tar.gz" ] || (cd "$WORK/run" && tar -czf "$OUT/logs.tar.gz" ./*/engine.log ./sidecar-*.log 2>/dev/null)
fi
"$PY" - "$OUT/summary.json" <<'EOF' 2>/dev/null | tee -a "$OUT/progress.log"
import json, sys
s = json.load(open(sys.argv[1]))
for name, verdict in s.get("verdicts", {}).items():
    print(f"  {name}: {verdict}"[:600])
EOF
say "done, rc $rc"
exit $rc
