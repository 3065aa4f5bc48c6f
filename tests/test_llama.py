"""``axonmpi.models.Llama``: config, names, gradients, the Hugging Face directory both ways without
transformers, and ``axonmpi ckpt export --format hf-llama`` from checkpoints saved by the serial model and
under 2-rank layouts (DDP, Megatron TP through ``parallelize``): the exported directory gives the serial
logits (1e-12 through ``from_hf``; with transformers installed, ``LlamaForCausalLM.from_pretrained`` too,
to 1e-6: transformers keeps RMSNorm and the rotary tables in float32 even in float64, see
``test_llama_interop.py``).
"""
import json
import os

import numpy as np
import pytest

import axonmpi
from axonmpi import Tensor, checkpoint
from axonmpi.autograd import gradcheck
from axonmpi.checkpoint import cli as ckpt_cli
from axonmpi.interop import EXPORT_FORMATS
from axonmpi.models import Llama, LlamaConfig
from axonmpi.models.llama import llama_hidden_size

V, T = 40, 6
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
          "original_max_position_embeddings": 8}
PLAN = {"*.q_proj": "column", "*.k_proj": "column", "*.v_proj": "column", "*.o_proj": "row",
        "*.gate_proj": "column", "*.up_proj": "column", "*.down_proj": "row",
        "model.embed_tokens": "vocab", "lm_head": "column_gather"}


def _config(tied=False, **kw):
    base = dict(vocab_size=V, n_embd=16, n_layer=2, n_head=4, n_kv_head=2, intermediate_size=24, block_size=16,
                rope_theta=100.0, rope_scaling=LLAMA3, rms_norm_eps=1e-5, tie_word_embeddings=tied)
    return LlamaConfig(**{**base, **kw})


def _llama(tied=False, dtype=np.float64, seed=3, **kw):
    axonmpi.manual_seed(seed)
    model = Llama(_config(tied, **kw), dtype=dtype)
    rng = np.random.default_rng(seed)
    with axonmpi.no_grad():       # norms start at one: move every weight so every mapping shows
        for p in model.parameters():
            p.data[...] += (0.05 * rng.standard_normal(p.shape)).astype(p.data.dtype)
    return model


def _idx(seed=1):
    return np.random.default_rng(seed).integers(0, V, (2, T))


def _logits(model, x):
    with axonmpi.no_grad():
        return model(x)[0].numpy()


def _close(got, want, tol, what):
    err = np.max(np.abs(np.asarray(got) - np.asarray(want))) / max(1.0, np.max(np.abs(want)))
    assert err <= tol, f"{what}: relative difference {err:.3g} > {tol}"


# -- the model ----------------------------------------------------------------------------------

@pytest.mark.serial
def test_config_defaults_and_validation():
    c = LlamaConfig(vocab_size=32000, n_embd=4096, n_layer=32, n_head=32)
    assert (c.n_kv_head, c.head_dim, c.intermediate_size) == (32, 128, 11008)      # Llama 2 7B
    assert llama_hidden_size(4096, 1024, 1.3) == 14336                               # Llama 3 8B
    assert LlamaConfig.from_dict(c.to_dict()) == c and hash(LlamaConfig.from_dict(c.to_dict())) == hash(c)
    assert _config().rope_scaling == LLAMA3
    with pytest.raises(ValueError, match="n_kv_head=3 must be a positive int dividing n_head=4"):
        _config(n_kv_head=3)
    with pytest.raises(ValueError, match="head_dim must be a positive even int"):
        _config(head_dim=5)
    with pytest.raises(NotImplementedError, match="'dynamic'"):
        _config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="unknown fields"):
        LlamaConfig.from_dict({**c.to_dict(), "n_heads": 4})
    with pytest.raises(ValueError, match="exceeds block_size"):
        _llama()(np.zeros((1, 17), np.int64))


@pytest.mark.serial
def test_names_are_transformers_and_the_tie_is_one_parameter():
    model = _llama(tied=True)
    names = list(model.state_dict())
    layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    assert names == (["model.embed_tokens.weight"] + [f"model.layers.{i}.{n}.weight" for i in range(2) for n in layer]
                     + ["model.norm.weight", "lm_head.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (8, 16)          # 2 kv heads of width 4
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    # a different sequence order changes nothing in the model: the same logits for the same tokens
    x = _idx()
    _close(_logits(model, x[::-1])[::-1], _logits(model, x), 1e-14, "batch order")


@pytest.mark.serial
def test_gradcheck_through_the_whole_model():
    model = _llama(n_layer=1, intermediate_size=8)
    x, y = _idx(), _idx(2)
    w = [model.model.layers[0].self_attn.k_proj.weight, model.model.layers[0].input_layernorm.weight,
         model.model.embed_tokens.weight]
    assert gradcheck(lambda *a: model(x, y)[1], w, max_entries=25)


@pytest.mark.serial
def test_positions_are_global_token_positions():
    """The last 3 tokens fed with their positions see the first 3 only through... nothing: causal attention
    over the fed tokens; with positions 3..5 the rotary tables are those of the full sequence's tokens."""
    model = _llama()
    x = _idx()
    full = _logits(model, x)
    with axonmpi.no_grad():
        # one token alone at position p gives what the full sequence gives at position p when p == 0
        _close(model(x[:, :1], positions=np.array([0]))[0].numpy(), full[:, :1], 1e-13, "first token")
        shifted = model(x, positions=np.arange(5, 5 + T))[0].numpy()
    _close(shifted, full, 1e-10, "rotary attention is relative: all positions shifted by 5")
    with pytest.raises(ValueError, match="positions of shape"):
        model(x, positions=np.arange(T + 1))


# -- the Hugging Face directory without transformers -----------------------------------------------

@pytest.mark.serial
@pytest.mark.parametrize("tied", [False, True])
def test_save_hf_round_trip_and_config(tmp_path, tied):
    model = _llama(tied, dtype=np.float32)
    written = model.save_hf(tmp_path, max_shard_size=4000)          # small: HF shards + index
    assert any(p.endswith("model.safetensors.index.json") for p in written)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg == model.hf_config()
    want = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 4, "hidden_act": "silu", "max_position_embeddings": 16, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": tied, "rope_theta": 100.0, "rope_scaling": LLAMA3, "dtype": "float32",
            "rope_parameters": {**LLAMA3, "rope_theta": 100.0}}
    assert {k: cfg[k] for k in want} == want
    stored = axonmpi.checkpoint.load_safetensors(tmp_path)
    assert ("lm_head.weight" in stored) == (not tied)          # save_pretrained stores a tied head once
    back = Llama.from_hf(str(tmp_path))
    assert back.config == model.config
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied
    for config in (model.config, model.config.to_dict(), cfg):      # a state dict and any form of the config
        assert Llama.from_hf(model.to_hf(), config).config == model.config
    x = _idx()
    _close(_logits(back, x), _logits(model, x), 0.0, "from_hf(save_hf) logits")


@pytest.mark.serial
def test_from_hf_reads_transformers_4_configs_and_refuses_what_it_cannot_compute(tmp_path):
    model = _llama(dtype=np.float32)
    model.save_hf(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "head_dim")}     # a transformers 4 config
    path.write_text(json.dumps(old))
    assert Llama.from_hf(str(tmp_path)).config == model.config
    for bad, match, err in [({"hidden_act": "gelu"}, "hidden_act='gelu'", ValueError),
                            ({"model_type": "mistral"}, "not 'llama'", ValueError),
                            ({"rope_parameters": {**LLAMA3, "rope_theta": 7.0}}, "rope_theta=100.0 and", ValueError),
                            ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "'yarn'", NotImplementedError),
                            ({"rope_scaling": {**LLAMA3, "partial_rotary_factor": 0.5}}, "partial_rotary", NotImplementedError)]:
        path.write_text(json.dumps({**old, **bad}))
        with pytest.raises(err, match=match):
            Llama.from_hf(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Llama.from_hf(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="file name"):
        model.save_hf(str(tmp_path / "x.safetensors"))


@pytest.mark.serial
def test_save_hf_bf16(tmp_path):
    model = _llama(dtype=np.float32)
    model.save_hf(tmp_path, dtype="bf16")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    back = Llama.from_hf(str(tmp_path))
    assert back.model.embed_tokens.weight.dtype == np.float32
    w, b = model.model.embed_tokens.weight.numpy(), back.model.embed_tokens.weight.numpy()
    assert np.max(np.abs(w - b)) <= 2 ** -8 * np.max(np.abs(w))


# -- ckpt export --format hf-llama -------------------------------------------------------------------

def _hf_logits(directory, x):
    try:
        import torch
        import transformers
    except ImportError:
        return None
    hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return hf(torch.from_numpy(x)).logits.numpy()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("layout", ["serial", "ddp", "megatron"])
def test_ckpt_export_hf_llama_from_any_layout(world, tmp_path_factory, layout, tied):
    from axonmpi.optim import AdamW
    from axonmpi.parallel import parallelize
    p = world.world_size
    if layout != "serial" and p != 2:
        pytest.skip("the layouts are saved at 2 ranks")
    serial = _llama(tied)
    root = axonmpi.broadcast_object(str(tmp_path_factory.mktemp("llamaexp")) if world.rank == 0 else None)
    extra = {"config": serial.config.to_dict()}
    grid = None
    try:
        if layout == "serial":
            checkpoint.save(root + "/ck", {"model": serial.state_dict(), "extra": extra})
        else:
            grid = axonmpi.ProcessGrid(world, **({"G_intra_c": 2} if layout == "megatron" else {}))
            pm = parallelize(_llama(tied), grid=grid, tensor_parallel=PLAN if layout == "megatron" else None,
                             data_parallel="ddp")
            opt = AdamW(pm.parameters(), lr=1e-3)
            checkpoint.save(root + "/ck", checkpoint.training_state(pm, opt, step=1, extra=extra,
                                                                    group=world.default_group))
        axonmpi.barrier()
        if world.rank == 0:
            ckpt_cli.main(["export", root + "/ck", root + "/hf", "--format", "hf-llama"], formats=EXPORT_FORMATS)
            back = Llama.from_hf(root + "/hf")
            assert back.config == serial.config
            x = _idx()
            _close(_logits(back, x), _logits(serial, x), 1e-12, f"{layout}: exported logits")
            theirs = _hf_logits(root + "/hf", x)
            if theirs is not None:
                _close(theirs, _logits(serial, x), 1e-6, f"{layout}: from_pretrained logits")
        axonmpi.barrier()
    finally:
        if grid is not None:
            grid.free()


@pytest.mark.serial
def test_ckpt_export_hf_llama_needs_the_config(tmp_path, capsys):
    model = _llama()
    checkpoint.save(str(tmp_path / "ck"), {"model": model.state_dict()})
    with pytest.raises(ValueError, match="does not record the Llama's config"):
        ckpt_cli.export(str(tmp_path / "ck"), str(tmp_path / "hf"), "hf-llama", formats=EXPORT_FORMATS)
    (tmp_path / "cfg.json").write_text(json.dumps(model.config.to_dict()))
    (tmp_path / "hfcfg.json").write_text(json.dumps(model.hf_config()))
    x = _idx()
    for cfg in ("cfg.json", "hfcfg.json"):       # LlamaConfig.to_dict() or a transformers config.json
        out = str(tmp_path / f"hf-{cfg}")
        ckpt_cli.export(str(tmp_path / "ck"), out, "hf-llama", formats=EXPORT_FORMATS, config=str(tmp_path / cfg))
        _close(_logits(Llama.from_hf(out), x), _logits(model, x), 1e-12, f"--config {cfg}")
    with pytest.raises(ValueError, match="--n-head is read by --format hf-gpt2"):
        ckpt_cli.export(str(tmp_path / "ck"), str(tmp_path / "o"), "hf-llama", formats=EXPORT_FORMATS, n_head=4)
    with pytest.raises(ValueError, match="come with the `axonmpi` command"):
        ckpt_cli.export(str(tmp_path / "ck"), str(tmp_path / "o"), "hf-llama")
    # the axonmpi command knows the format
    from axonmpi.cli import main
    assert main(["ckpt", "export", str(tmp_path / "ck"), str(tmp_path / "cmd"), "--format", "hf-llama",
                 "--config", str(tmp_path / "cfg.json")]) == 0
    assert os.path.isfile(tmp_path / "cmd" / "config.json")
