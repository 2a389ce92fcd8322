"""Transformer Engine's FP8 machinery beside the TE model: ``recipes`` (TE's recipe objects and their checks),
``precision`` (TE's FP8 as a precision backend), ``coverage`` (exclusions and the FP8 layer count), ``stats``
(per-layer FP8 numerics through TE's debug API), ``state`` (FP8 scaling state in checkpoints), ``params`` (FP8
weights) and ``master_weights`` (their FP32 masters)."""
