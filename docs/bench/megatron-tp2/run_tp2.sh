#!/usr/bin/env bash
# Megatron-DeepSpeed's real pretrain_gpt.py, tensor parallel 2 x data parallel 2 on 4 CPU ranks
# (gloo), stock ZeRO-1 vs ACCO (ds_acco, installed editable in /work/main/.venv).
#
#   bash run_tp2.sh setup     # export Megatron-DeepSpeed f4157bea, apply megatron.patch, pip deps
#   bash run_tp2.sh data      # local corpus + byte-level GPT-2 tokenizer files + .bin/.idx
#   bash run_tp2.sh smoke     # 3 iterations, stock then ACCO
#   bash run_tp2.sh compare   # 40 iterations, stock and ACCO (logs/stock40.log, logs/acco40.log)
#   bash run_tp2.sh resume    # ACCO (and stock): exit+save at 20, reload, continue to 40
#   bash run_tp2.sh probe     # optional side run: print engine.get_global_grad_norm() per step
#   bash run_tp2.sh control   # same runs with TP=1 on 2 ranks (DP 2), stock and ACCO
#   bash run_tp2.sh seeds     # seeds 1235, 1236: TP=2 and TP=1, stock and ACCO (gap spread)
#   bash run_tp2.sh memory    # peak RSS per rank, GPT 6 x 768, 3 iterations, stock/ACCO x 3 repeats rotated
#   bash run_tp2.sh report    # parse the logs -> results.json + tables on stdout
#   bash run_tp2.sh all       # everything above in order
# Single runs: bash run_tp2.sh run NAME {stock|acco} [extra Megatron args...]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MEG=$HERE/Megatron-DeepSpeed
MIRROR=/work/.mirror/microsoft+Megatron-DeepSpeed/repo
DATA=$HERE/data
LOGS=$HERE/logs
CKPT=$HERE/checkpoints
mkdir -p "$LOGS" "$CKPT"

. /work/main/.venv/bin/activate
export DS_ACCELERATOR=cpu
export OMP_NUM_THREADS=1          # 4 ranks on 2 cores
export PYTHONHASHSEED=0
unset CUDA_DEVICE_MAX_CONNECTIONS

setup() {
    if [ ! -f "$MEG/pretrain_gpt.py" ]; then
        mkdir -p "$MEG"
        git --git-dir="$MIRROR" archive f4157bea69f3df8c6cb66f2ebcda66ba03d1288e | tar -x -C "$MEG"
        (cd "$MEG" && patch -p1 < "$HERE/megatron.patch")
    fi
    python -c "import pybind11, six, nltk" 2>/dev/null || pip install pybind11 six nltk
}

data() {
    python "$HERE/build_corpus.py" "$DATA" 4000000
    (cd "$MEG" && python tools/preprocess_data.py --input "$DATA/corpus.jsonl" \
        --output-prefix "$DATA/stdlib" --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$DATA/vocab.json" --merge-file "$DATA/merges.txt" \
        --append-eod --workers 1 --dataset-impl mmap)
    ls -la "$DATA"
}

# Common Megatron arguments (identical for stock and ACCO).
ITERS=${ITERS:-40}
model_args() {
    echo --tensor-model-parallel-size "${TP:-2}" --pipeline-model-parallel-size 1 --no-pipeline-parallel \
         --num-layers "${LAYERS:-2}" --hidden-size "${HIDDEN:-128}" --num-attention-heads "${HEADS:-4}" \
         --seq-length 128 --max-position-embeddings 128 \
         --micro-batch-size 4 --global-batch-size 32 \
         --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 4 \
         --lr-decay-style cosine --lr-decay-iters 40 --weight-decay 0.01 --clip-grad 1.0 \
         --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234 \
         --attention-dropout 0 --hidden-dropout 0 \
         --data-path "$DATA/stdlib_text_document" --data-impl mmap --split 98,1,1 \
         --tokenizer-type GPT2BPETokenizer --vocab-file "$DATA/vocab.json" --merge-file "$DATA/merges.txt" \
         --num-workers 0 --log-interval 1 --eval-interval 20 --eval-iters 5 \
         --distributed-backend gloo --use-cpu-initialization \
         --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion \
         --no-gradient-accumulation-fusion \
         --deepspeed --zero-stage 1
}

PORT=${PORT:-29611}
# run NAME {stock|acco} [extra args]: one launch, all ranks' output in logs/NAME.log
run() {
    local name=$1 kind=$2; shift 2
    local cfg=$HERE/configs/$kind.json
    local script=(pretrain_gpt.py)
    [ "${PROBE:-0}" = 1 ] && script=("$HERE/gn_probe.py" pretrain_gpt.py)   # optional grad-norm side probe
    [ "${MEMPROBE:-0}" = 1 ] && script=("$HERE/mem_probe.py" pretrain_gpt.py)  # peak RSS per rank
    export MEM_PROBE_OUT=$HERE/mem/$name
    local cmd=(deepspeed --num_gpus "${NGPU:-4}" --master_port "$PORT" --module ds_acco run "${script[@]}"
               $(model_args) --deepspeed_config "$cfg" "$@")
    echo "[$(date -u +%T)] $name: cd $MEG && ${cmd[*]}" | tee "$LOGS/$name.cmd"
    local t0=$(date +%s.%N)
    (cd "$MEG" && timeout --kill-after=30 600 "${cmd[@]}") > "$LOGS/$name.log" 2>&1 || echo "rc=$? (see $LOGS/$name.log)" | tee -a "$LOGS/$name.cmd"
    local t1=$(date +%s.%N)
    # DeepSpeed's CPU shm comm op leaves a ~66 MB file per rank and port in /dev/shm: drop ours
    rm -f /dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_"$PORT"_*
    echo "wall_s=$(python -c "print(round($t1-$t0,1))")" | tee -a "$LOGS/$name.cmd"
}

smoke() {
    ITERS=3 run smoke_stock stock --eval-interval 2 --eval-iters 1
    ITERS=3 run smoke_acco acco --eval-interval 2 --eval-iters 1
}

compare() {
    run stock40 stock
    run acco40 acco
}

resume() {
    for k in acco stock; do
        rm -rf "$CKPT/$k"
        run ${k}_part1 $k --save "$CKPT/$k" --save-interval 20 --exit-interval 20
        run ${k}_part2 $k --load "$CKPT/$k"
    done
}

probe() {  # optional: DeepSpeed's get_global_grad_norm() after each step (Megatron prints none)
    PROBE=1 run probe_stock stock
    PROBE=1 run probe_acco acco
}

control() {  # TP=1 on 2 ranks (DP 2), same data; with --make-vocab-size-divisible-by 256 the padded
             # vocabulary is 512 as under TP=2 (128 x 2), so the CPU initialisation matches TP=2's
    TP=1 NGPU=2 run tp1_stock40 stock
    TP=1 NGPU=2 run tp1_acco40 acco
    TP=1 NGPU=2 run tp1v_stock40 stock --make-vocab-size-divisible-by 256
    TP=1 NGPU=2 run tp1v_acco40 acco --make-vocab-size-divisible-by 256
}

seeds() {  # seed spread of the ACCO-vs-stock gap: TP=2 and TP=1 (vocab padded as TP=2), seeds 1235, 1236
    for seed in 1235 1236; do
        run s${seed}_stock40 stock --seed $seed
        run s${seed}_acco40 acco --seed $seed
        TP=1 NGPU=2 run s${seed}_tp1v_stock40 stock --seed $seed --make-vocab-size-divisible-by 256
        TP=1 NGPU=2 run s${seed}_tp1v_acco40 acco --seed $seed --make-vocab-size-divisible-by 256
    done
}

memory() {  # peak RSS per rank (mem_probe.py), a model large enough that the states dominate: GPT 6 x 768
            # (N = 21.6M parameters per tensor-parallel rank), 3 iterations, eval once; each variant in its
            # own launch, 3 repeats with the order rotated; then mem_table.py (measured vs README formula)
    local order
    for r in 0 1 2; do
        if [ $r = 1 ]; then order="acco stock"; else order="stock acco"; fi
        for k in $order; do
            rm -rf "$HERE/mem/mem_${k}_r$r"
            MEMPROBE=1 ITERS=3 LAYERS=6 HIDDEN=768 HEADS=12 run mem_${k}_r$r $k --eval-interval 1000 --eval-iters 1
        done
    done
    python "$HERE/mem_table.py" "$HERE/mem" | tee "$HERE/mem/memory.md"
}

report() {
    cd "$HERE"
    python parse_logs.py "$LOGS" results.json   # TP=2 seed 1234 table, validation, resume
    python probe_table.py                       # grad norms from the probe runs
    python control_table.py                     # TP=1 (vocab 384) vs TP=2
    python seed_table.py                        # gap per seed and TP size; s/iteration per run
}

case "${1:-all}" in
    setup) setup ;;
    data) data ;;
    smoke) smoke ;;
    compare) compare ;;
    resume) resume ;;
    report) report ;;
    memory) memory ;;
    probe) probe ;;
    control) control ;;
    seeds) seeds ;;
    run) shift; run "$@" ;;
    all) setup; data; smoke; compare; resume; control; probe; seeds; report ;;
    *) echo "unknown step $1"; exit 2 ;;
esac
