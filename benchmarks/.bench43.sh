F='grep -v " INFO \|Initializing\|vllm._C\|CudaIPCTypes"'
python3 benchmarks/vllm_connector.py --shapes 'gpt-oss-20b,Llama-3.1-70B TP4 shard' --chunk 64 --prompt-chunks 1 --requests 192 --timeline --out $OUT/one_chunk.json 2>&1 | eval $F | cut -c1-1500
