#!/usr/bin/env bash
# The project's test command: both levels, each under a hard timeout so a failing rank can
# never hang the run. Prints one summary line at the end; exits non-zero on any failure.
#   level 1: one process (per pytest-xdist worker), 8 simulated CPU devices (unit and equivalence tests)
#   level 2: mpirun -n $MPI_NP (default 8) real processes, tests marked @pytest.mark.mpi
# This is the CPU suite: it runs on the CPU backend even on a GPU host (the GPU set is
# `pytest -m gpu tests`, see README "GPUs and clusters").
set -u
cd "$(dirname "$0")/.."
NP=${MPI_NP:-8}
OUT=${TEST_OUT:-$(mktemp -d)}
mkdir -p "$OUT"
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
# Most of this suite's time is XLA compiling small programs that then run for milliseconds: with
# LLVM's optimizations off (JAX's own switch) it took 15% less time on 2 cores (32.3 -> 27.6 min,
# 2026-11-28). The launch/pretrain.py jobs of tests/test_pretrain_cli.py, which train for tens of
# iterations, set it to 0: they keep the optimizations.
export JAX_DISABLE_MOST_OPTIMIZATIONS=${JAX_DISABLE_MOST_OPTIMIZATIONS:-1}

# Two pytest-xdist workers (TEST_WORKERS) share level 1 file by file: most of its time is XLA
# compiling small programs, one thread each, so a second worker uses the second core. Files go
# out in collection order, the slowest first (tests/conftest.py), not xdist's most-tests-first.
WORKERS=${TEST_WORKERS:-2}
XDIST=()
if [ "$WORKERS" -gt 1 ] && python -c "import xdist" 2>/dev/null; then
    XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
fi
# The workers share one on-disk compilation cache, fresh per run (tests/conftest.py).
export MCJ_TEST_CACHE_DIR="$OUT/compilation_cache"
rm -rf "$MCJ_TEST_CACHE_DIR"
echo "=== level 1: single process, 8 simulated devices (${WORKERS} workers)"
timeout --signal=KILL "${SINGLE_TIMEOUT:-2400}" python -m pytest -q -p no:randomly -m "not gpu" "${XDIST[@]}" \
    --junitxml="$OUT/single.xml" "$@" tests
rc1=$?

echo "=== level 2: mpirun -n $NP real processes"
# Processes that share the cores must not each spin up a full Eigen thread pool.
XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=false" \
timeout --signal=KILL "${MPI_TIMEOUT:-1500}" mpirun -x XLA_FLAGS -x JAX_PLATFORMS --oversubscribe -n "$NP" \
    python tests/mpi_rank.py --junitxml="$OUT/mpi" --color=no "$@"
rc2=$?

python tests/summarize.py "$OUT/single.xml" "$OUT"/mpi.rank*.xml
rc3=$?
echo "exit codes: single=$rc1 mpi=$rc2"
[ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ $rc3 -eq 0 ]
