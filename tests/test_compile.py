"""``axonmpi.compile``: a step recorded once and replayed is bitwise the eager step (serial, DDP, FSDP, TP at 1,
2 and 4 ranks); steps that cannot be captured run eagerly and say why; the capture decision for a GPU."""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor
from axonmpi.graphs import CaptureKind, CompiledStep, decide_capture
from axonmpi.models import GPT, GPTConfig
from axonmpi.optim import AdamW, clip_grad_norm_

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.0)
STEPS = 4


def _batches(n=STEPS, rows=4, t=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, CFG.vocab_size, (rows, t)), rng.integers(0, CFG.vocab_size, (rows, t)))
            for _ in range(n)]


def _gpt(cfg=CFG):
    axonmpi.manual_seed(3)
    return GPT(cfg, dtype=np.float64)


def _stepper(model, micro=1):
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(x, y):
        opt.zero_grad()
        rows = x.shape[0] // micro
        for k in range(micro):          # gradient accumulation: one backward pass per micro-batch
            _, loss = model(x[k * rows:(k + 1) * rows], y[k * rows:(k + 1) * rows])
            (loss * (1.0 / micro)).backward()
        clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        return loss
    return step


def _same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.tobytes() == b.tobytes(), \
        f"{what}: replay differs from eager (max |diff| {np.max(np.abs(a - b)):.3g})"


def _run_both(make_model, batches, micro=1, **compile_kw):
    m1, m2 = make_model(), make_model()
    eager, compiled = _stepper(m1, micro), axonmpi.compile(_stepper(m2, micro), **compile_kw)
    for i, (x, y) in enumerate(batches):
        _same(eager(x, y).data, compiled(x, y).data, f"loss of step {i}")
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        _same(p.data, q.data, n)
    return compiled


def test_replay_is_bitwise_eager():
    c = _run_both(_gpt, _batches())
    assert c.reason is None and c.status == "replaying"
    assert c.replays == STEPS - 2 and c.tape.replayed_passes == STEPS - 2    # 1 warm-up, 1 recorded


def test_replay_with_accumulation_and_no_warmup():
    c = _run_both(_gpt, _batches(), micro=2, warmup=0)
    assert c.reason is None and c.replays == STEPS - 1 and c.tape.replayed_passes == 2 * (STEPS - 1)


def test_replay_with_activation_checkpointing_and_hooks():
    seen = []

    def make():
        m = _gpt()
        from axonmpi.nn.checkpointing import Checkpointed
        m.blocks[0] = Checkpointed(m.blocks[0])
        m.lm_head.weight.register_hook(lambda g: seen.append(1) or g * 0.5)
        return m
    c = _run_both(make, _batches())
    assert c.reason is None and c.replays == STEPS - 2
    assert len(seen) == 2 * STEPS


def test_data_dependent_shapes_run_eagerly_and_say_why(caplog):
    batches = _batches(2) + _batches(2, t=6, seed=1)      # the last steps are shorter
    c = _run_both(_gpt, batches)
    assert c.status == "eager" and "data-dependent" in c.reason
    assert c.replays == 0        # step 2 left the record at its first op: finished eagerly


def test_control_flow_divergence_is_caught():
    m1, m2 = _gpt(), _gpt()
    flip = {"on": False}

    def make_step(model):
        inner = _stepper(model)

        def step(x, y):
            if flip["on"]:
                x = x[:, ::-1].copy()
            return inner(x, y)
        return step
    e, c = make_step(m1), axonmpi.compile(make_step(m2))
    for i, (x, y) in enumerate(_batches(5)):
        flip["on"] = i == 3                       # same shapes, same ops: replay stays exact
        _same(e(x, y).data, c(x, y).data, f"step {i}")
    assert c.reason is None and c.replays == 3


def test_graph_carried_over_from_an_earlier_step_is_refused():
    m = _gpt()
    w = m.lm_head.weight
    carried = {"t": w * 1.0}       # made outside the step: its graph is not the step's

    def step(x, y):
        m.zero_grad()
        _, loss = m(x, y)
        (loss + carried["t"].sum() * 0.0).backward(retain_graph=True)
        return loss
    c = axonmpi.compile(step, warmup=0)
    for x, y in _batches(2):
        c(x, y)
    assert c.status == "eager" and "before the step" in c.reason


def test_compile_api():
    m = _gpt()
    assert axonmpi.compile(m) is m                   # nanoGPT's model = torch.compile(model)
    assert isinstance(axonmpi.compile(mode="reduce-overhead")(lambda: 1), CompiledStep)
    with pytest.raises(NotImplementedError, match="max-autotune"):
        axonmpi.compile(lambda: 1, mode="max-autotune")
    with pytest.raises(ValueError, match="warmup"):
        axonmpi.compile(lambda: 1, warmup=-1)
    with pytest.raises(TypeError, match="callable"):
        CompiledStep(3)
    c = axonmpi.compile(lambda a: a + 1, warmup=1)
    assert [c(1), c(2), c(3)] == [2, 3, 4] and c.reason is None     # no autograd at all: nothing to replay


def test_no_host_syncs_in_a_captured_step():
    """Embedding ids, cross-entropy targets and its mean divisor are checked by array ops in a captured step: the
    step reads no array value into Python; the loss is read when logged.  (Clipping still reads its norm:
    clip_grad_norm_ returns a float.)"""
    from axonmpi.graphs.count import CountedArray, counting
    m = _gpt()
    opt = AdamW(m.parameters(), lr=1e-2)

    def step(x, y):
        opt.zero_grad()
        _, loss = m(x, y)
        loss.backward()
        opt.step()
        return loss
    c = axonmpi.compile(step)
    x, y = _batches(1)[0]
    c(x, y)
    c(x, y)
    with counting(m, opt) as k:
        step(x.view(CountedArray), y.view(CountedArray))
        assert k.host_syncs >= 3, dict(k.syncs)          # eager: the host checks read values
        k.reset()
        loss = c(x.view(CountedArray), y.view(CountedArray))
        assert k.host_syncs == 0 and k.total > 100, dict(k.syncs)
        float(loss.data)                                  # logging the loss: the one read
        assert dict(k.syncs) == {"float": 1}
    assert c.replays == 1 and c.reason is None


def test_out_of_range_ids_in_a_captured_step_give_nan():
    m = _gpt()
    c = axonmpi.compile(_stepper(m))
    for x, y in _batches(2):
        c(x, y)
    x, y = _batches(1, seed=5)[0]
    y[0, 0] = -1                     # would wrap around as a NumPy index
    assert np.isnan(c(x, y).item()) and c.replays == 1
    x[0, 0] = CFG.vocab_size         # past the table
    with pytest.raises(IndexError, match="out of range"):
        m(x, y % CFG.vocab_size)     # eager: the host check names it


class _FakePipelined:
    pipeline, _stages = object(), ()

    def step(self, x, y):
        return 0.0


def test_capture_decision():
    assert decide_capture(lambda: 0).kind is CaptureKind.STATIC
    d = decide_capture(_FakePipelined().step)
    assert d.kind is CaptureKind.EAGER and "pipeline" in d.reason
    c = axonmpi.compile(_FakePipelined().step, warmup=0)
    assert c(1, 2) == 0.0 and c.status == "eager" and "pipeline" in c.reason
    assert decide_capture(lambda: 0, device_type="cuda").kind is CaptureKind.EAGER        # no stream capture
    assert decide_capture(lambda: 0, device_type="cuda", cuda_graph=False).kind is CaptureKind.STATIC
    d = decide_capture(lambda: 0, device_type="cuda", cupy_graphs=True, collective_backends=["nccl", "mpi"])
    assert d.kind is CaptureKind.EAGER and "MPI" in d.reason
    d = decide_capture(lambda: 0, device_type="cuda", cupy_graphs=True, host_scalars=["AdamW step count"])
    assert d.kind is CaptureKind.EAGER and "AdamW step count" in d.reason
    assert decide_capture(lambda: 0, device_type="cuda", cupy_graphs=True,
                          collective_backends=["nccl"]).kind is CaptureKind.CUDA_GRAPH
    with pytest.raises(ValueError, match="device_type"):
        decide_capture(lambda: 0, device_type="tpu")


def test_cuda_graph_module_imports_without_cupy():
    from axonmpi.graphs import cuda
    if axonmpi.backend.get_cupy() is None:
        assert not cuda.cupy_can_capture()
        with pytest.raises(cuda.CaptureFailed, match="CuPy"):
            cuda.CudaGraphStep(lambda: 0)()


# -- under every data layout at 1, 2 and 4 ranks -----------------------------------------------------------

LAYOUTS = {"ddp": dict(data_parallel="ddp"), "fsdp": dict(data_parallel="fsdp"),
           "tp": dict(tensor_parallel="megatron", data_parallel=None)}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replay_is_bitwise_eager_under_layouts(world, layout):
    from axonmpi.parallel import parallelize
    from axonmpi.recipes.gpt import gpt_model_plan, gpt_plan
    n = world.world_size
    if n not in (1, 2, 4):
        pytest.skip("1, 2 or 4 ranks (heads and rows divide)")
    kw = dict(LAYOUTS[layout])
    sizes = {"G_intra_c": n} if layout == "tp" else {"G_data": n}
    if kw.get("tensor_parallel") == "megatron":
        kw.update(tensor_parallel=gpt_plan(CFG), model_plan=gpt_model_plan(CFG))
    grid = axonmpi.ProcessGrid(world, **sizes)
    try:
        pms = [parallelize(_gpt(), grid=grid, **kw) for _ in range(2)]
        steps = [_stepper(pms[0]), axonmpi.compile(_stepper(pms[1]))]
        for i, (x, y) in enumerate(_batches(rows=4)):
            xb, yb = pms[0].local_batch(x, y)
            _same(steps[0](xb, yb).data, steps[1](xb, yb).data, f"{layout} loss of step {i}")
        for (k, p), (_, q) in zip(pms[0].named_parameters(), pms[1].named_parameters()):
            _same(p.data, q.data, f"{layout} {k}")
        assert steps[1].reason is None and steps[1].replays == STEPS - 2, steps[1].reason
    finally:
        grid.free()
