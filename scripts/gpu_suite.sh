#!/usr/bin/env bash
# Build allscan on a GPU machine and run the GPU suite and the benchmarks in one go.
#
#   scripts/gpu_suite.sh [stage ...]      (default: every stage)
#
# Stages: build tests testfiles perf perffill perfab perfhead perfbase benchbase perfmatrix perfa2a scanhost scanbench glakern glatest glabench
#         deltatest deltabench soak integration trainparity glatrain glatrain32 ulysses ulysses_host (default: all but testfiles, soak, perfab, perfhead, perfbase, benchbase, scanhost and glakern, the
#         investigations)
# perfbase: the standard sweep of an earlier tree's allscan_perf (BASE=<source dir>, default .base) and of this one,
#         alternated three times (a refactor's before/after, side by side in one run). benchbase: the same for a
#         Python benchmark, BENCHBASE="torchrun --nproc-per-node 1 bench/gla_bench.py --tlocal 16384 ..." (each
#         tree's own script on its own install).
# Limits: TIMEOUT_<stage> or STAGE_TIMEOUT seconds per stage; KSWEEP=0 skips the K sweep of perf.
# On fewer GPUs than a test has ranks, ALLSCAN_TEST_RANKS_PER_GPU=n lets n NCCL ranks share each GPU in the
#         tests and glatest/deltatest stages (results only: tests/distributed.py).
# Logs and JSON go to $OUT (default ./gpu_out); a short table is printed last.
# Needs: python3 with torch (CUDA), nvcc, cmake, ninja, pybind11, scikit-build-core; fla-core and
# yunchang wheels in .whl/ for the GLA and Ulysses comparisons (../shared/tools/device_wheels.sh);
# tilelang's wheels in .tl1/ and .tl2/ for the delta-rule stages (../shared/tools/device_tilelang.sh); or all of
# them packed into one carry, .gpuenv/env.tar.xz (scripts/pack_gpu_env.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
# Never turn NVLink multicast on (shared machines).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
STAGES=${*:-build tests perf perffill perfmatrix perfa2a scanbench glatest glabench deltatest deltabench integration trainparity glatrain glatrain32 ulysses ulysses_host}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# .gpuenv/env.tar.xz (scripts/pack_gpu_env.sh): every wheel below in one carry, unpacked once per machine and
# again when the archive changes; first on PYTHONPATH (below) when it unpacked, so it wins over the wheel folders
GPUENV=""
if [ -f .gpuenv/env.tar.xz ]; then
  sum=$(sha256sum .gpuenv/env.tar.xz | cut -d' ' -f1)
  if [ "$(cat /tmp/gpuenv/.unpacked 2>/dev/null)" != "$sum" ]; then
    rm -rf /tmp/gpuenv && mkdir -p /tmp/gpuenv &&
      tar -xJf .gpuenv/env.tar.xz -C /tmp/gpuenv && echo "$sum" > /tmp/gpuenv/.unpacked ||
      note "unpacking .gpuenv/env.tar.xz failed: the stages run without it"
  fi
  [ "$(cat /tmp/gpuenv/.unpacked 2>/dev/null)" = "$sum" ] && GPUENV=/tmp/gpuenv
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# tilelang (fla's delta-rule backward on Hopper with Triton 3.6) comes in two carries, .tl1 and .tl2
# (../shared/tools/device_tilelang.sh): each call installs what it carries into /tmp/tl, which stays
# on the machine while it is warm, so the call after the one carrying .tl1 has both.
for d in .tl1 .tl2; do
  if ls "$d"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tl "$d"/*.whl
  fi
done
for d in /tmp/site /tmp/tl $GPUENV; do
  [ -d "$d" ] && export PYTHONPATH=$d${PYTHONPATH:+:$PYTHONPATH}
done

run_stage() {  # name, command...
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*"
  # TIMEOUT_<name> or else STAGE_TIMEOUT (seconds) bounds each stage, so one slow stage cannot eat
  # a whole device call (rc 124 in the summary when it ran out).
  local limit_var="TIMEOUT_$name"
  timeout -k 10 "${!limit_var:-${STAGE_TIMEOUT:-1800}}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  note "$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$OUT/$name.log")"
  tail -n 25 "$OUT/$name.log"
  return $rc
}

PERF=""
for s in $STAGES; do
  case $s in
    build)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$SUMMARY"
      run_stage build python3 -m pip install --no-build-isolation --no-deps -v -e . || { cat "$SUMMARY"; exit 1; }
      ;;
    tests)
      # The GLA GPU tests compile fla's kernels: their own stage (glatest), not this one.
      run_stage tests python3 -m pytest -q -rsP -m gpu ${TESTS:-tests --ignore=tests/test_gla_gpu.py} -p no:cacheprovider --timeout 600 ;;
    testfiles)  # every file with GPU tests on its own, each bounded (TIMEOUT_t_<file> or STAGE_TIMEOUT) and in the
      # summary, so that one slow file costs its own time only; fla's autotuning one config per kernel (its full
      # tuning in every spawned rank took minutes a file)
      for f in ${GPU_TEST_FILES:-$(grep -l "mark.gpu" tests/test_*.py)}; do
        name=t_$(basename "$f" .py)
        ALLSCAN_FLA_AUTOTUNE=${ALLSCAN_FLA_AUTOTUNE:-one} run_stage "$name" python3 -m pytest -q -rs -m gpu "$f" \
          -p no:cacheprovider --timeout 600
      done ;;
    perf)
      PERF=$(ls build/*/bench/allscan_perf 2>/dev/null | head -1)
      [ -n "$PERF" ] || { note "perf: allscan_perf not built"; continue; }
      run_stage perf "$PERF" -b 4K -e 256M -f 2 -g "$NGPU" -K auto,4 -j "$OUT/perf.json"
      run_stage perf_graph "$PERF" -b 4K -e 256M -f 4 -g "$NGPU" -G 5 -K auto -j "$OUT/perf_graph.json"
      [ "${KSWEEP:-1}" = 0 ] || run_stage ksweep "$PERF" -b 64K -e 256M -f 4 -g "$NGPU" -m pipelined -K 1,2,4,8,16,32,64 -x chain -N 3 -j "$OUT/ksweep.json"
      ;;
    perfbase)  # before/after: the same standard sweep from an earlier tree and from this one, alternated
      PERF=$(ls build/*/bench/allscan_perf 2>/dev/null | head -1)
      BASE=${BASE:-.base}
      run_stage base_build bash -c "cmake -S '$BASE' -B /tmp/allscan_base -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release && cmake --build /tmp/allscan_base --target allscan_perf" || continue
      for i in 1 2 3; do
        run_stage "perfbase_before_$i" /tmp/allscan_base/bench/allscan_perf -b 4K -e 256M -f 2 -g "$NGPU" -K auto,4 -j "$OUT/perfbase_before_$i.json" > /dev/null
        run_stage "perfbase_after_$i" "$PERF" -b 4K -e 256M -f 2 -g "$NGPU" -K auto,4 -j "$OUT/perfbase_after_$i.json" > /dev/null
      done
      run_stage perfbase_compare python3 bench/compare_perf.py --before "$OUT"/perfbase_before_*.json --after "$OUT"/perfbase_after_*.json
      grep '^# largest' "$OUT/perfbase_compare.log" >> "$SUMMARY"
      ;;
    perfmatrix)  # the matrix-transition All-Scan against the bare send and the all-gather method
      PERF=$(ls build/*/bench/allscan_perf 2>/dev/null | head -1)
      run_stage perfmatrix "$PERF" -o matrix -b 64K -e 256M -f 2 -g "$NGPU" -K auto,4 -j "$OUT/perfmatrix.json"
      ;;
    perfa2a)  # the chunked all-to-all against NCCL's all-to-all of the same bytes
      PERF=$(ls build/*/bench/allscan_perf 2>/dev/null | head -1)
      run_stage perfa2a "$PERF" -o a2a -b 1M -e 256M -f 4 -g "$NGPU" -j "$OUT/perfa2a.json"
      ;;
    perffill)  # the head's own result in series after the send against perf's default
      PERF=$(ls build/*/bench/allscan_perf 2>/dev/null | head -1)
      ALLSCAN_HEAD_FILL=series run_stage perf_series "$PERF" -b 4K -e 256M -f 2 -g "$NGPU" -m pipelined -x chain -j "$OUT/perf_series.json"
      ;;
    perfab)  # 2 MiB, P = NGPU: the scan against the bare send, by how the head writes its own result (issue 2)
      # variant: name:ALLSCAN_HEAD_FILL:perf args (auto = the default: self copy up to 8 MiB)
      PERF=$(ls build/*/bench/allscan_perf 2>/dev/null | head -1)
      for i in 1 2; do
        for v in "auto:auto:-m pipelined -x chain" "side:side:-m pipelined -x chain" "series:series:-m pipelined -x chain" \
                 "graphauto:auto:-m pipelined -x chain -G 5" "graphside:side:-m pipelined -x chain -G 5" \
                 "auto_1M:auto:-m pipelined -x chain -b 1M -e 4M" "side_1M:side:-m pipelined -x chain -b 1M -e 4M"; do
          IFS=: read -r name hf args <<< "$v"
          name=ab_${name}_$i
          # shellcheck disable=SC2086
          ALLSCAN_HEAD_FILL=$hf run_stage "$name" "$PERF" -b 2M -e 2M -g "$NGPU" -N 11 $args > /dev/null
          grep -E '^ +(1048576|2097152|4194304) ' "$OUT/$name.log" | sed "s/^/$name /" >> "$SUMMARY"
        done
      done
      ;;
    perfhead)  # the full sweep, the head's result by the default (auto) against always beside the send
      PERF=$(ls build/*/bench/allscan_perf 2>/dev/null | head -1)
      for hf in auto side self; do
        ALLSCAN_HEAD_FILL=$hf run_stage "perfhead_$hf" "$PERF" -b 4K -e 256M -f 4 -g "$NGPU" -m pipelined -x chain -j "$OUT/perfhead_$hf.json"
      done
      ;;
    benchbase)  # a redesign's before/after of a Python benchmark: BENCHBASE (a command line, run from a tree's
      # root) in the earlier tree BASE (default .base) on its own plain install, then in this one, twice each
      BASE=${BASE:-.base}
      [ -n "${BENCHBASE:-}" ] || { note "benchbase: set BENCHBASE"; continue; }
      run_stage benchbase_build python3 -m pip install --no-build-isolation --no-deps --target /tmp/allscan_base_site "$BASE" || continue
      # this tree's editable install finds allscan ahead of PYTHONPATH, in every process a benchmark starts:
      # its .pth is set aside while the earlier tree runs, and put back whatever happens
      PTH=$(python3 -c 'import glob, sysconfig; print(*glob.glob(sysconfig.get_paths()["purelib"] + "/_editable_*allscan*.pth"))')
      for i in 1 2; do
        for f in $PTH; do mv "$f" "$f.aside"; done
        (cd "$BASE" && export PYTHONPATH=/tmp/allscan_base_site${PYTHONPATH:+:$PYTHONPATH} &&
         run_stage "benchbase_before_$i" bash -c "$BENCHBASE")
        for f in $PTH; do mv "$f.aside" "$f"; done
        run_stage "benchbase_after_$i" bash -c "$BENCHBASE"
      done
      ;;
    scanhost)  # host time of one scan call, piece by piece
      run_stage scanhost torchrun --nproc-per-node "$NGPU" bench/scan_host.py --out "$OUT" ;;
    glakern)  # tile sweep of the GLA incoming-state kernels (one GPU)
      run_stage glakern python3 bench/gla_kernels.py --out "$OUT" ;;
    scanbench)
      run_stage scanbench torchrun --nproc-per-node "$NGPU" bench/scan_bench.py --out "$OUT" ;;
    glatest)
      run_stage glatest python3 -m pytest -s -x -q -m gpu tests/test_gla_gpu.py -p no:cacheprovider ;;
    deltatest)  # the delta-rule layers on fla's kernels against fla and the exact answer (needs tilelang on Hopper)
      run_stage deltatest python3 -m pytest -s -q -rsP -m gpu ${DELTA_TESTS:-tests/test_delta_gpu.py} -p no:cacheprovider ;;
    soak)  # 10^5 scans and 10^4 fwd+bwd of each layer over NCCL: wrong results, memory and time per call
      run_stage soak torchrun --nproc-per-node "$NGPU" bench/soak.py --device cuda --check --out "$OUT" ${SOAK_ARGS:-} ;;
    deltabench)
      run_stage deltabench torchrun --nproc-per-node "$NGPU" bench/delta_bench.py --out "$OUT" ${DELTABENCH_ARGS:-} ;;
    glabench)
      run_stage glabench torchrun --nproc-per-node "$NGPU" bench/gla_bench.py --out "$OUT" ${GLABENCH_ARGS:-} ;;
    glatrain)
      run_stage glatrain torchrun --nproc-per-node "$NGPU" bench/gla_train.py --out "$OUT" ;;
    glatrain32)  # loss parity without bf16 rounding: fp32, IEEE matmuls, 2 layers, no throughput part
      run_stage glatrain32 torchrun --nproc-per-node "$NGPU" bench/gla_train.py --out "$OUT" --precision fp32 --layers 2 --tp-repeats 0 ;;
    integration)  # fla's models with allscan's layers against fla on the whole sequence (GDN needs tilelang)
      run_stage integration python3 -m pytest -s -q -rsP -m gpu tests/test_integration_fla.py -p no:cacheprovider ;;
    trainparity)  # examples/train_sp.py: 200 steps at SP = 2 against one process (and the noise floor)
      for v in "llama:float32" "llama:bfloat16" "gla:float32"; do
        IFS=: read -r model dtype <<< "$v"
        ALLSCAN_FLA_AUTOTUNE=one TRITON_F32_DEFAULT=ieee run_stage "train_${model}_${dtype}" torchrun --nproc-per-node "$NGPU" examples/train_sp.py \
          --model "$model" --dtype "$dtype" --steps ${TRAIN_STEPS:-200} --lr 1e-3 --compare
        grep -E '^(done|largest)' "$OUT/train_${model}_${dtype}.log" >> "$SUMMARY"
      done ;;
    ulysses)
      run_stage ulysses torchrun --nproc-per-node "$NGPU" bench/ulysses_bench.py --out "$OUT" --tag nvlink ${ULYSSES_ARGS:-} ;;
    ulysses_host)
      NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=0 run_stage ulysses_host torchrun --nproc-per-node "$NGPU" bench/ulysses_bench.py --out "$OUT" --tag host-staged ${ULYSSES_ARGS:-} ;;
    *) note "unknown stage $s" ;;
  esac
done
# The device tool returns at most 8 files: pack everything but the summary into one archive.
# The archive is written outside $OUT first: tar exits 1 ("file changed as we read it") when it
# writes into the directory it reads, and the files were then neither packed nor removed.
tgz=$(mktemp -u /tmp/allscan_out.XXXXXX).tgz
if tar czf "$tgz" -C "$OUT" --exclude=summary.txt --exclude=all.tgz . && mv "$tgz" "$OUT/all.tgz"; then
  find "$OUT" -type f ! -name all.tgz ! -name summary.txt -delete
else
  note "packing $OUT failed; the files are left as they are"
fi
echo; echo "=== summary"; cat "$SUMMARY"
