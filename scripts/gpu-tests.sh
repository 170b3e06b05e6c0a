#!/usr/bin/env bash
# Run the `cuda` tests (and the whole suite's CUDA parameters) on a GPU machine, from the
# checkout root: `bash scripts/gpu-tests.sh [pytest arguments]`. Builds the compiled copy
# (ipcsync._native) in place first where it can, and goes on without it where it cannot.
#
# Needs torch with CUDA, msgpack and pyzmq. Where pyzmq is missing and there is no network,
# put a pyzmq wheel for the machine's Python in .whl/ of the checkout (docs/testing.md); it
# is installed from there with `pip install --no-index`. The `cuda` tests include each
# example's test on the GPU (tests/integration/test_*_example.py). After the tests it runs
# the demo pipeline through ipcsync-run (DEMO=0 skips it) and the examples at their real
# sizes (EXAMPLES=0 skips them: examples/weight_sync, 1 GiB of bf16 to 2 workers;
# examples/gpu_pipeline, an encoder to 2 decoders; examples/kv_handoff, 200 requests); with
# BENCH=1 it also prints the CUDA benchmark table (BENCH_SUITE=all adds the real uses:
# training, inference, weightsync, gpupipe, kv;
# PLOT=path.png saves the chart); with TWO_GPU=1 (on a machine with two GPUs) the two-GPU
# pipeline against each stage alone; with MPS=1 all of it under a private MPS daemon (below).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import zmq" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
    else
        echo "gpu-tests: pyzmq is missing and there is no .whl/ to install it from" >&2
        exit 1
    fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
# The compiled copy (ipcsync._native), built in place from this checkout when it can be
# (a C compiler and the Python headers); otherwise the tests run on torch's copy (the
# fallback), and the native legs of the copy_path tests skip, saying why.
if python3 setup.py -q build_ext --inplace >/tmp/ipcsync-build-ext.$$.log 2>&1 \
        && python3 -c "import ipcsync._native" 2>/dev/null; then
    echo "gpu-tests: the compiled copy: built in place ($(ls ipcsync/_native*.so 2>/dev/null | head -n 1))"
else
    echo "gpu-tests: the compiled copy could not be built: torch's copy is used; the build said:"
    grep -iE "error|failed" /tmp/ipcsync-build-ext.$$.log | tail -n 3 | cut -c1-300 | sed 's/^/gpu-tests:   /'
fi
rm -f /tmp/ipcsync-build-ext.$$.log
python3 -c "import torch, zmq, msgpack; print('gpu-tests: torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'GPU(s), pyzmq', zmq.__version__)"
workers=${WORKERS:-4}
# MPS=1: the cuda tests, the demo, the examples and the bench run under a private MPS daemon
# (its own pipe and log directories, stopped at the end); the tests marked gpu_fault, which
# kill a process with GPU work in flight or fault the GPU on purpose, run after it without
# MPS: under MPS such a fault ends every process on the GPU, the other tests' too.
mps_dir=""
mps_stop() {
    if [ -n "$mps_dir" ]; then
        echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
        sleep 1
        grep -h "fatal GPU error" "$CUDA_MPS_LOG_DIRECTORY"/server.log 2>/dev/null | sed 's/^/gpu-tests: mps: /'
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        rm -rf "$mps_dir"
        mps_dir=""
    fi
}
if [ "${MPS:-0}" = "1" ]; then
    mps_dir=$(mktemp -d)
    mkdir -p "$mps_dir/pipe" "$mps_dir/log"
    export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
    trap mps_stop EXIT
    nvidia-cuda-mps-control -d || { echo "gpu-tests: the MPS daemon did not start" >&2; exit 1; }
    echo "gpu-tests: under a private MPS daemon ($mps_dir); gpu_fault tests run after it, without MPS"
    python3 -m pytest -q -p no:cacheprovider -p no:timeout -n "$workers" -m "cuda and not gpu_fault" "$@"
else
    python3 -m pytest -q -p no:cacheprovider -p no:timeout -n "$workers" -m cuda "$@"
fi
rc=$?
if [ "${DEMO:-1}" = "1" ]; then
    echo "gpu-tests: demo pipeline (python3 -m ipcsync.launch examples/pipeline.toml)"
    OMP_NUM_THREADS=1 python3 -m ipcsync.launch examples/pipeline.toml || rc=1
fi
if [ "${EXAMPLES:-1}" = "1" ]; then
    echo "gpu-tests: examples/weight_sync, 1 GiB of bf16 weights to 2 workers, 3 syncs"
    ep="wsync-gpu-$$"
    python3 examples/weight_sync/worker.py --endpoint "$ep" --rank 0 --exact --timeout 300 & w0=$!
    python3 examples/weight_sync/worker.py --endpoint "$ep" --rank 1 --exact --timeout 300 & w1=$!
    python3 examples/weight_sync/trainer.py --endpoint "$ep" --workers 2 --syncs 3 --timeout 300 || rc=1
    wait "$w0" || rc=1
    wait "$w1" || rc=1
    echo "gpu-tests: examples/gpu_pipeline, an encoder to 2 decoder replicas, 500 steps of 4096 x 4096 bf16"
    ep="gpipe-gpu-$$"
    python3 examples/gpu_pipeline/decoder.py --endpoint "$ep" --rank 0 --timeout 300 & d0=$!
    python3 examples/gpu_pipeline/decoder.py --endpoint "$ep" --rank 1 --timeout 300 & d1=$!
    python3 examples/gpu_pipeline/encoder.py --endpoint "$ep" --replicas 2 --timeout 300 || rc=1
    wait "$d0" || rc=1
    wait "$d1" || rc=1
    echo "gpu-tests: examples/kv_handoff, 200 requests of up to 256 MiB of KV, every first token checked"
    ep="kvh-gpu-$$"
    python3 examples/kv_handoff/decode.py --endpoint "$ep" --check --timeout 300 & dk=$!
    python3 examples/kv_handoff/prefill.py --endpoint "$ep" --requests 200 --timeout 300 || rc=1
    wait "$dk" || rc=1
fi
if [ "${TWO_GPU:-0}" = "1" ]; then
    python3 scripts/bench_two_gpus.py || rc=1
fi
if [ "${BENCH:-0}" = "1" ]; then
    python3 scripts/bench.py --device cuda --slots "${BENCH_SLOTS:-16}" --sizes "${BENCH_SIZES:-4K,1M,64M,256M}" \
        --suite "${BENCH_SUITE:-handoff}" ${PLOT:+--plot "$PLOT"} || rc=1
fi
if [ -n "$mps_dir" ]; then
    mps_stop
    python3 -m pytest -q -p no:cacheprovider -p no:timeout -n "$workers" -m "cuda and gpu_fault" "$@" || rc=1
fi
exit $rc
