#!/bin/bash
# One device call for the kernels: run after `bash .gpu/a/stage.sh` (call 1, carry .gpu/a), as
#   bash .gpu/b/finish.sh && . /tmp/site/env.sh && bash benchmarks/gpu_session.sh STEP:SECONDS ...   (carry .gpu/b)
# STEP is kernels|gemm|attention|pytest|py with the phases after '=' (e.g. gemm=smoke,check:200); py takes a
# script and its arguments separated by spaces, quoted as one word ("py=benchmarks/x.py --steps a,b:300").
# Each step runs under its own wall-clock limit, so one hung kernel costs one step. Every result file is packed into
# $OUT/results.tar.gz (the device tool returns at most 8 files) and the log goes to $OUT/session.log.
set -u
res=/tmp/dsv4-results; rm -rf $res; mkdir -p $res /tmp/pp
ln -sfn "$PWD/kernels" /tmp/pp/dsv4_kernels
ln -sfn "$PWD/references" /tmp/pp/dsv4_references
export PYTHONPATH=$PWD:/tmp/pp:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/session.log
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  for spec in "$@"; do
    step=${spec%:*}; limit=${spec##*:}; name=${step%%=*}; phases=""
    [[ $step == *=* ]] && phases=${step#*=}
    echo "=== $name ${phases:+($phases) }limit ${limit}s $(date -u +%T)"
    case $name in
      kernels)   cmd=(python3 benchmarks/bench_kernels.py --out $res/kernels --deadline $((limit - 40))
                      ${phases:+--steps $phases}) ;;
      gemm)      cmd=(python3 benchmarks/bench_gemm.py --out $res/gemm ${phases:+--phases $phases}) ;;
      attention) cmd=(python3 benchmarks/bench_attention.py --out $res/attention --deadline $((limit - 10))
                      ${phases:+--phases $phases}) ;;
      py)        cmd=(python3 $phases) ;;                  # word-split on spaces (results: /tmp/dsv4-results)
      pytest)    cmd=(python3 -m pytest -q -p no:cacheprovider -rfE ${phases//,/ }) ;;
      *) echo "unknown step $name"; continue ;;
    esac
    # SIGABRT at the limit: with PYTHONFAULTHANDLER Python prints every thread's stack first, so a hung kernel
    # shows which launch or synchronize it was (a plain timeout left no trace of where, 2026-12-07)
    PYTHONFAULTHANDLER=1 timeout -s ABRT -k 5 "$limit" "${cmd[@]}"
    echo "=== $name exit $? $(date -u +%T)"
  done
} 2>&1 | tee "$log"
tar -czf ${OUT:-/tmp}/results.tar.gz -C $res .
