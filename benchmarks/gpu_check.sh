#!/usr/bin/env bash
# The GPU check a reviewer runs on a machine with GPUs: lo-fi, DDP (nccl) and SPSA with LoRA on
# SmolLM2-135M in bf16 weights (model.dtype), 2 actors each on a GPU, nodes loading the weights
# themselves. Prints per strategy: accuracy, bytes by phase, whether the replicas' hashes agree
# (SPSA: every verified step and the final hashes), each actor's device and peak GPU memory.
#
#     bash benchmarks/gpu_check.sh [OUT]          # default OUT: runs/gpu_check
#
# Two GPUs or more: nodes.gpus 1 and DDP over nccl. One GPU: both actors share it (nodes.gpus
# 0.5) and DDP falls back to gloo, since nccl refuses two ranks on one device; it says so.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -eq 0 ]; then echo "no GPU visible to torch: nothing to check" >&2; exit 1; fi
PER_NODE=1 BACKEND=nccl
if [ "$GPUS" -lt 2 ]; then
  PER_NODE=0.5 BACKEND=gloo
  echo "only $GPUS GPU: both actors share it (nodes.gpus 0.5); DDP uses gloo (nccl needs a GPU per rank)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
raylowcomm run examples/lora_smollm2.yaml --out "$OUT" \
  --set model.dtype=bf16 --set model.source=auto --set "nodes.gpus=$PER_NODE" --set "ddp.backend=$BACKEND" \
  --set optim.precision=bf16 --set spsa.verify_every=1
python - "$OUT/results.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    name = r["strategy"]
    if "error" in r:
        print(f"{name}: FAILED {r['error']}")
        continue
    c, m = r["comm"], r["metrics"]
    print(f"\n{name}: id_accuracy {m.get('id_accuracy')}, shift_accuracy {m.get('shift_accuracy')}, "
          f"wall {r['wall_s']:.1f} s, train {r['train_s']:.1f} s")
    print(f"  bytes by phase {c['by_phase']}")
    print(f"  setup by kind {({k: v for k, v in c['by_kind'].items() if k.startswith('setup/')})}")
    for n in r["nodes"]:
        gpu = n.get("peak_gpu_bytes")
        print(f"  node {n.get('node', n.get('rank'))}: host {n.get('host')}, peak GPU "
              f"{'-' if gpu is None else f'{gpu / 2**20:,.0f} MiB'}, peak RSS {n['peak_rss_bytes'] / 2**20:,.0f} MiB")
    if name == "spsa":
        d = r["details"]
        agree = all(len(v["nodes"]) == 2 for v in d["verified"])
        finals = {n["final_hash"] for n in r["nodes"] if n.get("final_hash")}
        print(f"  replicas identical at all {len(d['verified'])} checks: {agree}; final hashes equal: {len(finals) == 1}")
PY
