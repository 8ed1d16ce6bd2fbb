"""The modules of ``benchmarks/gpu/bench_wgrad_gpu.py`` (the script is the entry point; run it):

build      the CUDA toolkit as paddle_mgrad/ops/build_config.py finds it; nvcc/g++ builds of the
           test/benchmark library (both C ABIs; the CPU one cached per key for the tests);
           --compile-only; the Paddle binding's syntax check
capi       ctypes over csrc/wgrad_capi.cc (the cores) and csrc/wgrad_capi_testing.cc (the
           decisions, the fakes)
shapes     the shapes each row runs, the speed targets, the float64 error bounds
checks     the correctness rows (Bench): values, offsets, bias, streams, graph, capability,
           checks, bias-order, pressure
timing     the speed rows: CUDA-event medians; ours vs the bare GEMM, bias paths per shape
sanitizer  compute-sanitizer memcheck on small cases (a child process of the script)
report     the one table and its verdicts
"""
