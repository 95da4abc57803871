#!/usr/bin/env bash
# The checks that need a CUDA device, in one go: the tests marked `gpu` (skipped elsewhere),
# the stall benchmark with the state on the GPU (reference: a pinned device-to-host copy of
# the same tensors, and torch's dcp.async_save with pinned staging), then, in whatever time
# is left of GPU_BUDGET_S, the 2000-tensor shape again without torch's flows and the rest of
# the suite with CUDA present.
#
#   benchmarks/gpu.sh [OUTDIR]        # from a checkout; PYTHON (default python3) must have torch
#
# Logs and the benchmark's JSON go to OUTDIR (default $OUT, else /tmp/rc_gpu). Each step has a
# deadline, so a hang costs its step, not the run. On an H200 (16 cores, 2026-11-27) the tests
# took about 95 s, the benchmark (one first-save trial, no memory saves) 175 s and the suite
# with 12 workers 220 s: the defaults fit one call of about ten minutes.
#
# Knobs (environment): GPU_BUDGET_S, GPU_TESTS_S (the gpu tests' deadline), GPU_BENCH_S (each
# benchmark's), GPU_BENCH_SHAPES, GPU_BENCH_REPS, GPU_BENCH_FIRST (first-save trials),
# GPU_BENCH_MEMORY (memory saves), GPU_BENCH_RANKS, GPU_BENCH_SKIP (flows to leave out, as
# bench_stall's --skip), and GPU_BENCH_BEFORE: a second checkout
# (main before a change, say) benchmarked right after this one, for a before/after measured
# on the same machine in the same call. Size it: on the H200, torch's flows took seconds a
# save at 1G/2000, so that shape with them did not finish in 160 s; 64M/2000 with every flow
# took about 100 s a tree.
set -u
out=${1:-${OUT:-/tmp/rc_gpu}}
py=${PYTHON:-python3}
budget=${GPU_BUDGET_S:-540}
ranks=${GPU_BENCH_RANKS:-1}
mkdir -p "$out"
start=$(date +%s)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
left() { echo $((budget - ($(date +%s) - start))); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, \
torch.cuda.get_device_name(), 'cpus', __import__('os').cpu_count())"

echo "== tests marked gpu =="
timeout "${GPU_TESTS_S:-240}" "$py" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
    -rfEs tests >"$out/gpu_tests.log" 2>&1
echo "exit $?"
grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -5

shapes=${GPU_BENCH_SHAPES:-2M/64,64M/2000,256M/8}
# bench TREE TAG SECONDS: the stall benchmark of the checkout at TREE, its log and JSON as TAG.
bench() {
    echo "== stall benchmark of $1, state on cuda, $ranks rank(s), $shapes =="
    PYTHONPATH="$1/src" timeout "$3" "$py" -m resilient_ckpt.cli.bench_stall --device cuda \
        --ranks "$ranks" --shapes "$shapes" --reps "${GPU_BENCH_REPS:-5}" --warmups 2 \
        --first-trials "${GPU_BENCH_FIRST:-2}" --memory-saves "${GPU_BENCH_MEMORY:-10}" \
        --skip "${GPU_BENCH_SKIP:-}" --json "$out/$2.json" >"$out/$2.log" 2>&1
    echo "exit $?"
    # Each shape's table is printed as it is done: cut short, the run still shows those.
    grep -v -e " INFO " -e "^\[rank" "$out/$2.log" | sed -n '/^Stall per save/,$p' | tail -70
    grep -E "Error|Traceback" "$out/$2.log" | head -5
}
bench "$PWD" stall_cuda "${GPU_BENCH_S:-240}"
# GPU_BENCH_BEFORE=DIR: the same benchmark of another checkout (say main before a change) in
# the same run, for a before/after on the same machine.
if [ -n "${GPU_BENCH_BEFORE:-}" ]; then
    bench "$GPU_BENCH_BEFORE" stall_cuda_before "${GPU_BENCH_S:-240}"
fi

# The 2000-tensor shape again without torch's flows: does a flow's aftermath (torch 2.11
# makes a fresh pinned stager per save) land in the next flow's stall?
if [ "$(left)" -gt 120 ]; then
    echo "== stall benchmark, 64M/2000 without torch's flows =="
    timeout 100 "$py" -m resilient_ckpt.cli.bench_stall --device cuda --ranks "$ranks" \
        --shapes 64M/2000 --reps "${GPU_BENCH_REPS:-5}" --warmups 2 --first-trials 1 \
        --memory-saves 0 --skip "dcp.async_save,dcp.async_save overlapped" \
        >"$out/stall_cuda_skip.log" 2>&1
    echo "exit $?"
    grep -v -e " INFO " -e "^\[rank" "$out/stall_cuda_skip.log" | sed -n '/^Stall per save/,$p' | head -14
fi

t=$(left)
if [ "$t" -gt 60 ]; then
    echo "== the rest of the suite with CUDA present (${t}s left) =="
    # -n: pytest-xdist where installed. The alias test needs the package installed (its .pth
    # hook runs at interpreter start), which a PYTHONPATH run of the checkout is not.
    workers=()
    "$py" -c "import xdist" 2>/dev/null && workers=(-n "${GPU_SUITE_WORKERS:-12}")
    # SIGINT at the deadline: pytest then still prints its summary, failures' tracebacks too.
    timeout -s INT -k 30 "$((t - 40))" "$py" -m pytest -v -p no:cacheprovider "${workers[@]}" -m "not gpu" \
        --timeout 120 --continue-on-collection-errors --ignore=tests/objstore -rfE \
        --deselect tests/compat/test_alias.py::test_environment_switch_at_interpreter_start \
        tests >"$out/suite.log" 2>&1
    echo "exit $? (2 or 124: out of time)"
    grep -E " (FAILED|ERROR) |passed|failed" "$out/suite.log" | grep -v "^E " | tail -25
fi
