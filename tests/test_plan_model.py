"""The planner's cost model (axonmpi/planner/) against the published runs, and the `plan` command's JSON contract.

Pure Python: no MPI, no processes (the CLI runs in process)."""
import json

import pytest

from axonmpi.planner import (FITTED, FITTED_ON, ParallelLayout, TrainConfig, TransformerConfig, estimate_layout,
                             hardware_names, load_hardware)
from axonmpi.planner.pipeline import bubble_and_peak
from axonmpi.planner.published import KORTHIKANTI, TABLE1, TABLE2, compare, memory_compare, summary, winners

A100 = load_hardware("dgx-a100")


@pytest.mark.serial
def test_fitted_on_table1_within_5_10_held_out_within_10_20_and_the_published_winners():
    """Issue 43's targets: fitted rows mean <= 5%, worst <= 10%; every held-out row (Korthikanti 2022, Megatron
    2021 Table 2 with its ZeRO-3 rows) mean <= 10%, worst <= 20%; the published winner of ZeRO-3 against tensor x
    pipeline x data at each GPU count; the ranking of each sweep preserved (Spearman >= 0.9)."""
    assert FITTED_ON == tuple(r.label for r in TABLE1)           # fitted on Table 1 only
    for rows, mean, worst in ((TABLE1, 0.05, 0.10), (KORTHIKANTI, 0.10, 0.20), (TABLE2, 0.10, 0.20)):
        res = compare(rows)
        s = summary(res)
        assert s["mean"] <= mean and s["worst"] <= worst and s["spearman"] >= 0.9, \
            [(r["row"], round(r["error"], 3)) for r in res]
    for model in ("175B", "530B"):
        assert summary(compare([r for r in TABLE2 if r.label.startswith(model)]))["spearman"] >= 0.9
    w = winners(TABLE2)
    assert len(w) == 5 and all(x["agree"] for x in w), w
    # ZeRO-3 stops getting faster at a fixed batch once its gathers through the network cards outlast compute
    z = {r["row"]: r["predicted_s"] for r in compare(TABLE2) if "ZeRO-3" in r["row"]}
    assert z["175B ZeRO-3 1536"] > 0.9 * z["175B ZeRO-3 768"]
    mem = memory_compare()
    assert len(mem) == 12 and max(abs(m["error"]) for m in mem) <= 0.10, mem


@pytest.mark.serial
def test_the_plan_command_json_contract(capsys):
    from axonmpi.cli import main
    args = ["plan", "--json", "--hardware", "dgx-a100", "--layers", "96", "--width", "12288", "--heads", "96",
            "--seq", "2048", "--vocab", "51200", "--global-batch", "1536", "--micro-batch", "1", "--world", "1536",
            "--precision", "fp16", "--recompute", "full"]
    assert main(args + ["--layout", "tp=8,pp=12,dp=16,vp=2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["layouts"] and len(out["layouts"]) == 1
    e = out["layouts"][0]
    assert {"layout", "step_time_s", "memory_gib", "tflops_per_gpu", "breakdown"} <= set(e)
    assert e["layout"]["tp"] == 8 and e["layout"]["pp"] == 12 and e["layout"]["vp"] == 2
    assert e["layout"]["schedule"] == "interleaved" and 5 < e["step_time_s"] < 60 and 0 < e["memory_gib"] < 80
    assert 100 < e["tflops_per_gpu"] < 250 and e["breakdown"]["bubble_s"] > 0
    for extra in ("sp=1,zero=1", "schedule=zb-h1", "schedule=zbv", "zero=3"):
        assert main(args + ["--layout", "tp=8,pp=12,dp=16," + extra]) == 0
        assert json.loads(capsys.readouterr().out)["layouts"][0]["step_time_s"] > 0
    assert main(args + ["--layout", "row=2,col=2,depth=2,pp=12,dp=16"]) == 0
    assert json.loads(capsys.readouterr().out)["layouts"][0]["layout"]["depth"] == 2
    # without --layout: every feasible layout, fastest first, within the memory limit (small model: quick)
    small = ["plan", "--json", "--hardware", "dgx-a100", "--layers", "24", "--width", "2304", "--heads", "24",
             "--seq", "2048", "--vocab", "51200", "--global-batch", "512", "--micro-batch", "16", "--world", "32",
             "--recompute", "full", "--memory-gib", "80"]
    assert main(small) == 0
    lays = json.loads(capsys.readouterr().out)["layouts"]
    times = [x["step_time_s"] for x in lays]
    assert len(lays) > 10 and times == sorted(times) and max(x["memory_gib"] for x in lays) <= 80
    assert main(small[:1] + small[2:] + ["--top", "3"]) == 0          # the table
    text = capsys.readouterr().out
    assert "step s" in text and "TF/s" in text and len(text.splitlines()) == 6       # + the kernels-assumed line
    assert text.splitlines()[-1].startswith("kernels assumed"), text


@pytest.mark.serial
def test_errors_name_the_value_and_the_fix(capsys):
    cfg = TransformerConfig(layers=8, width=1024, heads=16, seq=1024)
    train = TrainConfig(global_batch=64, micro_batch=2, precision="bf16", recompute="selective")
    with pytest.raises(ValueError, match="unknown key 'tq'"):
        ParallelLayout.parse("tq=2")
    with pytest.raises(ValueError, match="two tensor splits"):
        ParallelLayout.parse("tp=2,row=2")
    with pytest.raises(ValueError, match="not --world 16; change dp to 8"):
        estimate_layout(cfg, train, ParallelLayout.parse("tp=2,dp=2"), A100, world=16)
    with pytest.raises(ValueError, match="tp=3 does not divide heads=16"):
        estimate_layout(cfg, train, ParallelLayout(tp=3), A100)
    with pytest.raises(ValueError, match="multiple of pp=4"):
        estimate_layout(cfg, TrainConfig(6, 1), ParallelLayout(pp=4, vp=2, dp=1), A100)
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        load_hardware("tpu")
    from axonmpi.cli import main
    assert main(["plan", "--hardware", "dgx-a100", "--world", "8", "--layers", "2", "--width", "64", "--seq", "8",
                 "--global-batch", "8", "--layout", "tp=2,dp=2"]) == 1
    assert "not --world 8; change dp to 4" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=16"):
        TransformerConfig(layers=2, width=64, heads=16, seq=8, kv_heads=3)
    with pytest.raises(ValueError, match="tp=8 does not divide kv_heads=4"):
        estimate_layout(TransformerConfig(layers=8, width=1024, heads=16, kv_heads=4, seq=1024), train,
                        ParallelLayout(tp=8), A100)
    with pytest.raises(ValueError, match="shard=3 .* must divide dp=8"):
        ParallelLayout(dp=8, zero=3, shard=3)


@pytest.mark.serial
def test_schedules_memory_and_overlap_move_the_right_way():
    cfg = TransformerConfig(layers=48, width=6144, heads=64, seq=2048)
    full = TrainConfig(global_batch=512, micro_batch=1, recompute="full")
    e = {k: estimate_layout(cfg, full, ParallelLayout(tp=8, pp=8, dp=2, **kw), A100)
         for k, kw in {"1f1b": {}, "int": {"vp": 2}, "zb": {"schedule": "zb-h1"}, "zbv": {"schedule": "zbv"}}.items()}
    assert e["int"].breakdown["bubble_s"] < e["1f1b"].breakdown["bubble_s"]
    assert e["zb"].breakdown["bubble_s"] < e["1f1b"].breakdown["bubble_s"]
    assert e["zbv"].breakdown["bubble_s"] < e["1f1b"].breakdown["bubble_s"]
    assert e["int"].memory["activations"] > e["1f1b"].memory["activations"]      # Korthikanti's 1 + (p-1)/(pv)
    assert bubble_and_peak("1f1b", 4, 8, 1, 1.0, 2.0, 0.0) == (9.0, 4)
    lay = ParallelLayout(tp=8, pp=1, dp=4)
    mem = {z: estimate_layout(cfg, full, lay.with_(zero=z), A100).memory["state"] for z in (0, 1, 3)}
    assert mem[0] > mem[1] > mem[3]
    acts = {r: estimate_layout(cfg, TrainConfig(512, 1, "fp16", r), lay, A100).memory["activations"]
            for r in ("none", "selective", "full")}
    assert acts["none"] > acts["selective"] > acts["full"]
    sp = estimate_layout(cfg, TrainConfig(512, 1, "fp16", "selective"), lay.with_(sp=1), A100)
    assert sp.memory["activations"] < acts["selective"]
    dp0 = estimate_layout(cfg, full, lay.with_(overlap=0), A100)
    assert estimate_layout(cfg, full, lay, A100).step_time < dp0.step_time        # DDP buckets overlap
    ring = estimate_layout(cfg, full, ParallelLayout(tp=8, cp=2, dp=2), A100)
    uly = estimate_layout(cfg, full, ParallelLayout(tp=8, cp=2, dp=2, cp_kind="ulysses"), A100)
    assert ring.breakdown["cp_comm_s"] >= 0 and uly.breakdown["cp_comm_s"] > 0


@pytest.mark.serial
def test_moe_ranks_expert_parallel_against_tensor_parallel_experts():
    from axonmpi.planner.search import search
    cfg = TransformerConfig(layers=8, width=2048, heads=16, seq=2048, experts=8, top_k=2)
    res = search(cfg, TrainConfig(global_batch=64, micro_batch=1, recompute="selective"), 16,
                 load_hardware("dgx-h100"), axonn=False)
    kinds = {(e.layout.ep > 1, e.layout.tp > 1) for e in res}
    assert (True, False) in kinds and (False, True) in kinds       # both options in one ranking
    ep = next(e for e in res if e.layout.ep > 1)
    assert ep.breakdown["ep_comm_s"] > 0


@pytest.mark.serial
def test_hardware_files_are_datasheets_and_tables():
    names = hardware_names()
    assert {"dgx-a100", "dgx-h100", "perlmutter", "frontier", "cpu"} <= set(names)
    for n in names:
        hw = load_hardware(n)
        assert hw.gpus_per_node >= 1 and hw.memory_bw > 0 and hw.intra_bw > 0
    assert load_hardware("dgx-h100").peak_flops("bf16") == 989e12
    pm = load_hardware("perlmutter")
    assert pm.table_bw(1, 4) == 225e9 and pm.table_bw(1, 16) == 80e9 and pm.table_bw(8, 2) == 20e9
    fr = load_hardware("frontier")
    assert fr.table_bw(1, 8) == 135e9 and fr.table_bw(2, 4) == 72e9 and fr.table_bw(16, 2) == 5e9


@pytest.mark.serial
def test_first_choice_is_no_slower_than_the_published_layout():
    from axonmpi.planner.published import recommend
    r = recommend(TABLE1[:1], axonn=False)[0]           # 1.7B on 32 GPUs (the other rows: docs/plan.md)
    assert r["best"] is not None and r["best"].step_time <= r["published_pred_s"]


@pytest.mark.serial
def test_cpu_hardware_plans_with_the_same_model_and_json(capsys):
    from axonmpi.cli import main
    base = ["plan", "--json", "--hardware", "cpu", "--world", "4", "--layers", "2", "--width", "64", "--seq", "8",
            "--global-batch", "8", "--vocab", "95", "--top", "100"]
    assert main(base + ["--layout", "row=1,col=2,depth=1,pp=1,dp=2"]) == 0
    (e,) = json.loads(capsys.readouterr().out)["layouts"]
    assert e["layout"]["dp"] == 2 and e["layout"]["col"] == 2 and e["step_time_s"] > 0
    assert e["breakdown"]["tp_comm_s"] > 0 and e["bytes_per_step"]["col"] > 0 and e["bytes_per_step"]["data"] > 0
    assert main(base) == 0
    lays = json.loads(capsys.readouterr().out)["layouts"]
    assert len(lays) > 15 and [x["step_time_s"] for x in lays] == sorted(x["step_time_s"] for x in lays)
    assert {"tp=1,pp=1,dp=4", "tp=1,pp=1,dp=4,zero=3", "row=2,col=2,depth=1,pp=1,dp=1"} <= {x["label"] for x in lays}
    assert main(base + ["--layout", "tq=2,dp=2"]) == 1
    assert "unknown key 'tq'" in capsys.readouterr().err


@pytest.mark.serial
def test_llama_shape_in_flops_memory_and_bytes():
    """Grouped-query attention, a SwiGLU MLP and rotary positions, as planner parameters (no model class)."""
    from axonmpi.planner.estimate import model_flops
    llama = TransformerConfig(layers=32, width=4096, heads=32, kv_heads=8, seq=4096, vocab=128256, ffn=14336,
                              gated=True, rotary=True, bias=False, tied=False)
    assert llama.params == 8_030_261_248                            # Llama 3 8B, as published (8.03B)
    assert llama.linears()[0] == (4096, 4096 + 2 * 8 * 128) and len(llama.linears()) == 5
    t = TrainConfig(256, 1, "bf16", "selective")
    # forward flops a token: 2 x (QKV + out + 3 MLP matrices) + attention 4 s h + head 2 h V, times 3 (+ selective)
    lin = 2 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    assert model_flops(llama, t, recompute=False) == 3.0 * 256 * 4096 * (32 * (lin + 4 * 4096 * 4096) + 2 * 4096 * 128256)
    mha = TransformerConfig(layers=32, width=4096, heads=32, seq=4096, vocab=128256, ffn=14336, gated=True,
                            rotary=True, bias=False, tied=False)
    a, b = (estimate_layout(c, t, ParallelLayout(tp=8, dp=8), A100) for c in (llama, mha))
    assert a.breakdown["params_per_rank"] < b.breakdown["params_per_rank"]      # fewer K/V weights
    assert a.breakdown["compute_s"] < b.breakdown["compute_s"]
    z = estimate_layout(llama, t, ParallelLayout(dp=64, zero=3), A100)
    # 4 micro-batches, each gathering the whole model twice and reduce-scattering it once, in bf16
    assert z.volumes["data"] == pytest.approx(4 * 3 * llama.params * 2, rel=1e-12)


@pytest.mark.serial
def test_megatron_tensor_collectives_per_block_4_and_6_with_full_recomputation():
    """Forward 2 all-reduces, backward 2 (the f/g pair's mirror), +2 in a fully recomputed forward; with SP
    the backward adds the re-gather of the sharded input X (2 all-gathers) and tp_overlap hides dX's
    reduce-scatters under the weight-gradient GEMMs and the re-gathers under the input-gradient GEMMs."""
    from axonmpi.planner.comm import collective_time
    cfg = TransformerConfig(layers=4, width=1024, heads=16, seq=1024)
    n, m = 2 * 1024, 4                                        # tokens of a micro-batch of 2; 8 / 2 micro-batches
    act = n * 1024 * 2.0                                      # bf16 activations
    ar = collective_time("allreduce", act, 2, 1, A100, FITTED)
    ag = collective_time("allgather", act, 2, 1, A100, FITTED)
    rs = collective_time("reducescatter", act, 2, 1, A100, FITTED)
    head = collective_time("allreduce", 4.0 * n * 3, 2, 1, A100, FITTED, 3)      # the loss's max and sums
    for rec, per_block in (("none", 4 * ar), ("selective", 4 * ar), ("full", 6 * ar)):
        e = estimate_layout(cfg, TrainConfig(8, 2, "bf16", rec), ParallelLayout(tp=2), A100)
        assert e.breakdown["tp_comm_s"] == pytest.approx(m * (4 * per_block + head), rel=1e-12), rec
    sp = estimate_layout(cfg, TrainConfig(8, 2, "bf16", "full"), ParallelLayout(tp=2, sp=1), A100)
    assert sp.breakdown["tp_comm_s"] == pytest.approx(m * (4 * (2 * (2 * ag + 2 * rs) + 4 * ag + 2 * rs) + head),
                                                      rel=1e-12)
    hid = estimate_layout(cfg, TrainConfig(8, 2, "bf16", "full"), ParallelLayout(tp=2, sp=1, tp_overlap=1), A100)
    assert hid.breakdown["tp_hidden_s"] == pytest.approx(m * 4 * (2 * rs + 2 * ag), rel=1e-12)
    assert hid.step_time < sp.step_time
