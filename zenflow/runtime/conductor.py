"""The runtime of one ZenFlowAdamW: what happens in a step, and in which order.

A step (``step``): the staged gradients are finished (reduced over ranks) and their global
norm taken; a non-finite norm commits nothing. Then, by the schedule
(``zenflow.runtime.schedule``): the first step after warm-up chooses the first selection; the
selected columns and the 1-D parameters take their AdamW step on the device (one call per
param group and device), and their new values are written into the parameters; the unselected
columns' rows join each weight's window (or, in warm-up, every column takes a CPU step now);
a window that closes gets its CPU update, in the background with ``overlap_step`` (applied at
the next boundary); and at a select boundary the step's gradient chooses the next selection
(``close_window``). The exact semantics: docs/algorithm.md.
"""

import contextlib
import math
import time

import torch

from zenflow.columns import column_count, has_columns, select_top_columns, topk_count
from zenflow.runtime import auto_interval, core_binding, cpu_adam, schedule
from zenflow.runtime.comm import CollectiveError, DataParallel
from zenflow.runtime.cpu_jobs import SUMS_QUEUED, CPUJobs
from zenflow.runtime.device_sums import device_sums_for, sums_bytes
from zenflow.runtime.host_sync import HostSync
from zenflow.runtime.migration import EnteringRows, LeavingRows
from zenflow.runtime.nonfinite import clip_coefficient
from zenflow.runtime.owned_weight import OwnedWeight, QueuedReselection
from zenflow.runtime.packed_rows import PackedRows, packed
from zenflow.runtime.param_writes import ColumnValues, write_columns
from zenflow.runtime.pending_update import CopyBuffers, UpdateEntry
from zenflow.runtime.selective_step import (
    StepBuffers,
    compiled_selective_adamw,
    selective_adamw_,
    step_backend_for,
)
from zenflow.runtime.side_by_side import indices_by
from zenflow.runtime.staging import ProductBlocks
from zenflow.runtime.staging.base import squared_norm_totals, squared_row_norms
from zenflow.runtime.staging.contributions import DeviceRows, Factors, HostRows, as_tensor
from zenflow.runtime.streams import copy_stream
from zenflow.runtime.vector_state import VectorState
from zenflow.runtime.window_sum import add_device_rows
from zenflow.runtime.window_updates import WindowUpdates
from zenflow.settings import ZenFlowSettings


def _traced(name: str):
    """Run the method inside a ``torch.profiler`` range ``name``: a trace of training shows
    where zenflow's step spends its time (about 5 us per call without a profiler)."""

    def wrap(method):
        def traced(*args, **kwargs):
            with torch.profiler.record_function(name):
                return method(*args, **kwargs)

        traced.__name__, traced.__doc__ = method.__name__, method.__doc__
        return traced

    return wrap


class Conductor:
    """Owns the weights (``weights``: ``OwnedWeight``) and 1-D parameters (``vectors``) of
    one optimizer's param groups, whether their windows' sums stay on the device
    (``device_sums``, decided once), the schedule's progress (``committed_steps``,
    ``window_steps``, the "auto" rule's state), the windows' CPU updates (``updates``), the
    pool settings and queued sums (``jobs``), the device update's 0-d lr and clip
    coefficients, the counters behind ``stats()``, and the
    failure that stops it (``failure``: set when a CPU job or a collective failed, which left
    host state undefined)."""

    def __init__(
        self,
        param_groups: list[dict],
        settings: ZenFlowSettings,
        *,
        max_grad_norm: float | None,
        step_backend: str,
        nonfinite: str,
        comm: DataParallel,
    ):
        self.param_groups = param_groups  # the optimizer's: LR schedules change their "lr"
        self.settings = settings
        self.max_grad_norm = max_grad_norm
        self.nonfinite = nonfinite
        self.comm = comm
        self.schedule = schedule.Schedule.of(settings)
        self.auto = None
        if settings.update_interval == "auto":
            self.auto = auto_interval.AutoUpdateInterval(
                settings.auto_ratio,
                min_interval=settings.min_update_interval,
                max_interval=settings.max_update_interval,
            )
        self.counters = dict(
            skipped_steps=0,
            reselections=0,
            cpu_updates=0,
            blocking_updates=0,
            d2h_bytes=0,
            h2d_bytes=0,
            optimizer_wait_s=0.0,
            cpu_adam_s=0.0,
            cpu_accumulate_s=0.0,
            host_after_sync_s=0.0,
        )
        self.sync = comm.sync  # the optimizer's one count, shared with its collectives
        self.jobs = CPUJobs(_pool_place(param_groups, settings, comm), self.counters)
        self.device_sums = _device_sums(param_groups, settings, comm)
        self.weights: list[OwnedWeight] = []
        self.vectors: list[VectorState] = []
        products = ProductBlocks()
        for group_index, group in enumerate(param_groups):
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if has_columns(p):
                    self.weights.append(
                        OwnedWeight(
                            p,
                            group_index,
                            comm,
                            offload=settings.offload,
                            device_sums=self.device_sums.on,
                            sync=self.sync,
                            before_norms=self._before_norms,
                            products=products,
                        )
                    )
                else:
                    self.vectors.append(VectorState.of(p, group_index))
        self.step_backend = step_backend
        self.committed_steps = 0
        self.window_steps = 0
        self.last_step_skipped = False
        self.updates = WindowUpdates(self.jobs, self.counters, self.sync)
        self.failure: BaseException | None = None
        self.clip_next_step: float | None = None
        self._norm_sq: float | None = None
        self._reduced_for_norms = False
        self._owned_scale = 1.0  # the scale of the owned weights' staged gradients this step
        self._scores: dict[OwnedWeight, torch.Tensor] = {}
        # update_interval "auto": this step's squared norm of each weight's selected rows.
        self._selected_energy: dict[OwnedWeight, float] = {}
        # ... and, with device-side sums, the terms of its sum's energy (energy_terms).
        self._energy_terms: dict[OwnedWeight, list[float]] = {}
        # (what, param group, device) -> the 0-d lr or clip coefficient of the device update.
        self._scalars: dict[tuple, torch.Tensor] = {}
        # (param group, device, "owned" or "vectors") -> the device update's rows of that
        # kind, packed by width (``zenflow.runtime.packed_rows``).
        self._packs: dict[tuple, PackedRows] = {}

    @property
    def step_backend(self) -> str:
        return self._step_backend

    @step_backend.setter
    def step_backend(self, requested: str) -> None:
        trained = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        device = trained[0].device if trained else torch.device("cpu")
        self._step_backend = step_backend_for(requested, device)
        self._device_step = compiled_selective_adamw(self._step_backend)
        # (param group, device, role) -> the working memory of its device update, for this
        # backend.
        self._step_buffers: dict[tuple, StepBuffers] = {}

    @contextlib.contextmanager
    def failing_for_good(self):
        """A failed CPU job or collective leaves host state undefined: remember it, so that
        nothing steps, flushes or saves until a checkpoint is loaded."""
        try:
            yield
        except (cpu_adam.CPUAdamError, CollectiveError) as error:
            self.failure = error
            raise

    @contextlib.contextmanager
    def timing_after_sync(self):
        """Count the host time from the last synchronization inside the block to its end
        (``host_after_sync_s``): on a GPU the device has only the work queued after that
        synchronization to run, and waits for the host about that long."""
        started = time.perf_counter()
        try:
            yield
        finally:
            synced = self.sync.last_return
            if synced is not None and synced >= started:
                self.counters["host_after_sync_s"] += time.perf_counter() - synced

    def check_usable(self) -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"ZenFlowAdamW cannot continue: an earlier step failed ({self.failure}), which "
                "left its host state undefined; reload from a checkpoint (load_state_dict, or "
                "engine.load_checkpoint) before stepping, flushing or saving again"
            ) from self.failure

    # Gradients.

    @_traced("zenflow::gradient_norm")
    def staged_norm_sq(self) -> float:
        """Squared global norm of this step's gradient as ``.grad`` shows it (clipped through
        ``.grad``, see ``zenflow.runtime.staged_gradient``), non-finite on overflow; computed
        once per step."""
        if self._norm_sq is None:
            for w in self.weights:
                w.collect_gradient()
            owned = [w for w in self.weights if w.staging.staged]
            scales = _gradient_scales(owned)
            # Summed where the parts are (each device's, then the host's): one number per
            # device, not one per weight; the owned weights' apart, as ``scales`` apply to them.
            self._scores = {}
            parts, alone = [], []
            for w in owned:
                weight_parts = w.gradient_norm_parts()
                if weight_parts is None:
                    alone.append(w.gradient_norm_sq())
                else:
                    parts.extend(weight_parts)
            owned_totals = _totals_by_device(squared_norm_totals(parts) + alone)
            self._before_norms()
            grads = [v.param.grad for v in self.vectors if v.param.grad is not None]
            vector_totals = _totals_by_device(squared_norm_totals(grads))
            # The one synchronization of an ordinary step: the rows still on their way to the
            # host land by the time the norm is known, and update_interval "auto" reads the
            # selected rows' energy with it, and the terms of the device-side sums' energy.
            copies = {copy_stream(w.param.device) for w in owned}
            parts = [*owned_totals.values(), *vector_totals.values()]
            auto = self.auto is not None and owned
            selected = self._selected_energy_parts(owned) if auto else None
            terms = self._sum_energy_terms(owned) if auto and self.device_sums.on else None
            extra = [t for t in (selected, terms, scales) if t is not None]
            values = self.sync.values(parts + extra, copies)
            self._owned_scale = 1.0 if scales is None else _common_scale(values.pop())
            self._energy_terms = {}
            if terms is not None:
                self._energy_terms = dict(zip(owned, values.pop(), strict=True))
            if selected is not None:
                self._selected_energy = dict(zip(owned, values.pop(), strict=True))
            owned_norm_sq = sum(values[: len(owned_totals)])
            vector_norm_sq = sum(values[len(owned_totals) :])
            self._norm_sq = owned_norm_sq * self._owned_scale**2 + vector_norm_sq
        return self._norm_sq

    def _before_norms(self) -> None:
        """Once per step, before any norm is taken: the 1-D parameters' gradients are averaged
        over ranks (``clip_grad_norm_`` reads them beside the owned weights' reduced norms),
        and every staged weight's gradient is reduced, the columns' scores of all of them
        summed over ranks in one collective (a weight's norm is the sum of its scores)."""
        if self._reduced_for_norms:
            return
        self._reduced_for_norms = True
        for v in self.vectors:
            if v.param.grad is not None:
                self.comm.all_reduce_mean_(v.param.grad)
        owned = [w for w in self.weights if w.staging.staged]
        for w in owned:
            w.finish_gradient()
        shares = [(w, w.staging.rank_scores()) for w in owned]
        shares = [(w, share) for w, share in shares if share is not None]
        if shares:
            device = shares[0][0].param.device
            summed = self.comm.sum_over_ranks([share for _, share in shares], device)
            for (w, _), scores in zip(shares, summed, strict=True):
                w.staging.adopt_summed_scores(scores)

    def discard_staged(self) -> None:
        for w in self.weights:
            w.discard_gradient()
        self._norm_sq = None
        self._reduced_for_norms = False

    def column_scores(self, weights: list[OwnedWeight]) -> list[torch.Tensor]:
        """This step's importance of each column of each of ``weights`` (natural order, on
        the host), computed once and only when a selection or the "auto" rule asks for it,
        brought to the host in one synchronization. Weights whose rows are views of one block
        (device-side sums: ``zenflow.runtime.staging.product_blocks``) take theirs from one
        norm per row of the block and one copy of it, put in column order on the host: a
        norm, a concatenation and a reordering per weight would be launches on a GPU."""
        missing = [w for w in weights if w not in self._scores]
        if not missing:
            return [self._scores[w] for w in weights]
        blocks: dict[int, tuple[torch.Tensor, list[tuple[OwnedWeight, int]]]] = {}
        alone = []
        for w in missing:
            found = w.staging.rows_in_block()
            if found is None:
                alone.append(w)
            else:
                block, offset = found
                blocks.setdefault(id(block), (block, []))[1].append((w, offset))
        per_block = [squared_row_norms(block) for block, _ in blocks.values()]
        host = self.sync.to_host([w.staging.scores() for w in alone] + per_block)
        self._scores.update(zip(alone, host[: len(alone)], strict=True))
        for (_, members), block_scores in zip(blocks.values(), host[len(alone) :], strict=True):
            for w, offset in members:
                in_order = block_scores[offset : offset + w.layout.columns]
                self._scores[w] = w.layout.in_column_order(in_order)
        return [self._scores[w] for w in weights]

    # The step.

    @_traced("zenflow::step")
    def step(self, grad_divisor: float) -> None:
        kind = schedule.step_kind(self.schedule, self.committed_steps)
        self.jobs.phase = "warm_up" if kind.warm_up else "select" if kind.select else "ordinary"
        # Blocks of finished sums go back for the next backward; a pool lagging further behind
        # holds the training thread here rather than pin another block per weight and step.
        self.jobs.finish_sums(keep=SUMS_QUEUED)
        norm_sq = self.staged_norm_sq()
        max_norm = self.clip_next_step or self.max_grad_norm
        self.clip_next_step = None
        self._norm_sq = None
        self._reduced_for_norms = False
        weights = [w for w in self.weights if w.staging.staged]
        vectors = [v for v in self.vectors if v.param.grad is not None]
        if not weights and not vectors:
            raise RuntimeError(
                "ZenFlowAdamW.step() without gradients: no parameter it owns got one since the "
                "last step; call loss.backward() before step() (if the model's parameters were "
                "replaced after the optimizer was created, create the optimizer again)"
            )
        self.last_step_skipped = not math.isfinite(norm_sq)
        if self.last_step_skipped:  # nothing is committed, whether the step raises or skips
            for w in weights:
                w.discard_gradient()
        coefficient = clip_coefficient(
            norm_sq, grad_divisor, max_norm, self.nonfinite, self.committed_steps + 1
        )
        if coefficient is None:
            self.counters["skipped_steps"] += 1
            return
        # The 1-D parameters' .grad already holds any scale applied through .grad; the staged
        # rows take theirs here.
        owned_coefficient = coefficient * self._owned_scale
        reselecting = weights if schedule.reselects(self.schedule, kind) else []
        self.column_scores(reselecting)  # the next selection's, before the rows are handed on
        if kind.select:
            self._reselect(weights)
            self.counters["reselections"] += 1
        unwritten = self._device_commit(weights, vectors, owned_coefficient, coefficient)
        auto_fired = False
        if kind.warm_up:
            self._full_host_update(weights, owned_coefficient)
        else:
            # An overlapped select boundary reads the entering columns' sums before the CPU
            # update runs: the last step's rows are added to the sums first.
            fold_last = (
                kind.update_boundary
                and self.auto is None
                and owned_coefficient == 1.0
                and not (self.settings.overlap_step and reselecting)
            )
            if self.auto is not None and kind.select:  # the new selection's, from host scores
                energies = self.sync.host_values(self._selected_energy_parts(weights))
                self._selected_energy = dict(zip(weights, energies, strict=True))
            self._accumulate(weights, owned_coefficient, fold_last)
            if self.auto is not None:
                auto_fired = self._auto_window_full(weights, owned_coefficient)
        for w in weights:
            self.counters["d2h_bytes"] += w.staging.staged_bytes
            w.discard_gradient()
        self.committed_steps += 1
        try:
            if not kind.warm_up:
                self.window_steps += 1
                if schedule.closes_window(kind, auto_fired):
                    self.close_window(
                        kind.select_boundary, reselecting=reselecting, unwritten=unwritten
                    )
        finally:  # a failed CPU update leaves the device update's values written all the same
            self._write_unwritten(unwritten)

    def _hyper(self, group_index: int) -> dict:
        group = self.param_groups[group_index]
        beta1, beta2 = group["betas"]
        return dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )

    def by_group(self, weights: list[OwnedWeight]):
        for group_index in range(len(self.param_groups)):
            members = [w for w in weights if w.group_index == group_index]
            if members:
                yield group_index, members

    def _selections(self, weights: list[OwnedWeight]) -> list[torch.Tensor]:
        return [
            select_top_columns(scores, topk_count(self.settings.topk_ratio, w.columns))
            for w, scores in zip(weights, self.column_scores(weights), strict=True)
        ]

    def _queue_reselections(
        self, weights: list[OwnedWeight], with_sums: bool = False
    ) -> tuple[list[QueuedReselection], list[torch.Tensor]]:
        """Each weight's next selection, from this step's scores, and the entering columns'
        rows of all of them (``with_sums``: with their window sums) sent to the device in one
        transfer: (the queued reselections, what the transfer sent)."""
        transfer = EnteringRows(weights[0].state.device, self.comm, weights[0].pin)
        selections = self._selections(weights)
        queued = [
            w.queue_reselection(s, transfer, with_sums)
            for w, s in zip(weights, selections, strict=True)
        ]
        return queued, transfer.send()

    def _take_reselections(
        self, weights: list[OwnedWeight], queued: list[QueuedReselection], sent: list
    ) -> None:
        """The queued selections take effect; the leaving rows of all of them start for the
        host together (each weight's host rows move at its ``state.settle()``)."""
        leaving = LeavingRows()
        for w, reselection in zip(weights, queued, strict=True):
            to_host, to_device = w.take_reselection(reselection, sent, leaving)
            self.counters["d2h_bytes"] += to_host
            self.counters["h2d_bytes"] += to_device
        leaving.send()

    @_traced("zenflow::reselect")
    def _reselect(self, weights: list[OwnedWeight]) -> None:
        """Every one of ``weights`` takes its next selection now: the entering columns' rows
        cross in one transfer for all of them, and one wait covers every leaving row."""
        if not weights:
            return
        self._take_reselections(weights, *self._queue_reselections(weights))
        for w in weights:
            w.state.settle()

    @_traced("zenflow::reselect")
    def _enter_on_device(
        self, weights: list[OwnedWeight]
    ) -> tuple[list[QueuedReselection], list[torch.Tensor]]:
        """An overlapped select boundary, before its window's CPU update is submitted: the
        next selection of each of ``weights``, and the closing window's update of the
        columns entering it, on the device (their state rows and window sums in one transfer;
        one AdamW call per param group and device, as the CPU update would make it: mean
        gradient, the window's lr, weight decay once). Returns the queued reselections and
        what the transfer sent, updated there, for ``_reselect_later``. Runs eagerly: once
        per select interval, on tensors of new shapes each time."""
        queued, sent = self._queue_reselections(weights, with_sums=True)
        calls = {}
        for w, reselection in zip(weights, queued, strict=True):
            if not w.device_sums:
                self.counters["h2d_bytes"] += reselection.migration.rows_to_device * w.out * 4
            rows = reselection.state_rows(sent)
            key = (w.group_index, w.state.device)
            calls.setdefault(key, []).append((rows, reselection.sums(sent)))
        for (group_index, device), members in calls.items():
            hyper = self._hyper(group_index)
            lr = hyper["lr"] * schedule.lr_scale(self.schedule, self.window_steps)
            rows, sums = zip(*members, strict=True)
            selective_adamw_(
                *(list(part) for part in zip(*rows, strict=True)),
                list(sums),
                self._device_scalar("entering_lr", group_index, device, lr),
                self._device_scalar("window_mean", group_index, device, 1.0 / self.window_steps),
                hyper["beta1"],
                hyper["beta2"],
                hyper["eps"],
                hyper["weight_decay"],
            )
        return queued, sent

    def _reselect_later(
        self,
        weights: list[OwnedWeight],
        queued: list[QueuedReselection],
        sent: list,
        entering_written: set[OwnedWeight],
    ) -> None:
        """The selections ``_enter_on_device`` chose take effect, and the entering columns'
        new values are written where they are not yet (``entering_written``; where a weight's
        selection changed: the step wrote the rest); the host rows move once the CPU update
        submitted meanwhile is done with them."""
        self._take_reselections(weights, queued, sent)
        for w, reselection in zip(weights, queued, strict=True):
            if reselection.migration.rows_to_device and w not in entering_written:
                self.counters["h2d_bytes"] += w.write_selected()

    @_traced("zenflow::device_update")
    def _device_commit(
        self, weights, vectors, owned_coefficient: float, coefficient: float
    ) -> dict[OwnedWeight, list[ColumnValues]]:
        """The selected rows and the 1-D parameters: one AdamW call per param group, device
        and gradient coefficient (with ``offload`` the selected rows are updated on the
        host, and written at once). Returns the other weights' new selected values, not yet
        written: a window's write-back in this step writes them in its pass over the parameter
        (``close_window``, which may add the entering columns' values of a reselection),
        ``_write_unwritten`` the rest."""
        unwritten = {}
        calls = {}
        for w in weights:
            if w.layout.k > 0:
                key = (w.group_index, w.state.device, owned_coefficient)
                calls.setdefault(key, ([], []))[0].append(w)
        for v in vectors:
            calls.setdefault((v.group_index, v.param.device, coefficient), ([], []))[1].append(v)
        for (group_index, device, coefficient), (rows, vecs) in calls.items():
            hyper = self._hyper(group_index)
            role = "owned" if rows else "vectors"
            # A unit coefficient (no clipping) leaves the gradients as they are.
            scale = None
            if coefficient != 1.0:
                scale = self._device_scalar(role, group_index, device, coefficient)
            packs = [
                (packed(self._packs, (group_index, device, kind), states), gradients)
                for kind, states, gradients in (
                    ("owned", [w.state for w in rows], [w.staging.selected_rows() for w in rows]),
                    ("vectors", vecs, [v.param.grad for v in vecs]),
                )
                if states
            ]
            copies = [w.selected_copy() for w in rows]
            # Two lists, not a pair per tensor: the step makes as few Python objects as it
            # can, each step (a GPT has hundreds of 1-D parameters).
            destinations = [c for c in copies if c is not None]
            sources = [
                w.state.device_master for c, w in zip(copies, rows, strict=True) if c is not None
            ]
            destinations += [v.param_row() for v in vecs]
            sources += [v.master for v in vecs]
            self._device_step(
                [block for pack, _ in packs for block in pack.masters],
                [block for pack, _ in packs for block in pack.exp_avgs],
                [block for pack, _ in packs for block in pack.exp_avg_sqs],
                [block for pack, _ in packs for block in pack.steps],
                [block for pack, gradients in packs for block in pack.gradients_of(gradients)],
                self._device_scalar("lr", group_index, device, hyper["lr"]),
                scale,
                hyper["beta1"],
                hyper["beta2"],
                hyper["eps"],
                hyper["weight_decay"],
                (destinations, sources) if destinations else None,
                self._buffers_of(group_index, device, role),
            )
            for w, copied in zip(rows, copies, strict=True):
                if w.offload:
                    with torch.profiler.record_function("zenflow::write_selected"):
                        self.counters["h2d_bytes"] += w.write_selected(copied)
                else:
                    unwritten[w] = [w.selected_values(copied)]
        return unwritten

    def _write_unwritten(self, unwritten: dict[OwnedWeight, list[ColumnValues]]) -> None:
        """Write each weight's values in ``unwritten`` (what ``_device_commit`` left, and what
        ``close_window`` added), in one pass per weight, emptying it."""
        with torch.profiler.record_function("zenflow::write_selected"):
            for w, values in unwritten.items():
                write_columns(w.param, *values)
        unwritten.clear()

    def _buffers_of(self, group_index: int, device: torch.device, role: str) -> StepBuffers:
        """Kept per role as well: a step whose owned weights' coefficient differs from the
        1-D parameters' updates them in two calls, each with its own shapes."""
        key = (group_index, device, role)
        buffers = self._step_buffers.get(key)
        if buffers is None:
            scratch = self._step_backend == "eager"
            buffers = self._step_buffers[key] = StepBuffers(scratch)
        return buffers

    def _device_scalar(
        self, what: str, group_index: int, device: torch.device, value: float
    ) -> torch.Tensor:
        """A float64 0-d tensor on ``device`` holding ``value``: one per (what, group, device),
        refilled each step (a kernel queued on the device, where a new tensor from a Python
        number would be a host-to-device copy the host waits for)."""
        key = (what, group_index, device)
        scalar = self._scalars.get(key)
        if scalar is None:
            scalar = self._scalars[key] = torch.empty((), dtype=torch.float64, device=device)
        return scalar.fill_(value)

    @_traced("zenflow::cpu_update")
    def _full_host_update(self, weights: list[OwnedWeight], coefficient: float) -> None:
        """Warm-up: every column of every weight takes a CPU AdamW step now (k is 0)."""
        with self.jobs.every_core():
            for group_index, group_weights in self.by_group(weights):
                handed = [w.staging.hand_over() for w in group_weights]
                torch._foreach_add_([w.state.host_steps for w in group_weights], 1)
                copies = CopyBuffers(group_weights)
                handle = cpu_adam.submit_adamw_step(
                    [w.state.host_master for w in group_weights],
                    [_pool_rows(c, self.sync) for c in handed],
                    [w.state.host_exp_avg for w in group_weights],
                    [w.state.host_exp_avg_sq for w in group_weights],
                    steps=[w.state.host_steps for w in group_weights],
                    segment_len=[w.out for w in group_weights],
                    grad_scale=coefficient,
                    out=copies.rows,
                    **self._hyper(group_index),
                )
                self.jobs.collect(handle, "cpu_adam_s")
                self.counters["blocking_updates"] += 1
                _release(handed)
                with torch.profiler.record_function("zenflow::write_unselected"):
                    placed = copies.on_device()
                    for w, copied, sent in zip(group_weights, copies.rows, placed, strict=True):
                        entry = UpdateEntry.of(w, copied, None, None)
                        self.counters["h2d_bytes"] += entry.write(sent)
        self.counters["cpu_updates"] += 1 if weights else 0

    @_traced("zenflow::window_sums")
    def _accumulate(self, weights: list[OwnedWeight], coefficient: float, fold_last: bool):
        """Add this step's unselected rows to the windows' sums. At a fixed window's last step
        with no clipping the CPU update folds the addition into its own pass instead. Host
        rows are added by the CPU pool, behind the update still running there, while the
        training thread goes on ("auto" reads the sums' norms every step: it adds them
        itself)."""
        sums, rows, releases = [], [], []
        on_device, device_rows = [], []
        for w in weights:
            handed = w.staging.hand_over()
            if isinstance(handed, DeviceRows):
                on_device.append(w.window)
                device_rows.append(handed.rows)
            elif isinstance(handed, Factors) and self.auto is None:
                w.window.defer(handed, coefficient)
            elif isinstance(handed, HostRows) and fold_last:
                w.window.keep_last(handed, _window_rows(w), w.out)
            elif isinstance(handed, HostRows) and self.auto is None:
                window_sum, staged = w.window.add_on_pool(handed, _window_rows(w), w.out)
                sums.append(window_sum)
                rows.append(staged)
                if handed.release is not None:
                    releases.append(handed.release)
            else:
                w.window.add_now(handed, coefficient, w.out)
        if on_device:
            add_device_rows(on_device, device_rows, coefficient)
        if sums:
            self.jobs.queue_sums(sums, rows, releases, coefficient)

    def _selected_energy_parts(self, weights: list[OwnedWeight]) -> torch.Tensor:
        """Each weight's squared norm of this step's selected rows (before the coefficient),
        from its scores where they are, not yet read."""
        energies = []
        for w in weights:
            scores = self._scores[w] if w in self._scores else w.staging.scores()
            columns = w.layout.on(scores.device, "selected")
            energies.append(scores[columns].sum(dtype=torch.float64))
        return torch.stack([energy.to(energies[0].device) for energy in energies])

    def _sum_energy_terms(self, weights: list[OwnedWeight]) -> torch.Tensor | None:
        """Device-side sums under "auto": each weight's ``WindowSum.energy_terms`` of this
        step's staged rows, not yet read; None at a step that first selects (its rows move
        after the norm) or warms up."""
        kind = schedule.step_kind(self.schedule, self.committed_steps)
        if kind.select or kind.warm_up:
            return None
        return torch.stack([w.window.energy_terms(w.staging.host_rows()) for w in weights])

    def _auto_window_full(self, weights: list[OwnedWeight], coefficient: float) -> bool:
        """update_interval "auto": this step's selected energy (read with the step's norm)
        against the energy of the accumulated unselected sum (its squared norm, summed over
        ranks; read once for every weight: host-side sums without a synchronization, device-side
        ones from the terms read with the norm, or once here where there are none)."""
        if self.device_sums.on and all(w in self._energy_terms for w in weights):
            c = coefficient
            terms = (self._energy_terms[w] for w in weights)
            piled = [total + 2 * c * cross + c * c * rows for total, cross, rows in terms]
        else:
            energies = torch.stack([w.window.energy() for w in weights])
            if self.device_sums.on:
                (energies,) = self.sync.to_host([energies])
            piled = self.comm.host_sums(energies)
        selected = [self._selected_energy[w] * coefficient**2 for w in weights]
        observed = {}
        for w, unselected, energy in zip(weights, piled, selected, strict=True):
            observed[self.weights.index(w)] = (energy, unselected, w.layout.k, w.columns)
        return self.auto.observe(observed)

    # Windows and their CPU updates.

    @_traced("zenflow::cpu_update")
    def close_window(
        self,
        select_boundary: bool,
        force_sync: bool = False,
        reselecting: list[OwnedWeight] = (),
        unwritten: dict[OwnedWeight, list[ColumnValues]] | None = None,
    ) -> None:
        """The CPU update of the unselected columns from the window's mean gradient; then
        ``reselecting`` (at a select boundary: the weights this step's gradient reached) take
        their next selection. Synchronously, the CPU update covers every unselected column and
        the state of the columns that change side moves after it. With ``overlap_step``, the
        entering columns take the update on the device (``_enter_on_device``) and the CPU
        update, over the old layout's rows, lands at the next boundary. ``unwritten``: the
        values the step has not yet written (``_device_commit``), with the entering columns'
        added here: written in the pass of a weight's write-back, or before the reselection."""
        weights = [w for w in self.weights if w.window.open]
        unwritten = {} if unwritten is None else unwritten
        background = self.settings.overlap_step and not force_sync
        self.jobs.phase = (
            "select_boundary" if select_boundary else "flush" if force_sync else "window_close"
        )
        if not background:
            self.jobs.finish_sums()
        # The weights whose CPU update is submitted now select on the device before it; the
        # others (no open window) have no update running over their host rows.
        later = [w for w in reselecting if w in weights] if background else []
        entered = [], []
        entering_written = set()
        if later:
            self.updates.wait()  # the entering columns' host rows: the pending update's result
            self.jobs.finish_sums()  # the entering columns' sums include this step's rows
            entered = self._enter_on_device(later)
            # Written in the pass that writes the pending update's result, after it.
            for w, reselection in zip(later, entered[0], strict=True):
                if w in unwritten and reselection.migration.rows_to_device:
                    unwritten[w].append(w.entering_values(reselection, entered[1]))
                    entering_written.add(w)
        # A synchronous update writes its weights' columns to the parameters right after the
        # pending one would have: the pending result is not written for those.
        self.updates.apply_pending(rewritten=() if background else weights, unwritten=unwritten)
        with contextlib.nullcontext() if background else self.jobs.every_core():
            for group_index, group_weights in self.by_group(weights):
                hyper = self._hyper(group_index)
                hyper["lr"] *= schedule.lr_scale(self.schedule, self.window_steps)
                update = self.updates.submit(group_weights, hyper, self.window_steps, background)
                if not background:  # this call waits for the job it submitted
                    self.updates.apply(update, unwritten=unwritten)
                    self.counters["blocking_updates"] += 1
        self.counters["cpu_updates"] += 1 if weights else 0
        self._write_unwritten(unwritten)  # the reselection replaces the values' sources
        if reselecting:
            self._reselect_later(later, *entered, entering_written)
            self._reselect([w for w in reselecting if w not in later])
            self.counters["reselections"] += 1
        self.window_steps = 0
        if self.auto is not None:
            self.auto.reset()

    def flush(self) -> None:
        """Apply everything pending: an overlapped CPU update and the open window's sum."""
        self.jobs.phase = "flush"
        if self.window_steps:
            self.close_window(select_boundary=False, force_sync=True)
        self.updates.apply_pending()
        self.jobs.finish_sums()

    def wait_for_jobs(self) -> None:
        """Let every job end without applying anything (a state dict taken between steps)."""
        self.jobs.phase = "state_dict"
        self.jobs.finish_sums()
        self.updates.wait()

    def abandon_jobs(self) -> None:
        """After a failure: let running jobs end without raising (their results are undefined
        and state loaded next replaces everything they touched)."""
        self.updates.abandon()
        self.jobs.abandon_sums()

    # Inspection.

    def stats(self) -> dict:
        selected = sum(w.layout.k * w.out for w in self.weights)
        total = sum(w.columns * w.out for w in self.weights)
        return dict(
            steps=self.committed_steps,
            selected_fraction=selected / total if total else 0.0,
            window_steps=self.window_steps,
            updates_in_flight=len(self.updates.pending),
            host_columns=sum(w.layout.block_rows for w in self.weights),
            accumulate_on_device=self.device_sums.on,
            device_syncs=self.sync.count,
            hand_over_s=sum(w.hand_over_s for w in self.weights),
            cpu_pool_threads=self.jobs.place.threads,
            cpu_pool_cpus=list(self.jobs.place.cpus or ()),
            **self.counters,
        )

    def check_params_unchanged(self) -> None:
        for w in self.weights:
            w.check_unchanged()
        for v in self.vectors:
            if v.param.numel() != v.master.numel():
                raise RuntimeError(
                    f"a parameter owned by ZenFlowAdamW changed shape to {list(v.param.shape)} "
                    f"after the optimizer was created (it had {v.master.numel()} elements); "
                    "create the optimizer after the last change to the model"
                )


def _trained(param_groups) -> list[torch.Tensor]:
    return [p for g in param_groups for p in g["params"] if p.requires_grad]


def _weights_device(param_groups) -> torch.device:
    trained = _trained(param_groups)
    return trained[0].device if trained else torch.device("cpu")


def _pool_place(param_groups, settings: ZenFlowSettings, comm: DataParallel):
    """Where this rank's CPU pool runs, from the affinity masks of the ranks on its machine
    (``zenflow.runtime.core_binding``)."""
    ranks = comm.gather_objects((core_binding.machine_id(), sorted(core_binding.allowed_cpus())))
    masks, index = core_binding.machine_masks(ranks, comm.rank)
    return core_binding.place_pool(
        settings.pt_reserved_cores_perc,
        core_binding.binds(settings.bind_cores, _weights_device(param_groups)),
        masks,
        index,
    )


def _device_sums(param_groups, settings: ZenFlowSettings, comm: DataParallel):
    """``accumulate_on_device`` decided for these parameters (``zenflow.runtime.device_sums``)."""
    shapes = [(p.shape[0], column_count(p.shape)) for p in _trained(param_groups) if has_columns(p)]
    needed = sums_bytes(shapes, lambda columns: topk_count(settings.topk_ratio, columns))
    return device_sums_for(
        settings.accumulate_on_device,
        _weights_device(param_groups),
        comm.world_size,
        needed,
        offload=settings.offload,
    )


def _gradient_scales(weights: list[OwnedWeight]) -> torch.Tensor | None:
    """The factors the weights' staged gradients were multiplied by through ``.grad``
    (clip_grad_norm_'s coefficient), not yet read: a 1-D tensor, one entry where every weight
    shares one (clip_grad_norm_: one tensor for all); None where none was applied."""
    scales = [w.gradient_scale() for w in weights]
    scaled = [scale for scale in scales if scale is not None]
    if not scaled:
        return None
    if len(scaled) < len(scales):
        raise _mixed_scales()
    if all(scale is scaled[0] for scale in scaled):
        return scaled[0].reshape(1)
    return torch.stack([s.to(scaled[0].device) for s in scaled])


def _common_scale(values: list[float]) -> float:
    """The one factor of ``_gradient_scales``, read."""
    if any(value != values[0] for value in values):
        raise _mixed_scales()
    return values[0]


def _mixed_scales() -> RuntimeError:
    return RuntimeError(
        "the .grad of some weights owned by ZenFlowAdamW was scaled (clip_grad_norm_, "
        "mul_) and of others not, or by other factors: a step applies one factor to all "
        "its staged gradients; scale them alike (clip_grad_norm_(model.parameters(), ...))"
    )


def _totals_by_device(parts: list[torch.Tensor]) -> dict[torch.device, torch.Tensor]:
    """The sum of the 0-d ``parts`` on each device (one stack and one sum per device, not an
    addition per part)."""
    return {
        device: torch.stack([parts[i] for i in members]).sum()
        for device, members in indices_by(part.device for part in parts).items()
    }


def _window_rows(w: OwnedWeight) -> int:
    """Rows of ``w``'s window: this rank's unselected columns."""
    return w.layout.host_columns.numel()


def _pool_rows(contribution, sync: HostSync):
    """A contribution's rows as the CPU pool reads them (host rows as they are)."""
    if isinstance(contribution, HostRows):
        return contribution.rows
    rows = as_tensor(contribution)
    return sync.to_host([rows])[0] if isinstance(contribution, DeviceRows) else rows


def _release(contributions) -> None:
    for contribution in contributions:
        if isinstance(contribution, HostRows) and contribution.release is not None:
            contribution.release()
