python3 benchmarks/transfer.py --l1-bytes 16g --chunk-sizes 64,256 --iters 3 --lone-iters 20 --per-message 4 --out $OUT/transfer_pm4.json 2>&1 | grep -v " INFO " | tail -60
