"""zenflow's C++ CPU AdamW: numerics against torch.optim.AdamW, per-segment steps, bf16/fp16
copy-out, the fused ZenFlow boundary pass, determinism, asynchrony and error paths."""

import copy
import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.optim.adamw import adamw as torch_adamw

from tests.forked import result_in_forked_child
from zenflow.cpu_adamw import CPUAdamW
from zenflow.optimizer import ZenFlowAdamW
from zenflow.runtime import core_binding, cpu_adam
from zenflow.runtime.core_binding import PoolPlace
from zenflow.runtime.cpu_jobs import CPUJobs

TOL = dict(rtol=1e-5, atol=1e-6)
HYPERS = [
    dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01),
    # beta1 = 0.5 and 0 take the other branch of torch's lerp (weight >= 0.5).
    dict(lr=1e-1, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.1),
    dict(lr=3e-4, betas=(0.0, 0.99), eps=1e-8, weight_decay=0.0),
]
ISAS = ["scalar", "avx2", "avx512"]


def _supported_isas():
    out = []
    for name in ISAS:
        try:
            cpu_adam._force_isa_for_tests(name)
            out.append(name)
        except ValueError:
            pass
    cpu_adam._force_isa_for_tests(None)
    return out


@pytest.fixture(autouse=True)
def _restore_pool():
    threads = cpu_adam.get_num_threads()
    yield
    cpu_adam._force_isa_for_tests(None)
    cpu_adam._inject_failure_for_tests(0)
    cpu_adam.set_num_threads(threads)


def _hyper(h):
    return dict(
        lr=h["lr"],
        beta1=h["betas"][0],
        beta2=h["betas"][1],
        eps=h["eps"],
        weight_decay=h["weight_decay"],
    )


def _torch_reference(p, g, m, v, step, h):
    """One step of torch's single-tensor AdamW on the given (views of) buffers."""
    torch_adamw(
        [p],
        [g],
        [m],
        [v],
        [],
        [torch.tensor(float(step - 1))],
        foreach=False,
        amsgrad=False,
        maximize=False,
        **_hyper(h),
    )


def _run_pair(numel, hyper, steps=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ours = torch.randn(numel, generator=gen)
    ref = ours.clone().requires_grad_()
    ours.requires_grad_()
    opt = CPUAdamW([ours], **hyper)
    ref_opt = torch.optim.AdamW([ref], foreach=False, **hyper)
    for _ in range(steps):
        g = torch.randn(numel, generator=gen)
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    return (ours, opt.state[ours]), (ref, ref_opt.state[ref])


@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize("numel", [0, 1, 7, 1023])
def test_matches_torch_adamw(numel, hyper):
    (p, s), (rp, rs) = _run_pair(numel, hyper)
    torch.testing.assert_close(p.detach(), rp.detach(), **TOL)
    torch.testing.assert_close(s["exp_avg"], rs["exp_avg"], **TOL)
    torch.testing.assert_close(s["exp_avg_sq"], rs["exp_avg_sq"], **TOL)
    assert s["step"].item() == rs["step"].item() == 20


@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch_adamw_large(threads):
    cpu_adam.set_num_threads(threads)
    (p, s), (rp, rs) = _run_pair(2**20 + 3, HYPERS[threads - 1])
    torch.testing.assert_close(p.detach(), rp.detach(), **TOL)
    torch.testing.assert_close(s["exp_avg"], rs["exp_avg"], **TOL)
    torch.testing.assert_close(s["exp_avg_sq"], rs["exp_avg_sq"], **TOL)


def test_param_groups_and_lr_schedule_match_torch():
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(33, 17, generator=gen), torch.randn(33, generator=gen)]
    ours = [t.clone().requires_grad_() for t in init]
    ref = [t.clone().requires_grad_() for t in init]

    def groups(ps):
        return [{"params": [ps[0]]}, {"params": [ps[1]], "weight_decay": 0.0, "lr": 5e-2}]

    opt = CPUAdamW(groups(ours), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1, foreach=False)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt, ref_opt)]
    for _ in range(10):
        for a, b in zip(ours, ref, strict=True):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        for s in scheds:
            s.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), **TOL)


def _buffers(numel, seed, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(numel, generator=gen)
    g = torch.randn(numel, generator=gen).to(grad_dtype)
    m = torch.randn(numel, generator=gen) * 0.1
    v = torch.rand(numel, generator=gen) * 0.01
    return p, g, m, v


def test_per_segment_steps_match_per_segment_reference():
    seg_len, segments = 37, 11
    numel = seg_len * segments - 5  # the last segment is partial
    hyper = HYPERS[0]
    seg_steps = torch.randint(1, 50, (segments,), generator=torch.Generator().manual_seed(2))
    seg_steps[3:6] = 7  # neighbouring segments sharing a step run as one
    p, g, m, v = _buffers(numel, 3)
    rp, rm, rv = p.clone(), m.clone(), v.clone()
    cpu_adam.adamw_step(
        [p], [g], [m], [v], **_hyper(hyper), steps=[seg_steps.int()], segment_len=seg_len
    )
    for j in range(segments):
        sl = slice(j * seg_len, min(numel, (j + 1) * seg_len))
        _torch_reference(rp[sl], g[sl], rm[sl], rv[sl], int(seg_steps[j]), hyper)
    torch.testing.assert_close(p, rp, **TOL)
    torch.testing.assert_close(m, rm, **TOL)
    torch.testing.assert_close(v, rv, **TOL)


def test_uniform_step_is_the_special_case_of_segment_steps():
    a = _buffers(1000, 4)
    b = [t.clone() for t in a]
    hyper = _hyper(HYPERS[1])
    cpu_adam.adamw_step([a[0]], [a[1]], [a[2]], [a[3]], **hyper, steps=9)
    steps = torch.full((10,), 9, dtype=torch.int64)
    cpu_adam.adamw_step([b[0]], [b[1]], [b[2]], [b[3]], **hyper, steps=[steps], segment_len=100)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def _special_values():
    """Values whose bf16/fp16 rounding is delicate: ties, subnormals, overflow, inf, NaN."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-30, 30, (4096,)).float())
    bits = torch.randint(0, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64)
    ties = ((bits & ~0xFFFF) | 0x8000).to(torch.int32).view(torch.float32)
    ties_f16 = ((bits & ~0x1FFF) | 0x1000).to(torch.int32).view(torch.float32)
    edges = torch.tensor(
        [0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.98e-8, 1e-6, 6.1e-5,
         1e-40, -1e-40, 3.4e38, float("inf"), float("-inf"), float("nan")]
    )  # fmt: skip
    return torch.cat([wide, ties, ties_f16, ties_f16 * 2**-20, edges])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_out_is_the_result_rounded_to_nearest_even(isa, dtype):
    if isa not in _supported_isas():
        pytest.skip(f"CPU lacks {isa}")
    cpu_adam._force_isa_for_tests(isa)
    p = _special_values()
    numel = p.numel()
    out = torch.empty(numel, dtype=dtype)
    # lr = weight_decay = 0 leave p as it is (up to the sign of zero), so every value reaches
    # the conversion.
    cpu_adam.adamw_step(
        [p],
        [torch.randn(numel)],
        [torch.zeros(numel)],
        [torch.zeros(numel)],
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        steps=1,
        out=[out],
    )
    expected = p.to(dtype)
    nan = torch.isnan(p)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(bits), expected[~nan].view(bits))


def _job(seed, numels, grad_dtype, out_dtype, boundary):
    """Buffers and kwargs for a multi-tensor call with mixed per-segment and uniform steps."""
    bufs = [_buffers(n, seed + i, grad_dtype) for i, n in enumerate(numels)]
    gen = torch.Generator().manual_seed(seed)
    steps = [torch.randint(1, 30, (-(-n // 64),), generator=gen) for n in numels]
    steps[0] = 5
    args = dict(
        params=[b[0] for b in bufs],
        exp_avgs=[b[2] for b in bufs],
        exp_avg_sqs=[b[3] for b in bufs],
        out=[torch.empty(n, dtype=out_dtype) for n in numels] if out_dtype else None,
        steps=steps,
        segment_len=64,
        **_hyper(HYPERS[0]),
    )
    if boundary:
        args["accumulators"] = [torch.randn(n, generator=gen) for n in numels]
        args["last_grads"] = [b[1] for b in bufs]
        args["n"] = 3
    else:
        args["grads"] = [b[1] for b in bufs]
    return args


def _run_job(args, boundary):
    if boundary:
        cpu_adam.boundary_adamw_step(**args)
    else:
        cpu_adam.adamw_step(**args)
    keys = ["params", "exp_avgs", "exp_avg_sqs", "out", "accumulators"]
    return [t for k in keys for t in (args.get(k) or [])]


NUMELS = [200_003, 1, 15, 64, 70_000]


@pytest.mark.parametrize("boundary", [False, True])
def test_bitwise_identical_across_thread_counts_and_isas(boundary):
    results = []
    for isa in _supported_isas():
        cpu_adam._force_isa_for_tests(isa)
        for threads in [1, 2, 3, 5]:
            cpu_adam.set_num_threads(threads)
            args = _job(10, NUMELS, torch.bfloat16, torch.bfloat16, boundary)
            results.append(((isa, threads), _run_job(args, boundary)))
    (_, first), rest = results[0], results[1:]
    for config, tensors in rest:
        for a, b in zip(first, tensors, strict=True):
            assert torch.equal(a, b), config


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_gradients_equal_their_fp32_upcast(grad_dtype):
    a = _job(20, [3001], grad_dtype, torch.float16, False)
    b = _job(20, [3001], grad_dtype, torch.float16, False)
    b["grads"] = [g.float() for g in b["grads"]]
    for x, y in zip(_run_job(a, False), _run_job(b, False), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_last_grad", [True, False])
def test_fused_boundary_equals_accumulate_then_step(with_last_grad, out_dtype):
    numels = [5000, 17]
    fused = _job(30, numels, torch.bfloat16, out_dtype, True)
    if not with_last_grad:
        fused["last_grads"] = None
    split = copy.deepcopy(fused)
    _run_job(fused, True)

    accs = split.pop("accumulators")
    last = split.pop("last_grads")
    n = split.pop("n")
    if last is not None:
        for acc, g in zip(accs, last, strict=True):
            acc += g.float()
    cpu_adam.adamw_step(grads=accs, grad_scale=1.0 / n, **split)
    for key in ["params", "exp_avgs", "exp_avg_sqs", "out"]:
        for a, b in zip(fused[key], split[key], strict=True):
            assert torch.equal(a, b), key
    for p, out in zip(fused["params"], fused["out"], strict=True):
        assert torch.equal(out, p.to(out_dtype))
    assert all(torch.count_nonzero(acc) == 0 for acc in fused["accumulators"])


def test_submission_returns_while_the_job_runs():
    # One worker beside the submitting thread on any machine of two cores or more, and the
    # slowest kernel: the job takes tens of milliseconds, its submission well under one.
    cpu_adam._force_isa_for_tests("scalar")
    cpu_adam.set_num_threads(1)
    handle = cpu_adam.submit_adamw_step(**_job(48, [2**23], torch.float32, None, False))
    assert not handle.done()
    handle.wait()
    assert handle.done()


def test_async_equals_sync_and_runs_in_order():
    cpu_adam.set_num_threads(3)
    sync = [_job(40 + i, [2**20], torch.float32, None, False) for i in range(4)]
    asyn = copy.deepcopy(sync)
    for args in sync:
        _run_job(args, False)
    # The same tensors updated twice: the second job must see the first one's result.
    handles = [cpu_adam.submit_adamw_step(**args) for args in asyn + asyn]
    for h in handles:
        h.wait()
        assert h.done()
    for args in sync:
        _run_job(args, False)
    for a, b in zip(sync, asyn, strict=True):
        for x, y in zip(_run_job(a, False), _run_job(b, False), strict=True):
            assert torch.equal(x, y)


def test_queued_jobs_on_the_same_tensors_apply_one_after_another():
    # Job B visits the tensors in the reverse order of job A, so its first task is A's last:
    # started as soon as A's tasks were all handed out, it would race with A.
    cpu_adam.set_num_threads(3)
    sync = _job(47, [2**16] * 8, torch.float32, torch.bfloat16, False)
    asyn = copy.deepcopy(sync)
    reverse = {k: v[::-1] if isinstance(v, list) else v for k, v in asyn.items()}
    for _ in range(10):
        _run_job(sync, False)
        _run_job({k: v[::-1] if isinstance(v, list) else v for k, v in sync.items()}, False)
        first = cpu_adam.submit_adamw_step(**asyn)
        second = cpu_adam.submit_adamw_step(**reverse)
        first.wait()
        second.wait()
    for x, y in zip(_run_job(sync, False), _run_job(asyn, False), strict=True):
        assert torch.equal(x, y)


def test_gil_is_released_while_cpp_runs():
    cpu_adam._force_isa_for_tests("scalar")  # the slowest variant: a long call
    cpu_adam.set_num_threads(1)
    args = _job(45, [2**22], torch.float32, None, False)
    in_call = threading.Event()

    def update():
        in_call.set()
        _run_job(args, False)

    worker = threading.Thread(target=update)
    worker.start()
    in_call.wait()
    time.sleep(0.002)  # Python code runs here only if the call released the GIL
    assert worker.is_alive()
    worker.join()


def _update_in_child(queue):
    torch.set_num_threads(1)  # libgomp, which torch's own ops use, is not fork-safe
    args = _job(46, [100_000], torch.float32, None, False)
    _run_job(args, False)
    queue.put(args["params"][0].sum().item())


def test_forked_child_gets_a_fresh_pool():
    _run_job(_job(46, [10], torch.float32, None, False), False)  # the parent's pool exists
    in_child = result_in_forked_child(_update_in_child, "CPU AdamW")
    expected = _job(46, [100_000], torch.float32, None, False)
    _run_job(expected, False)
    assert in_child == expected["params"][0].sum().item()


def test_optimizer_step_async_equals_step():
    init = torch.randn(3000)
    ps = [init.clone().requires_grad_() for _ in range(2)]
    opts = [CPUAdamW([p], lr=1e-2) for p in ps]
    for _ in range(3):
        g = torch.randn(3000)
        for p in ps:
            p.grad = g.clone()
        opts[0].step()
        handle = opts[1].step_async()
        handle.wait()
        assert handle.done()
    assert torch.equal(ps[0], ps[1])
    assert torch.equal(opts[0].state[ps[0]]["exp_avg_sq"], opts[1].state[ps[1]]["exp_avg_sq"])


def test_state_dict_round_trip():
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(50, generator=gen) for _ in range(6)]
    a = torch.randn(50, generator=gen).requires_grad_()
    opt = CPUAdamW([a], lr=1e-2)
    for g in grads[:3]:
        a.grad = g.clone()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    b = a.detach().clone().requires_grad_()
    restored = CPUAdamW([b], lr=1.0)  # the state dict's hyperparameters win
    restored.load_state_dict(saved)
    for g in grads[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        restored.step()
    assert torch.equal(a, b)
    assert restored.state[b]["step"].item() == 6


def test_loads_torch_adamw_state():
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(40, generator=gen).requires_grad_()
    ref = torch.optim.AdamW([a], lr=1e-2, foreach=False)
    a.grad = torch.randn(40, generator=gen)
    ref.step()
    b = a.detach().clone().requires_grad_()
    ours = CPUAdamW([b], lr=1e-2)
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch shares loaded tensors
    for _ in range(3):
        g = torch.randn(40, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(b.detach(), a.detach(), **TOL)


def test_worker_failure_surfaces_at_wait():
    args = _job(50, [100_000, 10], torch.float32, None, False)
    cpu_adam._inject_failure_for_tests(1)
    handle = cpu_adam.submit_adamw_step(**args)
    with pytest.raises(cpu_adam.CPUAdamError, match="injected failure"):
        handle.wait()
    with pytest.raises(cpu_adam.CPUAdamError):  # and again: a failure is never lost
        handle.wait()
    cpu_adam.adamw_step(**args)  # the pool survives

    p = torch.randn(10, requires_grad=True)
    opt = CPUAdamW([p])
    p.grad = torch.randn(10)
    cpu_adam._inject_failure_for_tests(1)
    with pytest.raises(cpu_adam.CPUAdamError):
        opt.step()

    cpu_adam._inject_failure_for_tests(1)
    handle = cpu_adam.submit_adamw_step(**args)
    with pytest.warns(RuntimeWarning, match="dropped without wait"):
        del handle
        gc.collect()


def _call(**overrides):
    args = dict(
        params=[torch.zeros(8)],
        grads=[torch.zeros(8)],
        exp_avgs=[torch.zeros(8)],
        exp_avg_sqs=[torch.zeros(8)],
        **_hyper(HYPERS[0]),
        steps=1,
    )
    args.update(overrides)
    cpu_adam.adamw_step(**args)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(params=[torch.zeros(16)[::2]]), ValueError, r"params\[0\] is not contiguous"),
        (dict(grads=[torch.zeros(8, dtype=torch.float64)]), TypeError, r"grads\[0\] has dtype"),
        (dict(exp_avgs=[torch.zeros(8, dtype=torch.int32)]), TypeError, r"exp_avgs\[0\]"),
        (dict(exp_avg_sqs=[torch.zeros(8, device="meta")]), ValueError, r"is on meta"),
        (dict(grads=[torch.zeros(9)]), ValueError, r"grads\[0\] has 9 elements"),
        (dict(grads=[]), ValueError, "grads has 0 tensors for 1 params"),
        (dict(out=[torch.zeros(8).int()]), TypeError, r"out\[0\] has dtype torch.int32"),
        (dict(steps=0), ValueError, "steps count from 1"),
        (dict(beta2=1.0), ValueError, "beta2"),
        (dict(steps=[torch.ones(2, dtype=torch.int64)]), ValueError, "segment_len"),
        (dict(steps=[torch.ones(3)], segment_len=4), TypeError, "int32/int64"),
        (dict(steps=[torch.ones(3, dtype=torch.int64)], segment_len=4), ValueError, "2 segments"),
        (dict(steps=[torch.tensor([1, 0])], segment_len=4), ValueError, "segment 1 has step < 1"),
    ],
)
def test_invalid_arguments_raise(overrides, error, match):
    with pytest.raises(error, match=match):
        _call(**overrides)


def test_optimizer_rejects_unsupported_params():
    with pytest.raises(TypeError, match="param 0 of param group 0 has dtype torch.bfloat16"):
        CPUAdamW([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)])
    with pytest.raises(ValueError, match="not contiguous"):
        CPUAdamW([torch.zeros(4, 4).t().requires_grad_()])
    with pytest.raises(ValueError, match="param 0 of param group 1 is on meta"):
        CPUAdamW([{"params": [torch.zeros(2)]}, {"params": [torch.zeros(2, device="meta")]}])
    p = torch.zeros(2, 2, requires_grad=True)
    p.grad = torch.zeros(2, 2).t()
    with pytest.raises(ValueError, match="gradient of param 0 of param group 0 is not contiguous"):
        CPUAdamW([p]).step()


def test_missing_library_says_how_to_build(monkeypatch):
    monkeypatch.setattr(cpu_adam, "_lib", None)
    monkeypatch.setattr(cpu_adam.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install -e \.` \(or `make install`\)"):
        cpu_adam.get_num_threads()


def test_library_loads_lazily():
    code = (
        "import zenflow, zenflow.runtime.cpu_adam as c; assert c._lib is None; "
        "c.isa(); assert c._lib is not None"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_thread_count_helpers():
    assert cpu_adam.threads_from_reserved_cores(0.5, cpu_count=16) == 8
    assert cpu_adam.threads_from_reserved_cores(1.0, cpu_count=4) == 1
    assert cpu_adam.threads_from_reserved_cores(0.0, cpu_count=4) == 4
    with pytest.raises(ValueError):
        cpu_adam.threads_from_reserved_cores(1.5)
    cpu_adam.set_num_threads(3)
    assert cpu_adam.get_num_threads() == 3
    with pytest.raises(ValueError):
        cpu_adam.set_num_threads(0)
    assert cpu_adam.isa() in ISAS


def _thread_niceness() -> list[int]:
    return sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness per thread is Linux's")
def test_worker_niceness_applies_to_the_pool_threads_only():
    # In a fresh process: the pool threads it starts are the only threads that change.
    code = (
        "import os, torch\n"
        "from zenflow.runtime import cpu_adam as c\n"
        "from tests.test_cpu_adam import _thread_niceness\n"
        "c.set_num_threads(2)\n"
        "c.set_worker_nice(7)\n"
        "t = [torch.zeros(1 << 18) for _ in range(4)]\n"
        "c.adamw_step(*([x] for x in t), lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8,\n"
        "             weight_decay=0.0, steps=1)\n"
        "assert c.get_worker_nice() == 7\n"
        "assert _thread_niceness().count(7) == 2, _thread_niceness()\n"
        "assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the calling thread keeps its own\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="niceness"):
            cpu_adam.set_worker_nice(bad)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accumulate_equals_torch_add_for_every_isa(grad_dtype):
    # Sizes with vector tails of every length, and one spread over several tasks.
    numels = [1, 15, 17, 1000, 200_003]
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in numels]
    start = [torch.randn(n, generator=gen) for n in numels]
    for scale in (1.0, 0.37):
        expected = [a.clone().add_(g, alpha=scale) for a, g in zip(start, grads, strict=True)]
        for isa in _supported_isas():
            cpu_adam._force_isa_for_tests(isa)
            accs = [a.clone() for a in start]
            cpu_adam.submit_accumulate(accs, grads, scale=scale).wait()
            for acc, want in zip(accs, expected, strict=True):
                assert torch.equal(acc, want), (isa, scale, acc.numel())


def test_accumulate_runs_after_the_jobs_queued_before_it():
    # The sum must not be read by the update queued before it, nor miss the one queued after.
    cpu_adam.set_num_threads(3)
    n = 2**21
    args = _job(50, [n], torch.float32, None, True)
    args["last_grads"] = None
    grad = torch.full((n,), 2.0)
    expected = copy.deepcopy(args)
    expected["accumulators"][0] += 2.0
    _run_job(expected, True)
    accs = args["accumulators"]
    handles = [
        cpu_adam.submit_accumulate(accs, [grad]),
        cpu_adam.submit_boundary_adamw_step(**args),
        cpu_adam.submit_accumulate(accs, [grad], scale=0.5),
    ]
    for h in handles:
        h.wait()
    assert torch.equal(args["params"][0], expected["params"][0])
    assert torch.equal(accs[0], torch.ones(n))


@pytest.mark.parametrize(
    "accumulators, grads, error, match",
    [
        ([torch.zeros(8, dtype=torch.bfloat16)], [torch.zeros(8)], TypeError, "accumulators"),
        ([torch.zeros(8)], [torch.zeros(16)[::2]], ValueError, r"grads\[0\] is not contiguous"),
        ([torch.zeros(8)], [torch.zeros(9)], ValueError, r"but accumulators\[0\] has 8"),
        ([torch.zeros(8)], [], ValueError, "grads has 0 tensors for 1 accumulators"),
    ],
)
def test_accumulate_rejects_bad_arguments(accumulators, grads, error, match):
    with pytest.raises(error, match=match):
        cpu_adam.submit_accumulate(accumulators, grads)


def test_job_seconds_are_its_run_time_not_its_time_in_the_queue():
    cpu_adam.set_num_threads(1)
    cpu_adam._force_isa_for_tests("scalar")
    long_job = _job(60, [2**22], torch.float32, None, False)
    short_sum = [torch.zeros(1000)], [torch.ones(1000)]
    first = cpu_adam.submit_adamw_step(**long_job)
    second = cpu_adam.submit_accumulate(*short_sum)
    second.wait()
    assert first.done() and 0 < second.seconds() < first.seconds() / 10


def _gathered(seed, rows_kept, row_len, dtype):
    """A gradient source of 3 * rows_kept rows and a permuted subset of them, as GatheredRows
    and as the contiguous tensor they stand for."""
    gen = torch.Generator().manual_seed(seed)
    source = torch.randn(3 * rows_kept, row_len, generator=gen).to(dtype)
    index = torch.randperm(3 * rows_kept, generator=gen)[:rows_kept]
    return cpu_adam.GatheredRows(source, index), source.index_select(0, index).flatten()


@pytest.mark.parametrize("kind", ["step", "boundary", "accumulate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_rows_equal_the_rows_gathered_first(kind, dtype):
    """Rows of 37 (vector tails in every row), per-row steps that repeat (runs that would span
    rows), a tensor larger than a task (rows split across threads)."""
    row_len, row_counts = 37, [3, 2000]
    for isa in _supported_isas():
        cpu_adam._force_isa_for_tests(isa)
        cpu_adam.set_num_threads(3)
        results = []
        for gathered in (True, False):
            grads = [_gathered(7 + i, rows, row_len, dtype) for i, rows in enumerate(row_counts)]
            grads = [g if gathered else flat for g, flat in grads]
            numels = [rows * row_len for rows in row_counts]
            if kind == "accumulate":
                accs = [torch.linspace(-1, 1, n) for n in numels]
                cpu_adam.submit_accumulate(accs, grads, scale=0.37).wait()
                results.append(accs)
                continue
            args = _job(11, numels, torch.float32, torch.bfloat16, kind == "boundary")
            args["steps"] = [torch.arange(rows) // 4 + 1 for rows in row_counts]
            args["segment_len"] = row_len
            args["last_grads" if kind == "boundary" else "grads"] = grads
            results.append(_run_job(args, kind == "boundary"))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), isa


@pytest.mark.parametrize(
    "index, error, match",
    [
        (torch.tensor([0, 6]), ValueError, r"grad row index 6 \(row 1\) outside the gradient's 6"),
        (torch.tensor([0, -1]), ValueError, r"grad row index -1 \(row 1\)"),
        (torch.tensor([0, 1, 2]), ValueError, r"gathers 3 rows of 4 elements but accumulators"),
        (torch.tensor([0, 1], dtype=torch.int32), TypeError, "1-D int64 CPU tensor"),
        (torch.tensor([0, 9, 1])[::2], ValueError, r"index is not contiguous"),
    ],
)
def test_gathered_rows_reject_bad_indices(index, error, match):
    source = torch.zeros(6, 4)
    with pytest.raises(error, match=match):
        cpu_adam.submit_accumulate([torch.zeros(8)], [cpu_adam.GatheredRows(source, index)])


@pytest.fixture
def pool_settings_restored():
    saved = cpu_adam.get_num_threads(), cpu_adam.get_worker_nice(), cpu_adam.get_worker_cpus()
    yield
    cpu_adam.set_num_threads(saved[0])
    cpu_adam.set_worker_nice(saved[1])
    cpu_adam.set_worker_cpus(saved[2])


def test_a_step_uses_every_allowed_core_at_normal_priority_after_zenflow_set_the_pool(
    pool_settings_restored,
):
    weight = torch.nn.Parameter(torch.randn(8, 4))
    ZenFlowAdamW([weight], topk_ratio=0.5, update_interval=2, bind_cores=True)
    assert cpu_adam.get_worker_nice() > 0  # overlapped updates run beside training
    assert cpu_adam.get_worker_cpus() == (core_binding.place_pool(0.5, True).cpus or ())
    p = torch.nn.Parameter(torch.randn(64))
    p.grad = torch.randn(64)
    CPUAdamW([p], lr=1e-2).step()
    assert cpu_adam.get_num_threads() == cpu_adam.available_cores()
    assert cpu_adam.get_worker_nice() == 0
    assert cpu_adam.get_worker_cpus() == ()  # not pinned to the cores zenflow's pool kept


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell apart")
def test_jobs_the_training_thread_waits_for_run_where_the_ranks_place_says(
    pool_settings_restored,
):
    """An optimizer's pool: its overlapped updates on the CPUs for them, at background
    priority; a job the training thread waits for on the rank's whole share (here another
    CPU, as a rank's part of a mask shared with other ranks would be), at normal priority;
    then back."""
    first, last = sorted(os.sched_getaffinity(0))[0], sorted(os.sched_getaffinity(0))[-1]
    jobs = CPUJobs(PoolPlace(1, (last,), 1, (first,)), {})
    assert (cpu_adam.get_num_threads(), cpu_adam.get_worker_cpus()) == (1, (last,))
    assert cpu_adam.get_worker_nice() > 0
    with jobs.every_core():
        assert (cpu_adam.get_num_threads(), cpu_adam.get_worker_cpus()) == (1, (first,))
        assert cpu_adam.get_worker_nice() == 0
    assert (cpu_adam.get_num_threads(), cpu_adam.get_worker_cpus()) == (1, (last,))


def test_cores_come_from_the_affinity_mask():
    script = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "import torch, zenflow\n"
        "from zenflow.runtime import cpu_adam\n"
        "opt = zenflow.CPUAdamW([torch.nn.Parameter(torch.ones(4))])\n"
        "print(cpu_adam.available_cores(), opt.threads, cpu_adam.threads_from_reserved_cores(0))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.split() == ["1", "1", "1"], result.stderr
