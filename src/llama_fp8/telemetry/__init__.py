"""What measures a run: tokens/s, TFLOPS and MFU (``metrics``, against ``peaks``), where the wall time went
(``goodput``), slow ranks and throttled GPUs (``stragglers``, ``gpu_health``), profiler traces (``profiling``) and
the run's provenance (``repro``)."""
