"""`benchmarks/transfer.py` in parts: model shapes (`shapes`), the daemon and bare-ZMQ
processes (`procs`), request streams (`workload`), the in-process baselines (`baselines`), one
measured point (`point`), the table and the targets (`report`) and the command line (`main`)."""
