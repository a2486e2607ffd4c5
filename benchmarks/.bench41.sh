python3 benchmarks/launch_cost.py --calls 1000 2>&1 | grep -E "two groups|flushed|sleep|reference|Error|error|Traceback" 
