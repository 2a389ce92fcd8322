"""The tracked step: PyTorch's FSDPMemTracker, plus where its peak happened and the collectives the step issued.

``FSDPMemTracker`` (torch.distributed._tools.fsdp2_mem_tracker) is a dispatch mode that records every tensor
storage an op creates, by kind (sharded and unsharded parameters, gradients, activations, temporaries, FSDP2's
all-gather and reduce-scatter buffers, optimizer states), and keeps the snapshot of the highest total. This
subclass adds two things the estimate reports:

- where the peak was: forward, the loss, backward (or its activation recomputation), after backward (gradient
  norm and clipping) or the optimizer step; the innermost module running; the micro-batch;
- each collective of the step (FSDP2's all-gathers and reduce-scatters, HSDP's all-reduce, tensor parallelism's
  functional collectives), by kind, mesh dimension and phase, with its bytes: the all-gather's output and the
  reduce-scatter's input, i.e. the whole (unsharded) buffer, as torch's own fake_collectives sizes them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torch._guards import active_fake_mode
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from llama_fp8.models.common import canonical_name

TOTAL = "Total"  # MemTracker's key of a snapshot's total (its other keys are the kinds of memory)

# torch's collective ops (c10d's in-place ones, the functional ones) by what they do
KINDS = (("all_gather", ("allgather", "all_gather")), ("reduce_scatter", ("reduce_scatter",)),
         ("all_reduce", ("allreduce", "all_reduce")), ("all_to_all", ("alltoall", "all_to_all")),
         ("broadcast", ("broadcast",)), ("p2p", ("send", "recv", "p2p")))


def collective_kind(func) -> str:
    name = func.__name__.lower()
    return next((kind for kind, words in KINDS if any(w in name for w in words)), name)


@dataclass
class Where:
    phase: str
    module: str
    micro_batch: int

    def text(self, micro_batches: int) -> str:
        mb = f", micro-batch {self.micro_batch} of {micro_batches}" if micro_batches > 1 else ""
        if self.module != "-":
            where = f"in {self.module}"
        else:  # forward or backward outside the model's modules: the loss (the upcast logits, the cross entropy)
            where = "outside the model's modules" + (" (the loss)" if self.phase in ("forward", "backward") else "")
        return f"{self.phase}, {where}{mb}"


@dataclass
class Collectives:
    """(kind, mesh dimension, phase) -> [calls, bytes]."""

    by_key: dict[tuple[str, str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def add(self, kind: str, dim: str, phase: str, nbytes: int) -> None:
        entry = self.by_key[(kind, dim, phase)]
        entry[0] += 1
        entry[1] += nbytes


class StepTracker(FSDPMemTracker):
    """FSDPMemTracker that also records where the peak is reached and counts the collectives (``groups``: process
    group name -> mesh dimension name)."""

    def __init__(self, model, optimizer, groups: dict[str, str]):
        super().__init__(model, optimizer)
        self.groups = groups
        self.collectives = Collectives()
        self.peak_where: Where | None = None
        self.at_optimizer: dict | None = None  # the snapshot (by kind) as the optimizer step starts
        self.micro_batch = 0  # set by the batch source as each micro-batch is fetched
        self._backward_seen = 0  # the micro-batch whose backward has run (0: none yet)
        # (phase, micro-batch) -> (its highest total, the snapshot by kind then, where): the step's peak is the
        # highest of them; a deeper model's is the highest of theirs extended (estimate/layers.py)
        self.phase_peaks: dict[tuple[str, int], tuple[int, dict, Where]] = {}

    def next_micro_batch(self) -> None:
        """Called as each micro-batch is fetched (inside the step)."""
        self.micro_batch += 1
        if self.micro_batch > 1:  # the tracker refuses a second forward of the root otherwise; its per-module
            self.reset_mod_stats()  # snapshots go, the step's peak and totals stay

    def summary(self) -> dict:
        """The step as measured: the peak (bytes, by kind, where), the collectives, the state as the optimizer
        step starts."""
        (peak,) = self.get_tracker_snapshot("peak").values()
        return {"peak_bytes": peak[TOTAL], "by_kind": by_name(peak), "where": self.peak_where,
                "phase_peaks": [(total, by_name(snap), where) for total, snap, where in self.phase_peaks.values()],
                "collectives": [{"kind": k, "dim": d, "phase": p, "calls": c, "bytes": b}
                                for (k, d, p), (c, b) in sorted(self.collectives.by_key.items())],
                "at_optimizer": by_name(self.at_optimizer or {})}

    def phase(self) -> str:
        if self._in_opt:
            return "optimizer step"
        if self._mod_tracker.is_bw:
            self._backward_seen = self.micro_batch
            return "backward (recomputing activations)" if self._in_ac else "backward"
        if self._backward_seen == self.micro_batch and self.micro_batch:
            return "after backward (gradient norm, clipping)"
        return "forward"

    def _module(self) -> str:
        """The innermost module running, by its name in the model (without the root's class name and the
        activation-checkpoint wrapper); "-" outside the model."""
        inner = [p for p in self._mod_tracker.parents if p != "Global"]
        if not inner:
            return "-"
        name = max(inner, key=lambda p: (p.count("."), len(p)))
        return canonical_name(name.split(".", 1)[1] + ".").rstrip(".") if "." in name else "the model's root"

    def _update_peak_stats(self, peak_state) -> None:
        """The step's peak and where it was reached, and each phase's. MemTracker's own version also keeps every
        module's peak, going over every module of the model at every op (a fifth of an 8B estimate's time); the
        estimate reads only the step's peak and the phases', so that loop is left out."""
        for dev, snap in self._curr_mem_snap.items():
            key = (self.phase(), self.micro_batch)
            best = self.phase_peaks.get(key)
            if best is None or best[0] < snap[TOTAL]:
                self.phase_peaks[key] = (snap[TOTAL], dict(snap), Where(key[0], self._module(), self.micro_batch))
            if self._peak_mem.get(dev, 0) < snap[TOTAL]:
                self._peak_mem[dev] = snap[TOTAL]
                self._peak_mem_snap[dev] = dict(snap)
                self.peak_where = self.phase_peaks[key][2]

    def __enter__(self):
        self._entry_fake_mode = active_fake_mode()  # the estimate's own mode
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if active_fake_mode() is not self._entry_fake_mode:
            # DTensor's sharding propagation, in a fake mode of its own (corrections.py, 2): its global-size tensors
            # are never allocated. torch 2.13's tracker leaves such ops out; torch 2.11's counted them (a 1B model's
            # AdamW states tracked as 25.5 GB instead of 9.9 on a GPU node), so they are left out here for any torch.
            return func(*args, **(kwargs or {}))
        if self._in_opt and self.at_optimizer is None:  # every gradient reduced and sharded, no state updated yet
            (self.at_optimizer,) = self.get_tracker_snapshot().values()
        res = super().__torch_dispatch__(func, types, args, kwargs)
        if res is not NotImplemented and func in collective_ops and func not in sync_ops:
            group = CollectiveOp.get_process_group(func, args)
            dim = self.groups.get(group.group_name, group.group_name)
            self.collectives.add(collective_kind(func), dim, self.phase().split(" (")[0],
                                 CollectiveOp.get_comm_tensor_size(func, res, args, kwargs or {}))
        return res


def by_name(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot by its kinds' names (without the total)."""
    return {getattr(k, "value", str(k)): v for k, v in snapshot.items() if k != TOTAL}
