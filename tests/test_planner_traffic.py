"""The planner's bytes per group (``axonmpi.planner.traffic.group_bytes``) against closed forms written out here.

Pure Python, one rank: the values are those ``bench/nd_layouts.py`` measures on 8 ranks for the same GPT
(4 layers, width 64, 4 heads, sequence 64, vocabulary 96, untied head, global batch 16, float32, a
tensor-parallel plan of the blocks only) where the runtime does what the planner models (see the table in
docs/parallelize.md, "Speed and bytes")."""
import pytest

from axonmpi.planner import ParallelLayout, TrainConfig, TransformerConfig
from axonmpi.planner.traffic import GROUP_NAMES, group_bytes, pipeline_transfers

CFG = TransformerConfig(layers=4, width=64, heads=4, seq=64, vocab=96, tied=False)
H, F, S, V, E = 64, 256, 64, 96, 4                    # width, MLP width, sequence, vocabulary, bytes an element


def block(t):
    """One block's parameters on a rank of a Megatron split ``t``: split weights and column biases, whole
    LayerNorms (4 h) and row biases (2 h)."""
    return (4 * H * H + 2 * H * F + 3 * H + F) / t + 6 * H


def run(text, batch=16, m=1, embeddings="replicated"):
    lay = ParallelLayout.parse(text)
    return group_bytes(CFG, TrainConfig(global_batch=batch, micro_batch=batch // (lay.dp * m), precision="fp32"),
                       lay, embeddings=embeddings)


@pytest.mark.serial
def test_schedule_transfers_are_the_schedules_sends_and_receives():
    assert pipeline_transfers("1f1b", 2, 4) == 8             # one neighbour: 4 activations out, 4 gradients in
    assert pipeline_transfers("1f1b", 4, 4) == 16            # a middle stage: two neighbours
    assert pipeline_transfers("zb-h1", 2, 4) == 8
    assert pipeline_transfers("zbv", 2, 4) == 16             # two chunks, each with one remote neighbour
    assert pipeline_transfers("interleaved", 2, 4, 2) == 24  # rank 0: chunks 0 and 2, three remote boundaries


@pytest.mark.serial
def test_dp_pp_tp_closed_form():
    """dp 2 x pp 2 x tp 2, 1F1B, 2 micro-batches of 4 sequences: n = 256 tokens a micro-batch."""
    got = run("tp=2,pp=2,dp=2", m=2)
    act = 256 * H * E
    assert got["tensor"] == 2 * 2 * 4 * act + (4 / 2) * act   # 2 blocks x 2 mb x 4 all-reduces; scatter/gather's
    assert got["pipeline"] == 4 * act / 2                      # 4 transfers of half the activation
    first = 2 * block(2) + V * H + S * H                       # word + position embeddings on stage 0
    last = 2 * block(2) + 2 * H + V * H                        # final LayerNorm + head on stage 1
    assert got["data"] == max(first, last) * E == 242432      # DDP all-reduce
    assert got["context"] == got["expert"] == 0


@pytest.mark.serial
def test_context_parallel_closed_forms():
    """dp 2 x tp 2 x cp 2: n = 8 sequences x 32 tokens = 256 on each rank."""
    act = 256 * H * E
    kv = 2 * act / 2                                            # K and V of the rank's heads (h / t)
    ring = run("tp=2,cp=2,dp=2")
    assert ring["context"] == 4 * 2 * ((2 - 1) + (2 * 2 - 1)) * kv     # 4 blocks, sent + received: 1 + 3 hops
    assert ring["tensor"] == 4 * 4 * act
    whole = 4 * block(2) + V * H + S * H + 2 * H + V * H
    assert ring["data"] == whole * E                            # all-reduced over data x context
    uly = run("tp=2,cp=2,dp=2,cp_kind=ulysses")
    assert uly["context"] == 4 * 8 * act / 2                    # q, k, v, output each way, the rank's h / t
    fsdp = run("tp=2,cp=2,dp=2,zero=3")
    assert fsdp["data"] == 3 * whole * E                        # gather forward and backward, reduce-scatter


@pytest.mark.serial
def test_fsdp_per_micro_batch_without_a_pipeline_once_with_one():
    whole = 4 * block(1) + V * H + S * H + 2 * H + V * H
    assert run("dp=8,zero=3")["data"] == 3 * whole * E
    assert run("dp=8,zero=1")["data"] == 2 * whole * E
    assert run("dp=8,zero=2")["data"] == 2 * whole * E                 # gathered once, kept for the backward
    assert run("dp=8,zero=3,shard=4")["data"] == (3 + 1 / 4) * whole * E   # + the shard's all-reduce over 2 replicas
    piped = run("tp=2,pp=2,dp=2,zero=3", m=2)
    assert piped["data"] == 2 * (2 * block(2) + V * H + S * H) * E     # one gather and one reduce-scatter a step


@pytest.mark.serial
def test_sequence_parallel_and_vocab_parallel_ends():
    """tp 2 with SP and Megatron's vocab-parallel embedding and head, dp 4: n = 4 x 64 = 256."""
    act = 256 * H * E
    got = run("tp=2,sp=1,dp=4", embeddings="vocab")
    ends = (1 + 2) * act                        # embedding's reduce-scatter; head's all-gather and reduce-scatter
    assert got["tensor"] == 4 * 8 * act + ends + 3 * 256 * 4 + 4 * 6 * H * E + 2 * H * E
    assert got["data"] == (4 * block(2) + V * H / 2 + S * H + 2 * H + V * H / 2) * E


@pytest.mark.serial
def test_zbv_keeps_both_ends_on_rank_zero():
    got = run("tp=2,pp=2,dp=2,schedule=zbv", m=2)
    assert got["data"] == (2 * block(2) + V * H + S * H + 2 * H + V * H) * E
    assert got["pipeline"] == pipeline_transfers("zbv", 2, 2) * 256 * H * E / 2


@pytest.mark.serial
def test_every_group_is_reported():
    got = run("dp=8")
    assert set(got) == set(GROUP_NAMES)
    with pytest.raises(ValueError, match="embeddings"):
        run("dp=8", embeddings="tied")
