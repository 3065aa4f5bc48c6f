"""The same Hugging Face GPT-2 weights in a tensor-parallel or pipeline layout give the serial logits.

Weights under GPT-2's names (``transformer.h.{i}.attn.c_attn.weight`` ..., Conv1D (in, out), tied
``lm_head``) come from ``GPT.to_hf_gpt2()`` of a randomised GPT (no torch needed), or from
transformers' ``GPT2LMHeadModel`` built from a small random ``GPT2Config`` (skips without
torch/transformers). ``GPT.from_hf_gpt2`` loads them into the serial model, then into each layout:
``parallelize(tensor_parallel="axonn")`` (AxoNN 3-D, easy mode), ``parallelize`` with the recipe's Megatron plan
(1-D, vocabulary split),
and ``HybridGPT`` (Megatron, AxoNN, pipeline) through ``load_full_state_dict``. Logits agree to
1e-10 relative in float64; against transformers' own logits too.
"""
import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor
from axonmpi.models import GPT, GPTConfig
from axonmpi.parallel import parallelize
from axonmpi.recipes import HybridGPT
from axonmpi.recipes.gpt import gpt_plan

TOL = 1e-10
V, T, B, H = 64, 8, 12, 4         # vocabulary, context, batch, heads: width 32 and 64 tokens split over 1, 2, 4


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shapes {got.shape} vs {want.shape}"
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300)
    assert err <= TOL, f"{what}: relative error {err:.3g} > {TOL}"


def _hf_weights(source):
    """(GPT-2 state dict of float64 NumPy arrays, transformers' logits function or None)."""
    if source == "transformers":
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=4, n_head=H,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        hf = transformers.GPT2LMHeadModel(cfg).double().eval()
        with torch.no_grad():          # HF zero-initialises biases and LayerNorm: randomise every mapping
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p))

        def logits(x):
            with torch.no_grad():
                return hf(torch.from_numpy(np.asarray(x))).logits.numpy()
        return {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}, logits
    axonmpi.manual_seed(7)
    gpt = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=4, n_head=H, n_embd=32, tie_word_embeddings=True),
              dtype=np.float64)
    rng = np.random.default_rng(1)
    sd = {k: v + 0.05 * rng.standard_normal(v.shape) for k, v in gpt.to_hf_gpt2().items()}
    # GPT-2 ties the head to wte; "untied": a head of its own (from_hf_gpt2 then builds an untied GPT)
    sd["lm_head.weight"] = sd["transformer.wte.weight"] + (0.05 if source == "untied" else 0.0)
    return sd, None


def _tokens():
    return np.random.default_rng(2).integers(0, V, (B, T))


def _targets():
    return np.random.default_rng(3).integers(0, V, (B, T))


def _serial(sd, x):
    gpt = GPT.from_hf_gpt2(sd, n_head=H)
    assert gpt.wte.weight.data.dtype == np.float64
    with axonmpi.no_grad():
        return gpt, gpt(Tensor(x))[0].numpy()


def _serial_grads(sd, x, y):
    """The serial loss over the global batch and its gradients of the (tied) embedding and of wpe."""
    gpt = GPT.from_hf_gpt2(sd, n_head=H)
    _, loss = gpt(Tensor(x), y)
    loss.backward()
    return float(loss.item()), gpt.wte.weight.grad.numpy(), gpt.wpe.weight.grad.numpy()


def _divides(p, *sizes):
    return all(s % p == 0 for s in sizes)


LAYOUTS = ["parallelize_axonn_col", "parallelize_axonn_row_depth", "parallelize_megatron",
           "hybrid_megatron", "hybrid_axonn", "hybrid_pipeline"]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("source", ["to_hf_gpt2", "untied", "transformers"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_gpt2_weights_give_the_serial_logits_in_every_layout(world, source, layout):
    p = world.world_size
    sd, hf_logits = _hf_weights(source)
    x = _tokens()
    serial, want = _serial(sd, x)
    tied = serial.config.tie_word_embeddings
    assert tied == (source != "untied")
    if hf_logits is not None:
        _close(want, hf_logits(x), "serial GPT vs transformers")
    y = _targets()
    loss_ref, wte_grad, wpe_grad = _serial_grads(sd, x, y)
    grid = None
    try:
        if layout == "parallelize_axonn_col":
            grid = axonmpi.ProcessGrid(world, G_intra_c=p)
        elif layout == "parallelize_axonn_row_depth":
            if p != 4:
                pytest.skip("a 2 row x 2 depth block needs 4 ranks")
            grid = axonmpi.ProcessGrid(world, G_intra_r=2, G_intra_d=2)
        elif layout in ("hybrid_megatron", "hybrid_axonn"):
            if not _divides(p, H, V, 32, B):
                pytest.skip(f"heads, vocabulary and width do not split over {p} ranks")
            grid = axonmpi.ProcessGrid(world, G_intra_c=p)
        elif layout == "hybrid_pipeline":
            if p > 4 or B % 2:
                pytest.skip("4 blocks make at most 4 stages")
            grid = axonmpi.ProcessGrid(world, G_inter=p)

        if p == 1 and layout in ("hybrid_axonn", "hybrid_pipeline"):
            pytest.skip("on 1 rank HybridGPT has neither tensor nor pipeline parallelism")
        if layout.startswith("parallelize_axonn"):
            pm = parallelize(GPT.from_hf_gpt2(sd, n_head=H), grid=grid, tensor_parallel="axonn", data_parallel=None)
            model = pm.inner
            assert (model.lm_head.weight is model.wte.weight) == tied     # a tied head stays whole and tied
            xb, yb = pm.local_batch(x, y)     # easy mode: each rank of the tensor block reads its own rows
            with axonmpi.no_grad():
                got = pm(Tensor(xb))[0].numpy()
                ref = serial(Tensor(xb))[0].numpy()
            _close(got, ref, f"{layout} rank {world.rank}")
            _, loss = pm(Tensor(xb), yb)
            loss.backward()                   # the hooks sum over the tensor block, / number of batch shards
            _close(model.wte.weight.grad.numpy(), wte_grad, f"{layout} wte gradient")
            _close(model.wpe.weight.grad.numpy(), wpe_grad, f"{layout} wpe gradient")
        elif layout == "parallelize_megatron":
            if not _divides(p, H, V):
                pytest.skip(f"heads and vocabulary do not split over {p} ranks")
            grid = axonmpi.ProcessGrid(world, G_intra_c=p)
            gpt = GPT.from_hf_gpt2(sd, n_head=H)
            pm = parallelize(gpt, grid=grid, tensor_parallel=gpt_plan(gpt.config, sequence_parallel=True),
                             data_parallel=None)    # wte and lm_head split over the vocabulary (tied: one Parameter)
            model = pm.inner
            assert (model.lm_head.weight is model.wte.weight) == tied
            with axonmpi.no_grad():
                got = pm(Tensor(x))[0].numpy()
            _close(got, want, f"{layout} rank {world.rank}")
            _, loss = pm(Tensor(x), y)
            loss.backward()
            _close(float(loss.item()), loss_ref, f"{layout} loss")
            rows = axonmpi.all_gather(model.wte.weight.grad.numpy())       # vocabulary rows in rank order
            _close(rows, wte_grad, f"{layout} wte gradient")
        elif layout in ("hybrid_megatron", "hybrid_axonn"):
            style = layout.split("_")[1]
            hyb = HybridGPT(serial.config, grid, tp_style=style, dtype="float64", global_batch=B)
            hyb.load_full_state_dict(serial.state_dict())
            xb, yb = hyb.local_batch(x), hyb.local_batch(y)
            with axonmpi.no_grad():
                got = hyb.model(Tensor(xb))[0].numpy()
                ref = serial(Tensor(xb))[0].numpy()
            _close(got, ref, f"{layout} rank {world.rank}")
            _close(hyb.forward_backward(xb, yb), loss_ref, f"{layout} loss")
            _close(hyb.full_state_dict()["wte.weight"], serial.state_dict()["wte.weight"], f"{layout} wte")
        else:
            hyb = HybridGPT(serial.config, grid, schedule="1f1b", num_microbatches=2, dtype="float64",
                            global_batch=B)
            hyb.load_full_state_dict(serial.state_dict())
            got = hyb.pipe.eval_step(x)          # the last stage's logits, None on the other ranks
            if grid.coords.inter == p - 1:
                _close(got, want, f"{layout} (last stage)")
            else:
                assert got is None
            _close(hyb.eval_loss(x, y), loss_ref, f"{layout} loss")
    finally:
        if grid is not None:
            grid.free()
