"""Binding to the C++ CPU AdamW in csrc/ (ctypes; the GIL is released while C++ runs).

The library is loaded on first use, not when ``zenflow`` is imported, so that resolving the
``zenflow`` backend stays light.

Math (per element, in fp32, the order of torch's single-tensor AdamW; scalars are formed in
double and rounded to float once)::

    g = grad * grad_scale                       # boundary pass: g = (acc + g_last) * grad_scale / n
    p = p * (1 - lr * weight_decay)
    m = lerp(m, g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    p = p + (-lr / (1 - beta1**step)) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)
    out = p                                     # optional copy of the result: fp32, or bf16 /
                                                # fp16 rounded to nearest even

Buffers: ``params``, ``exp_avgs``, ``exp_avg_sqs`` (and the boundary pass's ``accumulators``) are
contiguous fp32 CPU tensors; gradients and ``out`` tensors are fp32, bf16 or fp16.
All tensors at one list index have the same number of elements and must not overlap one another.
The lists form one multi-tensor job, sliced over the module's thread pool; every element takes
the same instruction sequence, so results are bitwise identical for any thread count (and for
the AVX-512, AVX2 and scalar variants alike).

Steps: ``steps`` is the step count after increment (bias correction ``1 - beta**steps``), either
one int for every tensor, or a list with one entry per tensor: an int, or an int32/int64 CPU
tensor of per-segment counts. A segment is a run of ``segment_len`` consecutive elements (in
ZenFlow's column-major layout, one column of a weight); a tensor with per-segment steps has
``ceil(numel / segment_len)`` of them. The kernel only reads steps; the caller increments them.
``segment_len`` is one int, or a list with one entry per tensor.

Gathered gradients: a gradient may be given as ``GatheredRows(source, index)``, the rows
``source[index]`` of a 2-D tensor, which the job reads where they are instead of their being
gathered into a tensor first (a weight's host rows inside a gradient laid out in natural column
order).

Asynchrony: ``submit_*`` returns a :class:`CPUAdamHandle` at once; the tensors must stay
untouched until ``wait()`` returns. A failure inside a worker thread is raised by ``wait()`` as
:class:`CPUAdamError`; the tensors' contents are then unspecified. Jobs run in submission order.
"""

from __future__ import annotations

import ctypes
import importlib.util
import operator
import os
import threading
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

from zenflow.runtime import core_binding

__all__ = [
    "CPUAdamError",
    "CPUAdamHandle",
    "GatheredRows",
    "adamw_step",
    "available_cores",
    "boundary_adamw_step",
    "get_num_threads",
    "get_worker_cpus",
    "get_worker_nice",
    "isa",
    "set_num_threads",
    "set_worker_cpus",
    "set_worker_nice",
    "submit_accumulate",
    "submit_adamw_step",
    "submit_boundary_adamw_step",
    "threads_from_reserved_cores",
]

BUILD_HINT = "run `pip install -e .` (or `make install`) in the zenflow checkout to build csrc/"
_ABI_VERSION = 10
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ISA_NAMES = {1: "scalar", 2: "avx2", 3: "avx512"}
DEFAULT_PT_RESERVED_CORES_PERC = 0.5  # ZenFlow's config default
_WAIT_SLICE_MS = 100  # wait in slices so that Ctrl-C reaches Python during a long wait


class CPUAdamError(RuntimeError):
    """A CPU AdamW job failed inside a worker thread."""


class _TensorWork(ctypes.Structure):
    # Mirrors zf::TensorWork in csrc/adamw_kernels.h (checked against its size at load).
    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("grad_dtype", ctypes.c_int32),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("accumulator", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("out_dtype", ctypes.c_int32),
        ("numel", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("segment_steps", ctypes.c_void_p),
        ("segment_len", ctypes.c_int64),
        ("grad_rows", ctypes.c_void_p),
        ("grad_row_len", ctypes.c_int64),
        ("grad_row_count", ctypes.c_int64),
    ]


class GatheredRows(NamedTuple):
    """A gradient given as the rows ``source[index]`` of a 2-D tensor, read in place by the job
    (``index``: a contiguous int64 CPU tensor; the job keeps both alive and unwritten)."""

    source: torch.Tensor
    index: torch.Tensor


class _Hyper(ctypes.Structure):
    # Mirrors zf::Hyper in csrc/adamw_kernels.h.
    _fields_ = [
        (name, ctypes.c_double)
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")
    ]


_lib = None
_lib_lock = threading.Lock()


def _load():
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        spec = importlib.util.find_spec("zenflow._cpu_adam")
        if spec is None or spec.origin is None:
            raise ImportError(f"zenflow's C++ CPU AdamW library is not built: {BUILD_HINT}")
        try:
            lib = ctypes.CDLL(spec.origin)
        except OSError as e:
            raise ImportError(f"cannot load {spec.origin} ({e}): {BUILD_HINT}") from e
        c_int, c_i64, c_void_p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        if not hasattr(lib, "zf_submit") or lib.zf_abi_version() != _ABI_VERSION:
            raise ImportError(f"{spec.origin} is from another zenflow version: {BUILD_HINT}")
        sizes = (c_i64(), c_i64())
        lib.zf_record_sizes(ctypes.byref(sizes[0]), ctypes.byref(sizes[1]))
        if (sizes[0].value, sizes[1].value) != (
            ctypes.sizeof(_TensorWork),
            ctypes.sizeof(_Hyper),
        ):
            raise ImportError(f"{spec.origin} disagrees on record layouts: {BUILD_HINT}")
        lib.zf_set_num_threads.argtypes = [c_int]
        lib.zf_get_num_threads.restype = c_int
        lib.zf_set_worker_nice.argtypes = [c_int]
        lib.zf_get_worker_nice.restype = c_int
        lib.zf_set_worker_cpus.argtypes = [ctypes.POINTER(c_int), c_int]
        lib.zf_set_worker_cpus.restype = c_int
        lib.zf_get_worker_cpus.argtypes = [ctypes.POINTER(c_int), c_int]
        lib.zf_get_worker_cpus.restype = c_int
        lib.zf_isa.restype = c_int
        lib.zf_set_isa.argtypes = [c_int]
        lib.zf_inject_failure.argtypes = [c_int]
        lib.zf_submit.argtypes = [
            ctypes.POINTER(_TensorWork),
            c_i64,
            ctypes.POINTER(_Hyper),
            ctypes.POINTER(c_void_p),
            ctypes.c_char_p,
            c_i64,
        ]
        lib.zf_submit_accumulate.argtypes = lib.zf_submit.argtypes
        lib.zf_job_wait.argtypes = [c_void_p, c_i64]
        lib.zf_job_done.argtypes = [c_void_p]
        lib.zf_job_seconds.argtypes = [c_void_p]
        lib.zf_job_seconds.restype = ctypes.c_double
        lib.zf_job_error.argtypes = [c_void_p, ctypes.c_char_p, c_i64]
        lib.zf_job_error.restype = c_i64
        lib.zf_job_release.argtypes = [c_void_p]
        lib.zf_job_release.restype = None
        lib.zf_gather_columns.argtypes = [
            c_void_p,
            c_i64,
            c_i64,
            c_i64,
            c_void_p,
            c_i64,
            c_void_p,
            c_i64,
            c_int,
        ]
        lib.zf_gather_columns.restype = c_int
        lib.zf_scatter_column_sets.argtypes = [
            c_void_p,
            c_i64,
            c_i64,
            c_i64,
            c_i64,
            c_void_p,
            c_void_p,
            c_void_p,
            c_void_p,
            c_int,
        ]
        lib.zf_scatter_column_sets.restype = c_int
        lib.zf_set_num_threads(threads_from_reserved_cores(DEFAULT_PT_RESERVED_CORES_PERC))
        _lib = lib
        return lib


def available_cores() -> int:
    """The cores this process may run on: its affinity mask (``taskset``, a container's CPU
    set), not every core of the machine."""
    return len(core_binding.allowed_cpus()) or os.cpu_count() or 1


def threads_from_reserved_cores(perc: float, cpu_count: int | None = None) -> int:
    """Worker threads left when ``perc`` of the cores stay with the training thread
    (ZenFlow's ``pt_reserved_cores_perc``): ``max(1, int(cpu_count * (1 - perc)))``, of the
    ``available_cores()`` by default."""
    return core_binding.threads_for(available_cores() if cpu_count is None else cpu_count, perc)


def set_num_threads(n: int) -> None:
    """Sets the worker thread count of the process-wide pool (after queued jobs finish)."""
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    _load().zf_set_num_threads(n)


def get_num_threads() -> int:
    return _load().zf_get_num_threads()


def set_worker_nice(nice: int) -> None:
    """Sets the worker threads' niceness, 0 (default) to 19, for jobs submitted from now on (after
    queued ones finish). Above 0 the workers yield the cores to busier threads of the process,
    such as a training loop that an overlapped update runs beside. Linux only; elsewhere a
    no-op."""
    nice = operator.index(nice)
    if not 0 <= nice <= 19:
        raise ValueError(f"worker niceness must be in [0, 19], got {nice}")
    _load().zf_set_worker_nice(nice)


def get_worker_nice() -> int:
    return _load().zf_get_worker_nice()


def set_worker_cpus(cpus: Sequence[int] | None) -> None:
    """Pins every worker thread to the logical CPUs ``cpus`` (None or empty: no pinning, any CPU
    the process may use), for jobs submitted from now on (after queued ones finish). Linux
    only; elsewhere a no-op. Only CPUs in the affinity mask of the thread that starts the pool
    count; where none of them is, the workers are not pinned."""
    pinned = sorted({operator.index(c) for c in cpus or ()})
    if pinned and pinned[0] < 0:
        raise ValueError(f"CPU numbers must be >= 0, got {pinned[0]}")
    _load().zf_set_worker_cpus((ctypes.c_int * len(pinned))(*pinned), len(pinned))


def get_worker_cpus() -> tuple[int, ...]:
    """The CPUs the worker threads are pinned to, ascending (empty: not pinned)."""
    lib = _load()
    count = lib.zf_get_worker_cpus(None, 0)
    out = (ctypes.c_int * count)()
    lib.zf_get_worker_cpus(out, count)
    return tuple(out)


def isa() -> str:
    """The instruction set new jobs use: "avx512", "avx2" or "scalar"."""
    return _ISA_NAMES[_load().zf_isa()]


def _force_isa_for_tests(name: str | None) -> None:
    """Makes new jobs use one variant ("avx512", "avx2", "scalar"; None: the best available).
    Raises ValueError if this CPU lacks it."""
    code = 0 if name is None else {v: k for k, v in _ISA_NAMES.items()}[name]
    if _load().zf_set_isa(code) != 0:
        raise ValueError(f"this CPU does not support {name}")


def _inject_failure_for_tests(jobs: int = 1) -> None:
    """Makes each of the next ``jobs`` submitted non-empty jobs fail inside a worker thread, so
    that its ``wait()`` raises CPUAdamError ("injected failure"). 0 cancels."""
    _load().zf_inject_failure(operator.index(jobs))


class CPUAdamHandle:
    """A submitted job. Holds its tensors alive until the job has finished. ``done()`` and
    ``wait()`` may be called from any thread."""

    def __init__(self, lib, ptr: int, keepalive: list):
        self._lib = lib
        self._ptr = ptr  # the C job stays valid until this handle is collected
        self._keepalive: list | None = keepalive
        self._error: str | None = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        return bool(self._lib.zf_job_done(self._ptr))

    def seconds(self) -> float:
        """How long the job ran in the pool, from its first task's start to its last task's end
        (not counting its time in the queue); 0.0 until it has finished."""
        return self._lib.zf_job_seconds(self._ptr)

    def wait(self) -> None:
        """Blocks (GIL released) until the job has finished; raises CPUAdamError if it failed,
        at this and every later call."""
        while not self._lib.zf_job_wait(self._ptr, _WAIT_SLICE_MS):
            pass
        with self._lock:
            if self._keepalive is not None:
                buf = ctypes.create_string_buffer(1024)
                if self._lib.zf_job_error(self._ptr, buf, len(buf)):
                    self._error = buf.value.decode(errors="replace")
                self._keepalive = None
        if self._error is not None:
            raise CPUAdamError(f"CPU AdamW worker failed: {self._error}")

    def __del__(self):
        ptr = getattr(self, "_ptr", None)
        if ptr is None:
            return
        # Freeing the tensors of a running job would let the workers write to freed memory.
        if self._keepalive is not None:
            try:
                self.wait()
            except CPUAdamError as e:  # nobody waited: say so rather than lose the failure
                warnings.warn(f"{e} (handle dropped without wait())", RuntimeWarning, stacklevel=1)
        self._lib.zf_job_release(ptr)


def _index_list(value, count: int, name: str) -> list:
    if isinstance(value, Sequence):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} tensors")
        return list(value)
    return [value] * count


def _check_tensor(
    t, name: str, i: int | None, dtypes, numel: int | None, of: str = "params"
) -> None:
    label = name if i is None else f"{name}[{i}]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{label} is on {t.device}; CPU AdamW takes CPU tensors")
    if t.layout != torch.strided:
        raise TypeError(f"{label} has layout {t.layout}; CPU AdamW takes dense tensors")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{label} has dtype {t.dtype}; expected {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"{label} is not contiguous; pass a contiguous tensor (.contiguous())")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{label} has {t.numel()} elements but {of}[{i}] has {numel}")


def _set_grad(record, grad, name: str, i: int, numel: int, of: str = "params") -> None:
    """Points ``record`` at ``grad``, a tensor of ``numel`` elements or ``GatheredRows`` of as
    many (csrc checks that each index is inside the source)."""
    if isinstance(grad, GatheredRows):
        source, index = grad
        _check_tensor(source, f"{name}[{i}].source", None, tuple(_DTYPES), None)
        if source.dim() != 2:
            raise ValueError(f"{name}[{i}].source must be 2-D, got shape {tuple(source.shape)}")
        if index.device.type != "cpu" or index.dtype != torch.int64 or index.dim() != 1:
            raise TypeError(f"{name}[{i}].index must be a 1-D int64 CPU tensor")
        if not index.is_contiguous():
            raise ValueError(f"{name}[{i}].index is not contiguous")
        if index.numel() * source.shape[1] != numel:
            raise ValueError(
                f"{name}[{i}] gathers {index.numel()} rows of {source.shape[1]} elements but "
                f"{of}[{i}] has {numel}"
            )
        record.grad_rows, record.grad_row_len = index.data_ptr(), source.shape[1]
        record.grad_row_count = source.shape[0]
        grad = source
    else:
        _check_tensor(grad, name, i, tuple(_DTYPES), numel, of=of)
    record.grad, record.grad_dtype = grad.data_ptr(), _DTYPES[grad.dtype]


def _submit(
    params,
    grads,
    accumulators,
    exp_avgs,
    exp_avg_sqs,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    steps,
    segment_len,
    grad_scale,
    out,
) -> CPUAdamHandle:
    lib = _load()
    count = len(params)
    lists = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if grads is not None:
        lists["grads" if accumulators is None else "last_grads"] = grads
    if accumulators is not None:
        lists["accumulators"] = accumulators
    if out is not None:
        lists["out"] = out
    for name, tensors in lists.items():
        if len(tensors) != count:
            raise ValueError(f"{name} has {len(tensors)} tensors for {count} params")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    step_list = _index_list(steps, count, "steps")
    seg_list = _index_list(segment_len, count, "segment_len")

    f32 = (torch.float32,)
    records = (_TensorWork * max(count, 1))()
    keepalive = [params, grads, accumulators, exp_avgs, exp_avg_sqs, out]
    for i, p in enumerate(params):
        _check_tensor(p, "params", i, f32, None)
        numel = p.numel()
        r = records[i]
        r.param, r.numel = p.data_ptr(), numel
        _check_tensor(exp_avgs[i], "exp_avgs", i, f32, numel)
        _check_tensor(exp_avg_sqs[i], "exp_avg_sqs", i, f32, numel)
        r.exp_avg, r.exp_avg_sq = exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr()
        if grads is not None and grads[i] is not None:
            _set_grad(r, grads[i], "grads" if accumulators is None else "last_grads", i, numel)
        elif accumulators is None:
            raise ValueError(f"grads[{i}] is None")
        if accumulators is not None:
            _check_tensor(accumulators[i], "accumulators", i, f32, numel)
            r.accumulator = accumulators[i].data_ptr()
        if out is not None and out[i] is not None:
            _check_tensor(out[i], "out", i, tuple(_DTYPES), numel)
            r.out, r.out_dtype = out[i].data_ptr(), _DTYPES[out[i].dtype]
        step = step_list[i]
        if isinstance(step, torch.Tensor):
            seg = seg_list[i]
            if seg is None or operator.index(seg) < 1:
                raise ValueError(f"steps[{i}] is per segment: segment_len must be an int >= 1")
            seg = operator.index(seg)
            segments = -(-numel // seg)
            if step.device.type != "cpu" or step.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"steps[{i}] must be an int32/int64 CPU tensor")
            if step.numel() != segments:
                raise ValueError(
                    f"steps[{i}] has {step.numel()} entries; params[{i}] has {segments} "
                    f"segments of {seg} elements"
                )
            step = step.to(torch.int64).contiguous()
            keepalive.append(step)
            r.segment_steps, r.segment_len = step.data_ptr(), seg
        else:
            r.step = operator.index(step)
            if r.step < 1 and numel > 0:
                raise ValueError(f"steps[{i}] = {r.step}; steps count from 1 (after increment)")

    hyper = _Hyper(float(lr), float(beta1), float(beta2), float(eps), float(weight_decay))
    hyper.grad_scale = float(grad_scale)
    return _queue(lib, lib.zf_submit, records, count, hyper, keepalive, "CPU AdamW")


def _queue(lib, submit, records, count: int, hyper: _Hyper, keepalive, what: str) -> CPUAdamHandle:
    """Hands ``count`` tensor records to a csrc ``submit`` entry point; the handle of the queued
    job, or ValueError with csrc's reason."""
    handle = ctypes.c_void_p()
    err = ctypes.create_string_buffer(512)
    rc = submit(records, count, ctypes.byref(hyper), ctypes.byref(handle), err, len(err))
    if rc != 0:
        raise ValueError(f"{what} rejected the job: {err.value.decode(errors='replace')}")
    return CPUAdamHandle(lib, handle.value, keepalive)


def submit_adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    steps: int | Sequence[int | torch.Tensor],
    segment_len: int | Sequence[int | None] | None = None,
    grad_scale: float = 1.0,
    out: Sequence[torch.Tensor | None] | None = None,
) -> CPUAdamHandle:
    """Queues one AdamW update of every tensor (gradient ``grads[i] * grad_scale``) and returns
    at once. See the module docstring for buffers, steps and segments."""
    return _submit(
        params,
        grads,
        None,
        exp_avgs,
        exp_avg_sqs,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        steps=steps,
        segment_len=segment_len,
        grad_scale=grad_scale,
        out=out,
    )


def adamw_step(*args, **kwargs) -> None:
    """Synchronous :func:`submit_adamw_step` (same arguments)."""
    submit_adamw_step(*args, **kwargs).wait()


def submit_boundary_adamw_step(
    params: Sequence[torch.Tensor],
    accumulators: Sequence[torch.Tensor],
    last_grads: Sequence[torch.Tensor | None] | None,
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    n: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    steps: int | Sequence[int | torch.Tensor],
    segment_len: int | Sequence[int | None] | None = None,
    grad_scale: float = 1.0,
    out: Sequence[torch.Tensor | None] | None = None,
) -> CPUAdamHandle:
    """Queues ZenFlow's update-boundary pass, one read and write of each element:
    ``acc += last_grad; AdamW step with gradient acc * grad_scale / n; acc = 0; out = p``.
    ``last_grads`` (or an entry of it) may be None when the accumulator already holds the sum.
    Bitwise equal to ``acc += last_grad`` followed by ``adamw_step(..., grad_scale=grad_scale / n)``.
    """
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"n (steps accumulated) must be >= 1, got {n}")
    return _submit(
        params,
        last_grads,
        accumulators,
        exp_avgs,
        exp_avg_sqs,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        steps=steps,
        segment_len=segment_len,
        grad_scale=grad_scale / n,
        out=out,
    )


def boundary_adamw_step(*args, **kwargs) -> None:
    """Synchronous :func:`submit_boundary_adamw_step` (same arguments)."""
    submit_boundary_adamw_step(*args, **kwargs).wait()


def submit_accumulate(
    accumulators: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], *, scale: float = 1.0
) -> CPUAdamHandle:
    """Queues ``accumulators[i] += scale * grads[i]`` (torch's ``add_(grad, alpha=scale)``, bit
    for bit) behind the jobs already queued, and returns at once: a window's sum built on the
    pool instead of the training thread. Accumulators are contiguous fp32 CPU tensors, gradients
    contiguous fp32, bf16 or fp16 CPU tensors of the same size (or ``GatheredRows`` of as many
    elements)."""
    lib = _load()
    if len(grads) != len(accumulators):
        raise ValueError(f"grads has {len(grads)} tensors for {len(accumulators)} accumulators")
    records = (_TensorWork * max(len(accumulators), 1))()
    for i, (acc, grad) in enumerate(zip(accumulators, grads, strict=True)):
        _check_tensor(acc, "accumulators", i, (torch.float32,), None)
        r = records[i]
        _set_grad(r, grad, "grads", i, acc.numel(), of="accumulators")
        r.accumulator, r.numel = acc.data_ptr(), acc.numel()
    hyper = _Hyper(grad_scale=float(scale))
    keepalive = [list(accumulators), list(grads)]
    count = len(accumulators)
    return _queue(
        lib, lib.zf_submit_accumulate, records, count, hyper, keepalive, "CPU accumulation"
    )
