#!/usr/bin/env bash
# One prepared check for an NVIDIA GPU machine (PyTorch, Triton, transformers; no internet, no
# flash-attn, nothing installed): the CUDA tests, the strategy's self-test on this device (a tiny Llama, Ulysses and
# FPDT + offload, float32 and bf16-mixed), then MFU and the largest FPDT + offload + activation offload sequence of a
# ~1B Llama on ONE GPU, without and with the model state in host memory (FSDP2 cpu_offload); each of those runs the
# self-test first, with its own settings. Run from anywhere; it works in the repository root. Ends in < 8 minutes.
#
#   bash benchmarks/gpu/check.sh OUTDIR            # on the GPU machine
#   DEVICE=cpu bash benchmarks/gpu/check.sh OUTDIR # dry run of the whole script on a CPU, toy sizes
#
# Writes check.log, pytest.log, pytest.xml, selftest.json, mfu.json, fit.json, fit_offload.json, summary.json into
# OUTDIR. Stages (each under `timeout`; a failed stage does not stop the next) and knobs: see benchmarks/README.md.
set -u

OUT=${1:?usage: bash benchmarks/gpu/check.sh OUTDIR}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2

PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
TOTAL_BUDGET=${TOTAL_BUDGET:-450}  # seconds for all stages together (the script must end < 8 min)
# the package of this source tree, installed or not: the scripts and the tests import it
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONWARNINGS=ignore
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

if [ "$DEVICE" = cpu ]; then  # dry run: same stages, toy sizes, the OOM paths simulated
    export LONGCTX_GPU_TESTS_ON_CPU=1
    TEST_TIMEOUT=${TEST_TIMEOUT:-240}; SELFTEST_TIMEOUT=${SELFTEST_TIMEOUT:-120}
    MFU_BUDGET=${MFU_BUDGET:-60}; FIT_BUDGET=${FIT_BUDGET:-60}
    OFFLOAD_FIT_BUDGET=${OFFLOAD_FIT_BUDGET:-60}
    SEQ_LENS=${SEQ_LENS:-"256 512 1024 2048"}; FIT_START=${FIT_START:-256}
    SELFTEST_EXTRA=(--device cpu)
    EXTRA=(--device cpu --tiny --simulate-oom-above 600)
    FIT_EXTRA=(--device cpu --tiny --chunk-size 128 --simulate-oom-above 1024 --max-len 4096)
    TOTAL_BUDGET=${TOTAL_BUDGET_CPU:-600}
else
    # 90 + 30 + 100 + 120 + 110 = the 450 s; each benchmark stage gets 20-30 s more as its hard limit, which the
    # last stages lose (cap) when the earlier ones overran. The self-test stage: imports, CUDA start, 4 tiny runs
    TEST_TIMEOUT=${TEST_TIMEOUT:-90}; SELFTEST_TIMEOUT=${SELFTEST_TIMEOUT:-30}
    MFU_BUDGET=${MFU_BUDGET:-100}; FIT_BUDGET=${FIT_BUDGET:-120}
    OFFLOAD_FIT_BUDGET=${OFFLOAD_FIT_BUDGET:-110}
    SEQ_LENS=${SEQ_LENS:-"32768 65536 131072 262144"}; FIT_START=${FIT_START:-65536}
    SELFTEST_EXTRA=(); EXTRA=(); FIT_EXTRA=()
fi
OFFLOAD_FIT_START=${OFFLOAD_FIT_START:-$FIT_START}  # the same lengths as stage 4: state offload at equal N

START=$SECONDS
left() { echo $((TOTAL_BUDGET - (SECONDS - START))); }
cap() { local want=$1 rest; rest=$(left); [ "$want" -lt "$rest" ] && echo "$want" || echo $((rest > 5 ? rest : 5)); }
stage() { echo; echo "=== [$((SECONDS - START))s] $* ==="; }
minus() { local v=$(($1 - $2)); echo $((v > 1 ? v : 1)); }

main() {
    stage "1/7 environment"
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
    timeout -k 5 60 "$PY" benchmarks/gpu/summarize.py env
    RC_ENV=$?

    stage "2/7 CUDA tests: pytest -m cuda tests/ (timeout $(cap "$TEST_TIMEOUT")s)"
    IGNORE=()  # the CLI tests need jsonargparse (LightningCLI); they hold no CUDA test
    if ! "$PY" -c "import jsonargparse" 2>/dev/null; then
        echo "jsonargparse is not installed: collecting without tests/test_cli.py"
        IGNORE=(--ignore=tests/test_cli.py)
    fi
    timeout -k 10 "$(cap "$TEST_TIMEOUT")" "$PY" -m pytest -q -m cuda tests/ -p no:cacheprovider ${IGNORE[@]+"${IGNORE[@]}"} \
        --continue-on-collection-errors -rA --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1
    RC_TESTS=$?
    tail -n 25 "$OUT/pytest.log"
    echo "pytest exit code: $RC_TESTS"

    stage "3/7 self-test on this device: a tiny Llama, Ulysses and FPDT + offload, 32-true and bf16-mixed (timeout $(cap "$SELFTEST_TIMEOUT")s)"
    timeout -k 5 "$(cap "$SELFTEST_TIMEOUT")" "$PY" benchmarks/gpu/longctx.py selftest --out "$OUT/selftest.json" \
        ${SELFTEST_EXTRA[@]+"${SELFTEST_EXTRA[@]}"}
    RC_SELFTEST=$?
    echo "selftest exit code: $RC_SELFTEST"

    # stages 4-6 run the self-test on their first length's batch first (in their JSON as self_test); exit status
    # 3: it failed on this device (the measurements still ran)
    stage "4/7 MFU, Ulysses (SDPA), N = $SEQ_LENS, the self-test first (budget ${MFU_BUDGET}s)"
    H=$(cap $((MFU_BUDGET + 30)))  # hard limit; the script plans its lengths within H - 30 s
    # shellcheck disable=SC2086  # SEQ_LENS is a list of numbers
    timeout -k 10 "$H" "$PY" benchmarks/gpu/longctx.py mfu --seq-lens $SEQ_LENS --budget-s "$(minus "$H" 30)" \
        --out "$OUT/mfu.json" ${EXTRA[@]+"${EXTRA[@]}"}
    RC_MFU=$?
    echo "mfu exit code: $RC_MFU"

    stage "5/7 largest sequence with FPDT + offload + activation offload, doubling from $FIT_START, the self-test first (budget ${FIT_BUDGET}s)"
    H=$(cap $((FIT_BUDGET + 20)))
    timeout -k 10 "$H" "$PY" benchmarks/gpu/longctx.py fit --start "$FIT_START" --budget-s "$(minus "$H" 20)" --steps 1 \
        --activation-offload \
        --out "$OUT/fit.json" ${FIT_EXTRA[@]+"${FIT_EXTRA[@]}"}
    RC_FIT=$?
    echo "fit exit code: $RC_FIT"

    stage "6/7 the same with the model state on the host (FSDP2 cpu_offload, fp32 master weights, bf16 compute), doubling from $OFFLOAD_FIT_START, the self-test first (budget ${OFFLOAD_FIT_BUDGET}s)"
    H=$(cap $((OFFLOAD_FIT_BUDGET + 20)))
    timeout -k 10 "$H" "$PY" benchmarks/gpu/longctx.py fit --start "$OFFLOAD_FIT_START" --budget-s "$(minus "$H" 20)" --steps 1 \
        --activation-offload --cpu-offload \
        --out "$OUT/fit_offload.json" ${FIT_EXTRA[@]+"${FIT_EXTRA[@]}"}
    RC_FIT_OFFLOAD=$?
    echo "fit --cpu-offload exit code: $RC_FIT_OFFLOAD"

    stage "7/7 summary"
    timeout -k 5 60 "$PY" benchmarks/gpu/summarize.py summary "$OUT" \
        --rc env=$RC_ENV tests=$RC_TESTS selftest=$RC_SELFTEST mfu=$RC_MFU fit=$RC_FIT fit_offload=$RC_FIT_OFFLOAD
    echo
    echo "done in $((SECONDS - START))s; files in $OUT:"
    ls -l "$OUT"
    [ "$RC_TESTS" -eq 0 ] && [ "$RC_SELFTEST" -eq 0 ] && [ "$RC_MFU" -eq 0 ] && [ "$RC_FIT" -eq 0 ] && [ "$RC_FIT_OFFLOAD" -eq 0 ]
}

main 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
