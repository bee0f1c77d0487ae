#!/usr/bin/env bash
# The project's test command: both levels, each under a hard timeout so a failing rank can
# never hang the run. Prints one summary line at the end; exits non-zero on any failure.
#   level 1: one process (per pytest-xdist worker), 8 simulated CPU devices (unit and equivalence tests)
#   level 2: mpirun -n $MPI_NP (default 8) real processes, tests marked @pytest.mark.mpi
# `bash tests/run.sh quick` runs only the quick tier instead (QUICK_FILES below: level 1 unit
# tests of each subsystem, no mpirun, no launch/pretrain.py or benchmark jobs; a few minutes).
# This is the CPU suite: it runs on the CPU backend even on a GPU host (the GPU set is
# `pytest -m gpu tests`, see README "GPUs and clusters").
set -u
cd "$(dirname "$0")/.."
NP=${MPI_NP:-8}
OUT=${TEST_OUT:-$(mktemp -d)}
mkdir -p "$OUT"
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu
# Most of this suite's time is XLA compiling small programs that then run for milliseconds, so
# LLVM's optimizations are off (JAX's own switch): compiles are shorter and the programs barely
# slower (bench/results/2026-11-startup-cpu.md). The launch/pretrain.py jobs of
# tests/test_pretrain_cli.py, which train for tens of iterations, set it to 0: they keep the
# optimizations.
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

if [ "${1:-}" = quick ]; then
    shift
    # The unit tests of each subsystem.
    # Left to the full command: mpi tests, the launch/pretrain.py, benchmark and example jobs,
    # whole-trainer runs, and the slowest variants of the equivalence tests listed below.
    QUICK_FILES=(
        test_imports test_import_structure test_parallel_state test_param_metadata           # state, runtime
        test_cluster test_jax_backend
        test_cpu_threads test_cpu_devices test_cpu_malloc test_gloo_chatter
        test_tensor_parallel_mappings test_tensor_parallel_layers                            # tensor parallel
        test_tensor_parallel_cross_entropy test_tensor_parallel_random_utils
        test_collectives test_grad_sync test_param_and_grad_buffer test_finalize_model_grads  # data parallel,
        test_ddp test_fsdp test_megatron_api                                                 # optimizer
        test_schedule_table test_pipeline_utils test_pipeline_p2p test_gpipe test_schedules   # pipeline
        test_context_parallel_attention test_moe                                             # cp, moe
        test_transformer_blocks test_fused_layer_norm test_fused_attention                   # model, fusions
        test_indexed_dataset test_gpt_dataset test_blended_dataset test_text_dataset          # data
        test_preprocess_data test_sft
        test_huggingface_configs test_huggingface                                           # HF models
        test_checkpointing test_model_arguments                                              # checkpoints, flags
    )
    QUICK_DESELECT=(
        test_schedules.py::test_interleaved_megatron_api_equals_reference       # 1F1B's twin stays
        test_context_parallel_attention.py::test_ring_block_products_use_the_cpu_kernel
        test_context_parallel_attention.py::test_query_tiles_with_document_mask_and_dropout
        test_context_parallel_attention.py::test_dropout_matches_full_attention
    )
    args=()
    for f in "${QUICK_FILES[@]}"; do args+=("tests/$f.py"); done
    for t in "${QUICK_DESELECT[@]}"; do args+=(--deselect "tests/$t"); done
    echo "=== quick: level 1 unit tests of each subsystem, 8 simulated devices (${WORKERS} workers)"
    timeout --signal=KILL "${QUICK_TIMEOUT:-900}" python -m pytest -q -p no:randomly -m "not gpu" "${XDIST[@]}" \
        "$@" "${args[@]}"
    exit $?
fi
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
