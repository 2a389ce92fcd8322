"""A deep model's tracked step from three shallow ones, when the three show it is exact.

Every decoder block of a Llama has the same shapes, so a step's memory and traffic grow by the same amount with
each block: its sharded parameters, gradients and optimizer states, the activations it saves, the all-gathers and
reduce-scatters of its FSDP unit; what is not in a block (the embedding, the output layer and the loss, the
transient buffers of the one block being computed) does not grow. The estimate measures the job's model with
``SHALLOW``, ``SHALLOW`` + 1 and ``SHALLOW`` + 2 blocks. Where every count of the three grows by the same whole
number per block (each phase's peak - forward, backward, the optimizer step... - and each kind of memory at it, the
state as the optimizer step starts, each collective's calls and bytes, the parameter counts, the FP8 operand
copies), and each phase peaks at the same module (the same name, or the same block counted from the last), the
job's model is those counts extended to its blocks, its peak the highest of its phases' (a phase that grows faster
per block can pass the others in a deeper model): equal to the byte to measuring every block
(tests/estimate/test_layers.py), in a fraction of the time (a 70B's 80 blocks: 12 measured). Otherwise (a
layer-indexed option such as ``--fp8_exclude``, a peak that moves between blocks) every block is measured.
"""

from __future__ import annotations

import dataclasses
import re
import time

from llama_fp8.estimate import fake, run

SHALLOW = 3  # the shallowest model measured: a first, a middle and a last block (2 blocks grow otherwise)
WORTH = 2 * (3 * SHALLOW + 3)  # a model of fewer blocks is measured whole: the three shallow ones cost about as much
_BLOCK = re.compile(r"(layers\.)(\d+)(?=\.|$)")  # a decoder block's index in a module's name


def measure(cfg, env, progress: run.Progress = lambda _: None) -> run.Measurement:
    """The tracked step of ``cfg`` (run.measure's, fake, as rank ``env.rank`` of ``env.world_size``), from three
    shallow models where that is exact."""
    blocks = cfg.num_layers
    if blocks is None or blocks <= WORTH or cfg.fp8_exclude:
        return _measured(cfg, env, progress)
    t0 = time.perf_counter()
    shallow = []
    for n in range(SHALLOW, SHALLOW + 3):
        progress(f"the model with {n} of its {blocks} decoder blocks (the step grows by the same amount per block)")
        shallow.append(_measured(dataclasses.replace(cfg, num_layers=n), env, progress))
    m = extend(shallow, SHALLOW, blocks)
    if m is None:
        progress(f"the shallow models do not grow by the same amount per block: measuring all {blocks}")
        return _measured(cfg, env, progress)
    decision = dataclasses.replace(m.decision, cfg=dataclasses.replace(m.decision.cfg, num_layers=blocks))
    return dataclasses.replace(m, decision=decision, seconds=time.perf_counter() - t0)


def _measured(cfg, env, progress: run.Progress) -> run.Measurement:
    """One fake measurement in a fake world of its own (the mesh's process groups, and so the collectives' names,
    are each measurement's)."""
    with fake.process_group(env.world_size, env.rank):
        return run.measure(cfg, env, fake_run=True, progress=progress)


def _line(values: list[int], first: int, blocks: int) -> int | None:
    """The count at ``blocks`` blocks from its values at ``first``, ``first`` + 1, ``first`` + 2; None unless
    they grow by the same amount."""
    a, b, c = values
    if b - a != c - b:
        return None
    return a + (blocks - first) * (b - a)


def _counts(m: run.Measurement) -> dict:
    """Every count of a measurement but its peaks, by a key that names it."""
    out = {("params",): m.num_params, ("local",): m.local_param_numel, ("fp8",): m.fp8_operand_bytes}
    out.update({("opt", k): v for k, v in (m.at_optimizer or {}).items()})
    for c in m.collectives:
        out[("calls", c["kind"], c["dim"], c["phase"])] = c["calls"]
        out[("bytes", c["kind"], c["dim"], c["phase"])] = c["bytes"]
    for total, kinds, where in m.phase_peaks or ():
        phase = (where.phase, where.micro_batch)
        out[("peak", *phase)] = total
        out.update({("peak", *phase, k): v for k, v in kinds.items()})
    return out


def _module(names: list[str], first: int, blocks: int) -> str | None:
    """A peak's module in the model of ``blocks`` blocks, from the three shallow ones': the same name, or the same
    block counted from the last."""
    if len(set(names)) == 1:
        return names[0]
    found = [_BLOCK.search(n) for n in names]
    if not all(found) or len({_BLOCK.sub(r"\1#", n, count=1) for n in names}) != 1:
        return None
    from_last = {first + i - int(f.group(2)) for i, f in enumerate(found)}
    if len(from_last) != 1:
        return None  # (a block counted from the first has the same name in all three: above)
    return _BLOCK.sub(lambda f: f"{f.group(1)}{blocks - from_last.pop()}", names[0], count=1)


def extend(shallow: list[run.Measurement], first: int, blocks: int) -> run.Measurement | None:
    """The measurement of ``blocks`` blocks from those of ``first``, ``first`` + 1 and ``first`` + 2 blocks, or None
    where a count does not grow by the same amount per block or a phase's peak moves. Each phase's peak (forward,
    backward, the optimizer step...) is extended on its own and the step's is the highest at ``blocks``: a phase
    whose peak grows faster per block can pass the shallow models' highest in a deeper model."""
    counts = [_counts(m) for m in shallow]
    if len({frozenset(c) for c in counts}) != 1 or not shallow[0].phase_peaks:
        return None
    out = {}
    for key in counts[0]:
        value = _line([c[key] for c in counts], first, blocks)
        if value is None or value < 0:
            return None
        out[key] = value
    by_phase = [{(w.phase, w.micro_batch): w.module for _, _, w in m.phase_peaks} for m in shallow]
    peaks = []
    for _, kinds, where in shallow[0].phase_peaks:
        phase = (where.phase, where.micro_batch)
        module = _module([b[phase] for b in by_phase], first, blocks)
        if module is None:
            return None
        peaks.append((out[("peak", *phase)], {k: out[("peak", *phase, k)] for k in kinds},
                      dataclasses.replace(where, module=module)))
    total, by_kind, where = max(peaks, key=lambda p: p[0])  # of equal ones, the phase that came first in the step
    base = shallow[0]
    return dataclasses.replace(
        base, peak_bytes=total, by_kind=by_kind, where=where, phase_peaks=peaks, num_params=out[("params",)],
        local_param_numel=out[("local",)], fp8_operand_bytes=out[("fp8",)],
        at_optimizer=None if base.at_optimizer is None else {k: out[("opt", k)] for k in base.at_optimizer},
        collectives=[{**c, "calls": out[("calls", c["kind"], c["dim"], c["phase"])],
                      "bytes": out[("bytes", c["kind"], c["dim"], c["phase"])]} for c in base.collectives])
