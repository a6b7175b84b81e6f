#!/usr/bin/env bash
# What a session on the lent H200 runs, in calls that each fit the device's 10-minute limit:
#   bash benchmarks/gpu_session.sh tests      # the GPU tests (203 s on an H100, thirty-seventh session; run
#                                             # pytest through this script or with PYTHONPATH=$PWD:/tmp/site:
#                                             # the executor's replay imports simpy)
#   bash benchmarks/gpu_session.sh b1         # lean and reference engines, batch 1, pools 16/20/26, all policies
#   bash benchmarks/gpu_session.sh b48        # batches 8 and 4, pools 20/16/26, the GPU-only policies
#   bash benchmarks/gpu_session.sh cpu48      # batches 4 and 8, lfu-fallback and static (their CPU twins
#                                             # take ~150 s to build, so they get a call of their own)
#   bash benchmarks/gpu_session.sh gptq       # issue 17: GPTQModel-made GPTQ/AWQ checkpoints (carry .gq, made
#                                             # here by benchmarks/gptq_h200.py make) run as stored, both engines
#   bash benchmarks/gpu_session.sh validate   # issue 15: calibrate (the 4-layer cut, ~50 s, then the built
#                                             # model, which predicts; CAL=cut or CAL=built for one), then
#                                             # measure the GPU-only policies at pools 16/20/26, batches
#                                             # 1/2/4/8; the tarballs under $OUT go to benchmarks/validate_table.py here;
#                                             # SPEC=PRESET POOLS=GB,GB BATCHES=B,B for another model's shapes;
#                                             # CAL=built BATCHES=1,2,4,8 fitted one call (401-419 s on an H100) until
#                                             # the forty-sixth session (see PROFILE below); 414 s in two calls on
#                                             # the H200 (twenty-fourth session); issue 15's
#                                             # calibrations across sessions: validate_table.py FOLDER --against
#                                             # benchmarks/results/validate-lean-h100-fa7b3d0/profile.json;
#                                             # from 8c0f082 on, calibrate and each run time the CPU's plain
#                                             # loop: validate_table.py --cpu-ref-adjust reads the runs at it
#                                             # (VT=SECONDS bounds the whole validation, calibration included (under 260 s
#                                             # refused unless PROFILE= or CAL=cut), for a call that runs tests first;
#                                             # POLS=upper,lfu-fallback,static the CPU-expert policies, twins built;
#                                             # PROFILE=FILE.json (in the tree) uses it, no calibration: the built
#                                             # model's took 251 s on an H100 (forty-sixth session), so CAL=built
#                                             # BATCHES=1,2,4 VT=420 then PROFILE=... BATCHES=8 in a second call)
#   bash benchmarks/gpu_session.sh cpu-threads  # issue 15: why CPU experts' speed moves between runs: the host's facts,
#                                             # isolated CPU experts and static/lfu-fallback at batch 8 at each torch
#                                             # thread count of THREADS (16,15,14,8), the link busy or not; the
#                                             # isolated part also under OMP_PROC_BIND=close and OMP_WAIT_POLICY=PASSIVE
#                                             # in processes of their own (~6 min)
#   bash benchmarks/gpu_session.sh cpu-wait   # issue 15: does OpenMP spinning without end (OMP_WAIT_POLICY=ACTIVE)
#                                             # remove the CPU experts' wake-up after idle? static and lfu-fallback at
#                                             # batch 1, pool 26 (CPU experts far apart), in a process with it and one
#                                             # without (~5-6 min: each builds its store)
#   bash benchmarks/gpu_session.sh cpu-nt     # issues 13, 15: under OMP_WAIT_POLICY=ACTIVE, a process with 16 OpenMP
#                                             # threads and one with 14 (THREADS), each: isolated CPU experts, then
#                                             # static (pool 16) and lfu-fallback (pool 20) at batch 8, three rounds
#                                             # (the runs' spread at each thread count; ~8 min: each process's store
#                                             # takes ~130-180 s of its 270, so two processes got 0 and 1 rounds)
#   bash benchmarks/gpu_session.sh cpu-nt-iso # the same question without a store: isolated CPU experts only, processes
#                                             # alternating 16/14/15/12 threads (THREADS) under ACTIVE, CYCLES (2) cycles
#                                             # (~2 min), XENV more settings (XENV="OMP_PROC_BIND=close OMP_PLACES=cores")
#   bash benchmarks/gpu_session.sh cpu-bind-ab  # the binding's A/B in one call: isolated CPU experts at 16 threads under
#                                             # ACTIVE, processes alternating unbound and bound, CYCLES (2) cycles (~1 min)
#   bash benchmarks/gpu_session.sh cpu-pages  # issues 13, 15: the CPU experts' bytes on 4 KiB pages against the same bytes on
#                                             # 2 MiB pages (cpu_pages_h200.py), under ACTIVE: isolated experts in two
#                                             # processes, then one store's static/lfu-fallback runs with each copy of its
#                                             # twins, ROUNDS (2) rounds (~7 min)
#   bash benchmarks/gpu_session.sh cpu-experts  # issue 15: the lean GPU tests over the CPU-expert policies' graphs
#                                             # (7267969), then POLS=upper,lfu-fallback,static validate with the
#                                             # Python step calibrated (970abb6), pools 16/20/26, batches 1/8 (~7 min)
#   bash benchmarks/gpu_session.sh cpu-program  # issue 13/15: the host program planning lfu-fallback and static (their
#                                             # CPU work called back, twenty-eighth session): the GPU test against the
#                                             # Python step, then the same validation as cpu-experts (496 s on an H100
#                                             # at f25c18e; calibrate's sparse static run since adds a little); its
#                                             # folder also goes to benchmarks/cpu_wake_diagnosis.py (in sample)
#   bash benchmarks/gpu_session.sh pin-ab     # issue 15: is the host lane's slow state (forty-eighth session: tens of passes
#                                             # at ~5 us a layer against ~2.4, the pass boundary 553-601 us against
#                                             # 173-242) the host thread's core? affinity_probe.py, the thread free and
#                                             # pinned to one core alternating, ROUNDS (4) rounds of POLS at POOL (26) GB,
#                                             # batch 1, each run's share of slow passes and median boundary (~2 min;
#                                             # forty-ninth session, an H100: 85 s, both arms slow together); each run
#                                             # also times a CPU loop, a cudaEventRecord, a cudaGraphLaunch and a torch
#                                             # graph replay before it and after it, to see which of them the slow state
#                                             # moves (fifty-first session, an H100: none, timed before;
#                                             # fifty-second: all four timed after, r 0.91-0.94)
#                                             # (ARMS=free ROUNDS=8 for that alone); a whole validation pinned:
#                                             # CMOE_PIN_HOST=auto bash ... validate
#   bash benchmarks/gpu_session.sh host-ab    # issue 13: the host's step by phase, batch 1, pool 20, in four
#                                             # processes alternating .before/ (a tree to compare against,
#                                             # carried) and this tree; logs and JSON under $OUT/host-ab/
#   bash benchmarks/gpu_session.sh ncu        # issue 14: the M = 1 kernels under Nsight Compute (counters,
#                                             # stall reasons, per-instruction samples) into $OUT/ncu.tgz
#   bash benchmarks/gpu_session.sh variants   # issue 14: kernel variants against the committed configs, M 1-16
#   bash benchmarks/gpu_session.sh kernel-ab [MS [VARIANTS [TWIN.json]]]  # issue 14: kernel_variants_h200.py at
#                                             # M in MS (1,2,4,8,16) for VARIANTS (all), then upper at batches
#                                             # 1/4/8 as committed and with TWIN's configurations (default: the
#                                             # variants' fastest per M), then the expert kernels' GPU tests
#   bash benchmarks/gpu_session.sh few        # issues 13, 15: the few-expert graphs (`cmoe.executor.few_experts`): their
#                                             # GPU test, the host-program and calibration GPU tests, wave_config_h200.py
#                                             # (a wave of n experts on each configuration, M 8/16), then the loading
#                                             # policies at batch 8, pools 20/26, each right after its twin with
#                                             # CMOE_FEW_EXPERTS=off (on by default since the forty-second session's A/B on an H100;
#                                             # ~6-8 min; AB_S, AB_TOK, POOLS, POLS trim it)
#   bash benchmarks/gpu_session.sh few-tests  # its GPU tests alone (at most 150 s: a short call when little device time is left)
#   bash benchmarks/gpu_session.sh check      # a session's first call: expert_kernel_h200.py --no-sweep (CONFIGS,
#                                             # torch int4, bf16 and gemlite in one run, M 1-64; gemlite where .whl
#                                             # holds its wheel: bash benchmarks/gemlite_wheel.sh), upper at batches
#                                             # 1/4/8, then the expert kernels', lean and executor GPU tests in what is
#                                             # left of 570 s (a fixed 260 s stopped them after 17 tests on a fresh H100,
#                                             # forty-seventh session, where the other two took ~165 s)
#   bash benchmarks/gpu_session.sh fuse-ab    # the step-kernel, attention and lean GPU tests, then upper at batches
#                                             # 1/4/8 as committed and with each engine switch of ABL turned off
#                                             # (default CMOE_ROUTE_MM=0,CMOE_LEAN_LAYER=0), then the b1 kernel profile
#   bash benchmarks/gpu_session.sh gemv       # the decode projections: kernels_triton.gemv against F.linear (cuBLAS),
#                                             # M 1/4/8, its CUDA test, the lean GPU tests with cuBLAS (CMOE_GEMV=0),
#                                             # then upper at batches 1/4/8 with and without it (~5 min)
#   bash benchmarks/gpu_session.sh attn       # the attention and step-kernel tests, the lean GPU tests,
#                                             # attention_h200.py, then upper at batches 1/4/8 beside each switch of ABL
#                                             # (default CMOE_ATTN_SPLIT=0, CMOE_ATTN_SPLIT=keys, CMOE_QKV_NORM=1,
#                                             # CMOE_PDL=1; ~8 min)
#   bash benchmarks/gpu_session.sh ncu-variants [NAMES]  # the same variants' M = 1 launches under ncu
#   bash benchmarks/gpu_session.sh host-wake  # issue 15: the folded norm's test and gemv_h200.py, then host_wake_h200.py:
#                                             # a fixed host step after waits of each kind and length (~2 min)
#   bash benchmarks/gpu_session.sh wait       # issue 15: the host polling each read-back (CMOE_WAIT=spin) against its
#                                             # event sync, batch 2, pools 16/26, ondemand and oracle, right before each
#   bash benchmarks/gpu_session.sh sampler-ab # issue 15: the host-load sampler none / a thread (as it was) / a child
#                                             # process, alternating, lru-prefetch and ondemand at pool 26 batch 4 (~3 min:
#                                             # the first call of the thirty-sixth session printed nothing in 120 s, its
#                                             # warm-ups compiling each policy's program on a fresh machine)
#   bash benchmarks/gpu_session.sh spin-ab    # issue 15: does libgomp's spinning team (OMP_WAIT_POLICY=ACTIVE, what every
#                                             # validation set until 49eb55a) slow the GPU-only runs' host? processes
#                                             # alternating ACTIVE and PASSIVE, CYCLES (2) cycles, each waking the team
#                                             # before every round, samplers none/thread/process (MODES), lru-prefetch and
#                                             # ondemand at pool 26 b4; no process starts past SPT (380) s (~6 min);
#                                             # WAITS="default PASSIVE" for libgomp's default against PASSIVE
#                                             # (thirty-eighth session: MODES=none CYCLES=3 SPT=300, 235 s);
#                                             # even cycles run the arms in reverse order (from fca27a2 on)
#   bash benchmarks/gpu_session.sh ab-validate  # sampler-ab, then validate (CAL=built BATCHES=... as validate's)
#   bash benchmarks/gpu_session.sh host-tests # the host-call, lean and reference-engine GPU tests (~1 min)
#   bash benchmarks/gpu_session.sh program    # issue 13: the compiled host program (numba on the device), its
#                                             # CPU and GPU tests, then each loading policy beside the Python step
#                                             # (CMOE_HOST_PROGRAM=0, right before it): Mixtral at batch 1 and 4,
#                                             # pool 20; OLMoE at batch 1 and 4, pool 3 (~6 min)
#   bash benchmarks/gpu_session.sh live       # issue 13: the program planning live runs (no trace; host_live): its
#                                             # CPU tests, the host-program GPU tests (replayed and live), then each
#                                             # live-planned policy beside the Python step, Mixtral b1/b4 pool 20 and
#                                             # OLMoE b1/b4 pool 3, prompts of 64 random tokens (~8 min)
#   bash benchmarks/gpu_session.sh ahead      # issue 13: the look-ahead policies' replays in the program: the host-
#                                             # program GPU tests (replayed with adaptive-ahead and commit-ahead, live
#                                             # at batch 1 too), then both beside the Python step, Mixtral b1/b4
#                                             # pool 20 and OLMoE b1 pool 3 (~7 min)
#   bash benchmarks/gpu_session.sh step-ab    # the cache's slot stepped on the device (CMOE_DEVICE_STEP=1) against copied in:
#                                             # the lean GPU tests that cover it and the host program (its events handed
#                                             # over anew, twenty-fifth session), then upper, lru-prefetch and oracle at
#                                             # pool 26, batches 1 and 8, each right after its twin, timelines kept (~6 min)
#   bash benchmarks/gpu_session.sh boundary   # issue 15: the host's pass boundary by phase with the compiled program running
#                                             # (CMOE_HOST_PROFILE=pass), pools 16 and 26, batches 1 and 8, timelines kept (~5 min)
#   bash benchmarks/gpu_session.sh calib      # issue 15: `cmoe calibrate` alone on the 4-layer cut (~1-2 min), its profile
#                                             # and measurements into $OUT and the terms that moved between calibrations
#   POLS=upper,lfu-fallback,static CAL=built bash benchmarks/gpu_session.sh validate-r 1,8  # CPU-expert policies run
#                                             # twice each (twenty-ninth session: a run's CPU speed moves 0.7-1.5x
#                                             # between runs, so their error reads against the runs' spread; 454 s
#                                             # on an H100, thirtieth session); validate_h200.py sets OMP_WAIT_POLICY=ACTIVE
#                                             # itself unless it is given (1216acc: threads that spin, as the CLI sets it
#                                             # for CPU experts; 448-452 s, thirty-first session); results.json records it
#                                             # (omp_env, omp_wait); OMP_WAIT_POLICY=PASSIVE before it for threads that sleep
#   bash benchmarks/gpu_session.sh validate-r 1,2,4   # the same with every configuration run twice (--repeat),
#   bash benchmarks/gpu_session.sh validate-r 8       # in two calls: all four batches took over 450 s of runs
#                                             # on the H200 (sixth session); each call calibrates again
# Results go under $OUT (the device tool brings them back); carry .whl (simpy) with the call.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# (a mode that runs another as `bash "$0" MODE` sets KCACHE=0 for it: the outer call already unpacked the caches,
# exported their folders and saves them on exit)
# KCACHE=1: Triton's and numba's compiled kernels in .kcache/, sent back as $OUT/kcache.tar (xz where the machine
# has it); copy that file to the tree's root as .kcache.tar and carry it: the next call unpacks it (its ~94 MB unpacked
# are past what a call carries). A fresh machine's first calibration spends ~40-70 s compiling: calibrate's batch-1
# step took 69-112 s (warm-up 6.5-11 s) on the H100s' first calls, 25-54 s (warm-up 2-5 s) where an earlier call
# had compiled the kernels (profile.measurements.json "seconds" under benchmarks/results; forty-seventh session:
# 185 s for the whole calibration, warm, against the forty-sixth's 251 s, fresh).
# Off by default: with it a run's first-request cost is a second launch's, not a user's first.
save_kcache() { if command -v xz >/dev/null; then XZ_OPT=-T0 tar cJf "$OUT/kcache.tar" .kcache 2>/dev/null || return 0
                else tar czf "$OUT/kcache.tar" .kcache 2>/dev/null || return 0; fi
                local n; n=$(stat -c %s "$OUT/kcache.tar")
                if [ "$n" -gt 16000000 ]; then rm -f "$OUT/kcache.tar"; echo "gpu_session: kcache ($n bytes) over what comes back" >&2
                else echo "gpu_session: kcache.tar $n bytes, $(find .kcache -type f | wc -l) files" >&2; fi; }
if [ "${KCACHE:-0}" = 1 ]; then
  [ -f .kcache.tar ] && tar xf .kcache.tar
  mkdir -p .kcache/triton .kcache/numba
  export TRITON_CACHE_DIR=$PWD/.kcache/triton NUMBA_CACHE_DIR=$PWD/.kcache/numba
  echo "gpu_session: the compile cache .kcache/ starts with $(find .kcache -type f | wc -l) files" >&2
  trap save_kcache EXIT
fi
# the device's copy of the tree may carry an older .git, so git's HEAD there can name the wrong tree
[ -n "${COMMIT:-}" ] || echo "gpu_session: COMMIT is not set; results will carry the device's git HEAD, which may lag the tree" >&2
B="python3 benchmarks/lean_h200.py --tokens 256 --policy-tokens 128 --repeats 3 --hf-tokens 64 --budget-s 520"
# upper at batches 1/4/8, pool 20, two runs each: upper SECONDS BUDGET [lean_h200.py options]
upper() { timeout "$1" python3 benchmarks/lean_h200.py --out "$OUT/lean" --tokens 128 --batches 1,4,8 --pools 20 \
            --engines lean --policies "" --repeats 2 --budget-s "$2" "${@:3}" 2>&1 | grep -E "^lean|^HBM|^built|rror" || true; }
# the calibration's terms that moved between calibrations (twenty-third session), printed after a validation
terms() { python3 -c "import json; p = json.load(open('/tmp/v/profile.json')); print('terms', {k: round(p.get(k) or 0.0, 3)
  for k in ('host_pass_start_us', 'host_head_us', 'commit_start_us', 'copy_compute_slowdown', 'copy_attention_slowdown',
            'readback_copy_us', 'launch_copy_us', 'commit_gpu_copy_us', 'start_copy_us')})" 2>&1 | tail -1 || true; }
case "${1:-}" in
  program) python3 -c "import numba, llvmlite; print('numba', numba.__version__, 'llvmlite', llvmlite.__version__)"
     timeout 90 python3 -m pytest -q tests/test_host_program.py -p no:cacheprovider 2>&1 | tail -3 || true
     timeout 200 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -k host_program -p no:cacheprovider 2>&1 | tail -15 || true
     P="python3 benchmarks/lean_h200.py --tokens 64 --repeats 1 --engines lean --policies ondemand,lru-prefetch,oracle,adaptive,commit --env-ablation CMOE_HOST_PROGRAM=0"
     timeout 150 $P --out "$OUT/prog-mixtral" --batches 1,4 --pools 20 --budget-s 120 2>&1 | grep -E "^lean|^HBM|^built|rror" || true
     timeout 150 $P --out "$OUT/prog-olmoe" --spec olmoe-1b-7b --batches 1,4 --pools 3 --budget-s 120 2>&1 | grep -E "^lean|^HBM|^built|rror" || true ;;
  live) python3 -c "import numba, llvmlite; print('numba', numba.__version__, 'llvmlite', llvmlite.__version__)"
     timeout 120 python3 -m pytest -q tests/test_host_program.py tests/test_host_live.py -p no:cacheprovider 2>&1 | tail -3 || true
     timeout 200 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -k host_program -p no:cacheprovider 2>&1 | tail -15 || true
     P="python3 benchmarks/lean_h200.py --live --tokens 64 --repeats 1 --engines lean --policies ondemand,lru-prefetch,adaptive,commit --env-ablation CMOE_HOST_PROGRAM=0"
     timeout 150 $P --out "$OUT/live-mixtral" --batches 1,4 --pools 20 --budget-s 120 2>&1 | grep -E "^lean|^HBM|^built|rror" || true
     timeout 110 $P --out "$OUT/live-olmoe" --spec olmoe-1b-7b --batches 1,4 --pools 3 --budget-s 80 2>&1 | grep -E "^lean|^HBM|^built|rror" || true ;;
  ahead) timeout 260 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -k host_program -p no:cacheprovider 2>&1 | tail -15 || true
     P="python3 benchmarks/lean_h200.py --tokens 64 --repeats 1 --engines lean --policies adaptive-ahead,commit-ahead --env-ablation CMOE_HOST_PROGRAM=0"
     timeout 170 $P --out "$OUT/ahead-mixtral" --batches 1,4 --pools 20 --budget-s 140 2>&1 | grep -E "^lean|^HBM|^built|rror" || true
     timeout 90 $P --out "$OUT/ahead-olmoe" --spec olmoe-1b-7b --batches 1 --pools 3 --budget-s 60 2>&1 | grep -E "^lean|^HBM|^built|rror" || true ;;
  tests) timeout 400 python3 -m pytest -q -m gpu tests/test_lean_gpu.py tests/test_executor_gpu.py \
           tests/test_moe_kernel_gpu.py tests/test_host_calls_gpu.py tests/test_calibrate_gpu.py \
           -p no:cacheprovider -rf --durations=5 | tail -22 ;;
  b1) timeout 570 $B --out "$OUT/b1" --batches 1 --pools 16,20,26 --engines lean,hf \
        --policies ondemand,lru-prefetch,lfu-fallback,static,commit,oracle ;;
  b48) timeout 570 $B --out "$OUT/b48" --batches 8,4 --pools 20,16,26 --engines hf,lean \
         --policies ondemand,lru-prefetch,commit,oracle ;;
  cpu48) timeout 570 $B --out "$OUT/cpu48" --batches 4,8 --pools 20,16,26 --engines lean --repeats 0 \
           --policies lfu-fallback,static ;;
  host-wake) timeout 60 python3 -m pytest -q tests/test_step_kernels.py -k norm_folded -p no:cacheprovider 2>&1 | tail -2 || true
        timeout 90 python3 benchmarks/gemv_h200.py --out "$OUT/gemv.json" 2>&1 | grep -v Warning || true
        timeout 120 python3 benchmarks/host_wake_h200.py --out "$OUT/host-wake.json" 2>&1 | grep -v Warning || true ;;
  wait) timeout 260 python3 benchmarks/lean_h200.py --out "$OUT/wait" --tokens 32 --policy-tokens 32 --repeats 0 \
          --batches 2 --pools ${POOLS:-16,26} --engines lean --policies ${POLS:-ondemand,oracle} --wait-ablation \
          --timelines --budget-s ${BUDGET:-120} 2>&1 | grep -E "^lean|^HBM|^built|rror" ;;
  host-tests) timeout 200 python3 -m pytest -q -m gpu tests/test_host_calls_gpu.py tests/test_lean_gpu.py \
                tests/test_executor_gpu.py -p no:cacheprovider | tail -15 ;;
  ncu) N=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1); mkdir -p /tmp/ncu
       timeout 120 python3 benchmarks/kernel_ncu.py --time --reps 2 | tee /tmp/ncu/time.log
       timeout 400 "$N" --clock-control none --set full -k 'regex:_expert_mm|_stream' --launch-count 6 -f \
         -o /tmp/ncu/k python3 benchmarks/kernel_ncu.py --reps 2 > /tmp/ncu/run.log 2>&1 || tail -5 /tmp/ncu/run.log
       "$N" -i /tmp/ncu/k.ncu-rep --page details --csv > /tmp/ncu/details.csv 2>&1 || true
       "$N" -i /tmp/ncu/k.ncu-rep --page source --csv --print-source sass > /tmp/ncu/source.csv 2>&1 || true
       "$N" -i /tmp/ncu/k.ncu-rep --page raw --csv > /tmp/ncu/raw.csv 2>&1 || true
       (cd /tmp && tar czf "$OUT/ncu.tgz" ncu); ls -la /tmp/ncu ;;
  variants) timeout 300 python3 benchmarks/kernel_variants_h200.py --out "$OUT/variants" 2>&1 | grep -v Warning ;;
  kernel-ab) timeout 240 python3 benchmarks/kernel_variants_h200.py --out "$OUT/variants" --ms "${2:-1,2,4,8,16}" \
          ${3:+--variants $3} 2>&1 | grep -v Warning
        upper 170 110 --kernel-configs "${4:-$OUT/variants/kernel_variants.json}"
        timeout 250 python3 -m pytest -q -m gpu tests/test_moe_cuda_gpu.py tests/test_moe_kernel_gpu.py \
          tests/test_moe_kernel_fp16.py -p no:cacheprovider 2>&1 | tail -12 ;;
  few-tests) timeout 150 python3 -m pytest -q -m gpu tests/test_lean_gpu.py tests/test_calibrate_gpu.py -p no:cacheprovider \
         -k "few_expert or host_program_runs or (replay_equals_eager and mixtral) or calibrat" -rf 2>&1 | tail -8 || true ;;
  few) bash "$0" few-tests
       timeout 100 python3 benchmarks/wave_config_h200.py --out "$OUT/wave-config" 2>&1 | grep -v Warning || true
       timeout $((${AB_S:-150} + 30)) python3 benchmarks/lean_h200.py --out "$OUT/few-ab" --tokens ${AB_TOK:-64} --repeats 0 \
         --batches 8 --pools ${POOLS:-20,26} --engines lean --policies ${POLS:-ondemand,lru-prefetch,oracle} \
         --env-ablation CMOE_FEW_EXPERTS=off --budget-s ${AB_S:-150} 2>&1 \
         | grep -E "^lean|^HBM|^built|rror" || true ;;
  check) timeout 240 python3 benchmarks/expert_kernel_h200.py --out "$OUT/expert" --no-sweep 2>&1 | grep -v Warning | tail -30 || true
         upper 130 80
         left=$((570 - SECONDS)); echo "gpu_session: the GPU tests get ${left} s"
         [ "$left" -ge 30 ] && timeout "$left" python3 -m pytest -q -m gpu tests/test_moe_cuda_gpu.py tests/test_lean_gpu.py \
           tests/test_executor_gpu.py -p no:cacheprovider -rf 2>&1 | tail -12 || true ;;
  fuse-ab) timeout 100 python3 -m pytest -q tests/test_step_kernels.py tests/test_attention.py \
             -p no:cacheprovider 2>&1 | tail -4 || true
           timeout 200 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -p no:cacheprovider 2>&1 | tail -6 || true
           upper 200 140 --env-ablation "${ABL:-CMOE_ROUTE_MM=0,CMOE_LEAN_LAYER=0}"
           timeout 100 python3 benchmarks/lean_h200.py --out "$OUT/kp" --tokens 64 --batches 1 --pools 20 \
             --engines lean --policies "" --repeats 0 --kernel-profile --budget-s 80 2>&1 | grep -E "^ |^---" || true ;;
  attn) timeout 120 python3 -m pytest -q tests/test_attention.py tests/test_step_kernels.py -p no:cacheprovider 2>&1 | tail -2 || true
        timeout 140 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -p no:cacheprovider 2>&1 | tail -3 || true
        timeout 60 python3 benchmarks/attention_h200.py --out "$OUT/attention.json" 2>&1 | grep -v Warning || true
        upper 250 200 --env-ablation "${ABL:-CMOE_ATTN_SPLIT=0,CMOE_ATTN_SPLIT=keys,CMOE_QKV_NORM=1,CMOE_PDL=1}" ;;
  gemv) timeout 60 python3 benchmarks/gemv_h200.py --out "$OUT/gemv.json" 2>&1 | grep -v Warning || true
        timeout 30 python3 -m pytest -q tests/test_step_kernels.py -k gemv -p no:cacheprovider 2>&1 | tail -2 || true
        CMOE_GEMV=0 timeout 120 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -p no:cacheprovider 2>&1 | tail -3 || true
        upper 150 100 --env-ablation CMOE_GEMV=0 ;;
  ncu-variants) N=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1); mkdir -p /tmp/ncuv
       timeout 300 "$N" --clock-control none --set full -k 'regex:_expert_mm|_gate_up|moe_mma' -f -o /tmp/ncuv/v \
         python3 benchmarks/kernel_variants_h200.py --launch-only --ms 1 --variants "${2:-committed,split13-2}" \
         > /tmp/ncuv/run.log 2>&1 || tail -5 /tmp/ncuv/run.log
       "$N" -i /tmp/ncuv/v.ncu-rep --page raw --csv > /tmp/ncuv/raw.csv 2>&1 || true
       "$N" -i /tmp/ncuv/v.ncu-rep --page source --csv --print-source sass > /tmp/ncuv/source.csv 2>&1 || true
       (cd /tmp && tar czf "$OUT/ncuv.tgz" ncuv/raw.csv ncuv/source.csv ncuv/run.log); ls -la /tmp/ncuv ;;
  gptq) timeout 300 python3 benchmarks/gptq_h200.py run --src .gq --out "$OUT/gptq-h200.json" 2>&1 | tail -30 ;;
  step-ab) timeout 260 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -k "slot_stepped or queued or match_transformers or host_program" \
             -p no:cacheprovider 2>&1 | tail -6 || true
           timeout 300 python3 benchmarks/lean_h200.py --out "$OUT/step" --tokens 32 --policy-tokens 32 --repeats 1 \
             --batches 1,8 --pools 26 --engines lean --policies lru-prefetch,oracle --env-ablation CMOE_DEVICE_STEP=1 \
             --timelines --budget-s 240 2>&1 | grep -E "^lean|^HBM|^built|rror" || true
           (cd "$OUT" && tar czf step.tgz step && rm -rf step) ;;     # one file: the device tool returns eight a call
  boundary) timeout 300 python3 benchmarks/lean_h200.py --out "$OUT/boundary" --tokens 32 --policy-tokens 32 --repeats 1 \
              --batches 1,8 --pools 16,26 --engines lean --policies ondemand,lru-prefetch,oracle,commit --pass-profile \
              --timelines --budget-s 260 2>&1 | grep -E "^lean|host phases|rror" || true
            (cd "$OUT" && tar czf boundary.tgz boundary && rm -rf boundary) ;;
  calib) rm -rf /tmp/v; mkdir -p /tmp/v; timeout 300 python3 -c "from cmoe.cli.app import app; app()" calibrate --device cuda \
          --layers 4 --out /tmp/v/profile.json 2>&1 | grep -v Warning | tail -40 || true
        cp /tmp/v/profile*.json "$OUT/" 2>/dev/null; terms ;;
  validate) if [ -z "${PROFILE:-}" ] && [ "${CAL:-both}" != cut ] && [ "${VT:-560}" -lt 260 ]; then   # fifty-first session
              echo "gpu_session: VT=$VT bounds the whole validation, and the built model's build and calibration take" \
                   "185-220 s before any run: give VT 260 or more, or PROFILE=FILE.json" >&2; exit 2; fi
            rm -rf /tmp/v; timeout ${VT:-560} python3 benchmarks/validate_h200.py --out /tmp/v --pools "${POOLS:-16,20,26}" --batches "${BATCHES:-1,2,4,8}" \
              --tokens 32 --policies "${POLS:-upper,ondemand,lru-prefetch,commit,oracle}" --measure-only $([ -n "${REPEAT:-}" ] && echo --repeat) --spec "${SPEC:-mixtral-8x7b}" \
              $([ -n "${PROFILE:-}" ] && echo --profile "$PROFILE" || echo --calibrate-on "${CAL:-both}") --commit "${COMMIT:-unknown}" 2>&1 | tee "$OUT/validate.log" | grep -v "^  " || true
            (cd /tmp/v && tar czf "$OUT/head.tgz" results.json profile*.json $(ls host-load.json 2>/dev/null) \
              && for b in $(echo "${BATCHES:-1,2,4,8}" | tr , " "); do ls -d pool*-b$b >/dev/null 2>&1 && tar czf "$OUT/meas-b$b.tgz" pool*-b$b; done; true); terms ;;
  cpu-program) timeout 150 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -p no:cacheprovider \
                 -k "host_program_runs_as_the_python_step or (replay_equals_eager and mixtral)" > "$OUT/tests.log" 2>&1 || true
               tail -15 "$OUT/tests.log"
               KCACHE=0 VT=${VT:-420} POLS=upper,lfu-fallback,static BATCHES=${BATCHES:-1,8} CAL=built bash "$0" validate ;;
  cpu-threads) for v in "OMP_PROC_BIND=close OMP_PLACES=cores" "OMP_WAIT_POLICY=PASSIVE"; do
                 n=$(echo "$v" | cut -d' ' -f1 | tr '=' '-')
                 env $v timeout 90 python3 benchmarks/cpu_threads_h200.py --out "$OUT/cpu_threads-$n.json" --isolated-only \
                   --threads "${THREADS:-16,15,14,8}" > "$OUT/cpu_threads-$n.log" 2>&1 || true
                 echo "== $v"; grep -E "^isolated|rror" "$OUT/cpu_threads-$n.log" | tail -40 || true
               done
               timeout 420 python3 benchmarks/cpu_threads_h200.py --out "$OUT/cpu_threads.json" --threads "${THREADS:-16,15,14,8}" \
                 > "$OUT/cpu_threads.log" 2>&1 || true
               echo "== default"; grep -E "^(isolated|executor|built)|rror" "$OUT/cpu_threads.log" | tail -60 || true ;;
  cpu-wait) for n in active default; do                          # each process: its own store (~130 s)
              e=""; [ "$n" = active ] && e="OMP_WAIT_POLICY=ACTIVE"
              env -u OMP_WAIT_POLICY $e timeout 280 python3 benchmarks/cpu_threads_h200.py --out "$OUT/cpu_wait-$n.json" --threads 16 \
                --iso-rounds 2 --rounds 2 --batch 1 --pools 26,26 --tokens 32 > "$OUT/cpu_wait-$n.log" 2>&1 || true
              echo "== $n"; grep -E "^(isolated|executor|built)|rror" "$OUT/cpu_wait-$n.log" | tail -16 || true
            done ;;
  cpu-nt) for n in ${THREADS:-16 14}; do                     # each process: its own store (~130 s)
            env OMP_WAIT_POLICY=ACTIVE OMP_NUM_THREADS=$n timeout 270 python3 benchmarks/cpu_threads_h200.py \
              --out "$OUT/cpu_nt-$n.json" --threads $n --iso-rounds 2 --rounds 3 --tokens 32 > "$OUT/cpu_nt-$n.log" 2>&1 || true
            echo "== $n threads"; grep -E "^(isolated|executor|built)|rror" "$OUT/cpu_nt-$n.log" | tail -16 || true
          done ;;
  cpu-nt-iso) for c in $(seq ${CYCLES:-2}); do for n in ${THREADS:-16 14 15 12}; do   # processes alternating, no store
                env OMP_WAIT_POLICY=ACTIVE OMP_NUM_THREADS=$n ${XENV:-} timeout 60 python3 benchmarks/cpu_threads_h200.py \
                  --out "$OUT/cpu_nt_iso-$c-$n.json" --isolated-only --threads $n --iso-rounds 2 > "$OUT/cpu_nt_iso-$c-$n.log" 2>&1 || true
                echo "== cycle $c, $n threads"; grep -E "^isolated|rror" "$OUT/cpu_nt_iso-$c-$n.log" | tail -8 || true
              done; done ;;
  cpu-bind-ab) for c in $(seq ${CYCLES:-2}); do for x in unbound bound; do   # processes alternating, no store
                 e=""; [ "$x" = bound ] && e="OMP_PROC_BIND=close OMP_PLACES=cores"
                 env -u OMP_PROC_BIND -u OMP_PLACES OMP_WAIT_POLICY=ACTIVE $e timeout 45 python3 benchmarks/cpu_threads_h200.py \
                   --out "$OUT/bind_ab-$c-$x.json" --isolated-only --threads 16 --iso-rounds 1 > "$OUT/bind_ab-$c-$x.log" 2>&1 || true
                 echo "== cycle $c, $x"; grep -E "^isolated|rror" "$OUT/bind_ab-$c-$x.log" | sed 's/; python.*//' || true
               done; done ;;
  cpu-pages) for c in 1 2; do                                # in-process A/B; a process of its own each
               OMP_WAIT_POLICY=ACTIVE timeout 60 python3 benchmarks/cpu_pages_h200.py --out "$OUT/pages-iso-$c.json" \
                 > "$OUT/pages-iso-$c.log" 2>&1 || true
               echo "== process $c"; grep -E "^isolated|rror" "$OUT/pages-iso-$c.log" | sed 's/; python.*//' || true
             done
             OMP_WAIT_POLICY=ACTIVE timeout ${PT:-420} python3 benchmarks/cpu_pages_h200.py --out "$OUT/pages-exec.json" --iso-rounds 2 \
               --executor --rounds ${ROUNDS:-2} > "$OUT/pages-exec.log" 2>&1 || true
             echo "== executor"; grep -E "^(isolated|executor|built)|rror" "$OUT/pages-exec.log" | tail -30 || true ;;
  cpu-experts) timeout 60 python3 -m pytest -q -m gpu tests/test_lean_gpu.py -p no:cacheprovider \
                 -k "(match_transformers and (mixtral or qwen2_moe)) or (replay_equals_eager and mixtral)" 2>&1 | tail -4 || true
               VT=${VT:-440} POLS=upper,lfu-fallback,static BATCHES=${BATCHES:-1,8} CAL=built bash "$0" validate ;;
  sampler-ab) timeout ${ABT:-240} python3 benchmarks/sampler_ab_h200.py --out "$OUT/sampler-ab.json" --pool "${POOL:-26}" \
                --batch "${BATCH:-4}" --rounds "${ROUNDS:-3}" 2>&1 | tee "$OUT/sampler-ab.log" | grep -E "^(round|built)|rror" || true ;;
  spin-ab) for c in $(seq ${CYCLES:-2}); do ws=${WAITS:-ACTIVE PASSIVE}   # even cycles in reverse order, so the
             [ $((c % 2)) = 0 ] && ws=$(echo $ws | awk '{for (i = NF; i > 0; i--) printf "%s ", $i}')  # first process's
             for w in $ws; do                                               # effect is not one arm's
             [ "$SECONDS" -lt "${SPT:-380}" ] || { echo "spin-ab: past ${SPT:-380} s, cycle $c $w not started"; continue; }
             e="OMP_WAIT_POLICY=$w"; [ "$w" = default ] && e=""
             env -u OMP_WAIT_POLICY $e timeout $(( ${SPT:-380} + 40 - SECONDS )) python3 benchmarks/sampler_ab_h200.py \
               --out "$OUT/spin-$c-$w.json" --pool "${POOL:-26}" --batch "${BATCH:-4}" --rounds "${ROUNDS:-2}" \
               --modes "${MODES:-none,thread,process}" --policies "${POLS:-lru-prefetch,ondemand}" --wake-cpu \
               > "$OUT/spin-$c-$w.log" 2>&1 || true
             echo "== cycle $c $w"; grep -E "^(round|built)|rror" "$OUT/spin-$c-$w.log" | cut -c1-170 || true
           done; done ;;
  ab-validate) bash "$0" sampler-ab; VT=${VT:-330} BATCHES=${BATCHES:-1,4} bash "$0" validate ;;
  validate-r) KCACHE=0 REPEAT=1 BATCHES="${2:?batches}" bash "$0" validate ;;
  pin-ab) timeout 400 python3 benchmarks/affinity_probe.py --out "$OUT/affinity.json" --policies "${POLS:-lru-prefetch,ondemand}" \
            --pool "${POOL:-26}" --rounds "${ROUNDS:-4}" --arms "${ARMS:-free,pinned}" 2>&1 \
            | grep -E "^round|^[a-z-]+ +(free|pinned)|^r\(|rror" || true ;;
  host-ab) [ -f .before/benchmarks/lean_h200.py ] || { echo "host-ab: no .before/ tree (carry it with the call)" >&2; exit 2; }
           mkdir -p "$OUT/host-ab"
           for i in 1 2; do for t in before after; do
             d=$PWD; [ "$t" = before ] && d=$PWD/.before
             (cd "$d" && PYTHONPATH=$d:/tmp/site timeout 100 python3 benchmarks/lean_h200.py --out "$OUT/host-ab/$t$i" \
                --tokens 64 --policy-tokens 64 --repeats 1 --batches 1 --pools 20 --engines lean \
                --policies upper,ondemand,lru-prefetch,commit,oracle,adaptive --host-profile 2>&1 \
                | grep -E "^lean|host phases|Error|error" > "$OUT/host-ab/$t$i.log") || true
           done; done
           grep -h "^lean" "$OUT"/host-ab/*.log | cut -c1-150 || true ;;
  *) echo "usage: $0 program|live|ahead|tests|b1|b48|cpu48|host-wake|wait|host-tests|ncu|variants|kernel-ab|check|fuse-ab|attn|gemv|ncu-variants|gptq|step-ab|boundary|calib|validate|cpu-program|cpu-threads|cpu-wait|cpu-nt|cpu-nt-iso|cpu-bind-ab|cpu-pages|spin-ab|sampler-ab|ab-validate|cpu-experts|validate-r BATCHES|host-ab|pin-ab" >&2; exit 2 ;;
esac
