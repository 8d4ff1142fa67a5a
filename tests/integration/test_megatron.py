"""The ``megatron`` backend's model on real torch.distributed (gloo, two
processes) under the CPU test shim: tensor-parallel log-probabilities and
gradients equal the HF model's (the ``fsdp2`` backend's) on the same weights,
pipeline stages compose to the same model, weights stream back to HF names
bit-identically with the bytes the planner predicts, and an MoE model splits
its experts over ep. Megatron's optimizer and schedules need CUDA: the update
path is covered by ``test_megatron_gpu.py``."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowc.ir.functional import Rollout
from flowc.ir.plan import Layout
from flowc.tasks.arithmetic import asset_dir

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")


def batch(vocab: int = 16):
    """Prompts of different lengths (left padding) and responses with right padding."""
    g = torch.Generator().manual_seed(0)
    n, p, r = 6, 7, 5
    ids = torch.randint(3, vocab, (n, p), generator=g)
    pmask = torch.ones(n, p, dtype=torch.bool)
    for i, k in enumerate([0, 2, 0, 4, 1, 3]):
        pmask[i, :k] = False
        ids[i, :k] = 0
    rids = torch.randint(3, vocab, (n, r), generator=g)
    rmask = torch.ones(n, r, dtype=torch.bool)
    rmask[1, 3:] = False
    rmask[4, 1:] = False
    return Rollout(ids, pmask, rids, rmask, torch.zeros(n, r)), torch.randn(n, r, generator=g)


def _hf(source):
    from flowc.runtime.modeling import load_causal_lm

    return load_causal_lm(source, dtype=torch.float32)


def hf_sequence_scores(source: str, r: Rollout) -> torch.Tensor:
    """transformers' own scores of each row's real tokens (prompt then response), one row at a time."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(source, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for i in range(r.prompt_ids.shape[0]):
            ids = torch.cat([r.prompt_ids[i][r.prompt_mask[i]], r.response_ids[i][r.response_mask[i]]]).unsqueeze(0)
            out.append(model(input_ids=ids).logits[0, 0])
    return torch.stack(out)


def _start(rank: int, world: int, init: str) -> None:
    import megatron_cpu

    megatron_cpu.install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)


def _engine(source: str, layout: Layout, kind: str = "reference"):
    """A frozen role on the megatron backend, under the shared loop (``.b`` is the backend)."""
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.megatron import MegatronTrainer
    from flowc.runtime.backends.training import TrainEngine

    return TrainEngine(MegatronTrainer(EngineInit(role="ref", kind=kind, source=source, layout=layout, dtype="float32", seed=0)))


def _stream_check(eng, source: str, out: dict) -> None:
    """Every rank streams the whole model; it equals the checkpoint bit for bit."""
    from flowc.runtime.megatron_weights import HFCheckpoint

    ckpt = HFCheckpoint(source)
    got = dict(eng.weights())
    want = {n: ckpt(n) for n in ckpt.names() if n != "lm_head.weight" or not eng.b.arch.tie_word_embeddings}
    out["stream_keys_equal"] = sorted(got) == sorted(want)
    out["stream_bit_identical"] = all(torch.equal(got[n], want[n]) for n in want if n in got)
    out["received"] = eng.last_received
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in want.values())


def tp_worker(rank: int, world: int, init: str, out) -> None:
    """tp=2: log-probabilities through the engine, gradients through the model, the weight stream."""
    _start(rank, world, init)
    from flowc.runtime.megatron_model import pack
    from flowc.runtime.megatron_weights import merge, rules
    from flowc.runtime.modeling import response_logprobs

    source = str(asset_dir())
    eng = _engine(source, Layout(dp=1, tp=2, backend="megatron"))
    r, w = batch()
    res: dict = {}
    lp = eng.forward(r, micro=4)  # two micro-batches
    hf = _hf(source)
    want = response_logprobs(hf, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    binned = eng.forward(r, micro=4, tokens=24)  # a token budget: rows binned by length, each micro-batch its own shape
    res["binned_micro_batches"] = eng.micro_batches
    if rank == 0:
        res["forward_err"] = float(((lp - want.detach()) * r.response_mask).abs().max())
        res["binned_err"] = float(((binned - want.detach()) * r.response_mask).abs().max())
    else:
        res["forward_none"] = lp is None
    # gradients of one objective, Megatron (tp=2) against HF
    packed = pack(r.prompt_ids, r.prompt_mask, r.response_ids)
    pos = torch.arange(packed.ids.shape[1]).unsqueeze(0).expand_as(packed.ids)
    logp, ent = eng.b.score(eng.b.model(packed.ids, pos, packed.causal), r, packed, with_entropy=True)
    loss = ((logp * w + 0.1 * ent) * r.response_mask).sum()
    loss.backward()
    hlp, hent = response_logprobs(hf, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, with_entropy=True)
    ((hlp * w + 0.1 * hent) * r.response_mask).sum().backward()
    hgrad = {n: p.grad for n, p in hf.named_parameters()}
    own = dict(eng.b.model.named_parameters())
    worst = 0.0
    for rule in rules(eng.b.arch, eng.b.deg):
        g = own[rule.megatron].grad
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g.contiguous())
        if rule.kind == "rep":
            parts = parts[:1]
        for name, t in zip(rule.hf, merge(rule, parts, eng.b.arch), strict=True):
            err = float((t - hgrad[name]).abs().max() / hgrad[name].abs().max().clamp(min=1e-12))
            worst = max(worst, err if err == err else float("inf"))  # NaN counts as a failure
    res["grad_rel_err"] = worst
    # the layout's activation checkpointing: every layer recomputed in backward, the same gradients
    ck = _engine(source, Layout(dp=1, tp=2, backend="megatron", activation_checkpointing=True))
    res["recompute"] = ck.b.model.config.recompute_granularity
    ck.b.model.train()
    ck_logp, ck_ent = ck.b.score(ck.b.model(packed.ids, pos, packed.causal), r, packed, with_entropy=True)
    ((ck_logp * w + 0.1 * ck_ent) * r.response_mask).sum().backward()
    mine = dict(ck.b.model.named_parameters())
    res["recompute_grad_err"] = max(float((mine[n].grad - p.grad).abs().max()) for n, p in own.items() if p.grad is not None)
    _stream_check(eng, source, res)
    # a reward model: the trunk and the checkpoint's score head, scored at each row's last response
    # token; equal to transformers' own sequence classifier on the same sequences (and to fsdp2's)
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine
    from flowc.tasks.arithmetic import reward_model_dir

    rm_dir = str(reward_model_dir())
    rm = _engine(rm_dir, Layout(dp=1, tp=2, backend="megatron"), kind="reward_model")
    hf_rm = TrainEngine(
        Fsdp2Trainer(EngineInit(role="rm", kind="reward_model", source=rm_dir, layout=Layout(), dtype="float32", seed=0))
    )
    scores, fsdp_scores = rm.forward(r, micro=4), hf_rm.forward(r, micro=4)
    want_scores = hf_sequence_scores(rm_dir, r)
    if rank == 0:
        res["reward_fsdp_err"] = float((fsdp_scores - want_scores).abs().max())
        res["reward_scale"] = float(want_scores.abs().max())
        res["reward_err"] = float((scores - want_scores).abs().max())
    out[rank] = res
    dist.destroy_process_group()


def pp_worker(rank: int, world: int, init: str, source: str, vocab: int, out) -> None:
    """pp=2 by hand (Megatron's 1F1B schedule needs CUDA): stage 0's hidden states into stage 1."""
    _start(rank, world, init)
    from flowc.runtime.megatron_model import pack
    from flowc.runtime.modeling import response_logprobs

    eng = _engine(source, Layout(dp=1, pp=2, backend="megatron"))
    r, _ = batch(vocab)
    packed = pack(r.prompt_ids, r.prompt_mask, r.response_ids)
    pos = torch.arange(packed.ids.shape[1]).unsqueeze(0).expand_as(packed.ids)
    res: dict = {"layers": len(eng.b.model.decoder.layers)}
    with torch.no_grad():
        if rank == 0:
            hidden = eng.b.model(packed.ids, pos, packed.causal)
            dist.send(hidden.contiguous(), dst=1)
        else:
            hidden = torch.empty(packed.ids.shape[1], packed.ids.shape[0], eng.b.arch.hidden_size)
            dist.recv(hidden, src=0)
            eng.b.model.set_input_tensor(hidden)
            lp = eng.b.score(eng.b.model(packed.ids, pos, packed.causal), r, packed)
            want = response_logprobs(_hf(source), r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
            res["forward_err"] = float(((lp - want) * r.response_mask).abs().max())
    _stream_check(eng, source, res)
    out[rank] = res
    dist.destroy_process_group()


def mixed_worker(rank: int, world: int, init: str, out) -> None:
    """Two roles of one pool on different degrees (tp=2 and dp=2) switch Megatron's
    parallel state in and out; each keeps answering like the HF model. Ranks
    agree with runtime.ranks."""
    _start(rank, world, init)
    from megatron.core import parallel_state as ps

    from flowc.runtime.modeling import response_logprobs
    from flowc.runtime.ranks import output_ranks, replica_of

    source = str(asset_dir())
    tp_layout, dp_layout = Layout(dp=1, tp=2, backend="megatron"), Layout(dp=2, backend="megatron")
    a = _engine(source, tp_layout)
    b = _engine(source, dp_layout)
    r, _ = batch()
    want = response_logprobs(_hf(source), r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask).detach()
    res: dict = {"errs": []}
    for eng, lay in ((a, tp_layout), (b, dp_layout), (a, tp_layout)):
        rows = (
            r
            if lay.dp == 1
            else Rollout(*(x[rank::2] for x in (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, r.logprobs)))
        )
        lp = eng.forward(rows, micro=3)
        res["replica_ok"] = res.get("replica_ok", True) and ps.get_data_parallel_rank() == replica_of(lay)[rank]
        if rank in output_ranks(lay):
            w = want if lay.dp == 1 else want[rank::2]
            res["errs"].append(float(((lp - w) * rows.response_mask).abs().max()))
        else:
            res["errs"].append(None if lp is None else float("inf"))
    out[rank] = res
    dist.destroy_process_group()


def _moe_dir(path: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=40, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    return path


def ep_worker(rank: int, world: int, init: str, source: str, out) -> None:
    """ep=2 over two data-parallel ranks: each holds half the experts; the forward equals HF's."""
    _start(rank, world, init)
    from flowc.runtime.modeling import response_logprobs

    eng = _engine(source, Layout(dp=2, ep=2, backend="megatron"))
    r, _ = batch(vocab=40)
    res: dict = {"local_experts": sum(1 for n, _ in eng.b.model.named_parameters() if "local_experts" in n and "fc1" in n)}
    lp = eng.forward(r, micro=6)
    want = response_logprobs(_hf(source), r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    res["forward_err"] = float(((lp - want) * r.response_mask).abs().max())
    _stream_check(eng, source, res)
    out[rank] = res
    dist.destroy_process_group()


def _spawn(fn, *args) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = mp.Manager().dict()
        mp.spawn(fn, args=(2, f"file://{d}/rdv", *args, out), nprocs=2, join=True)
        return dict(out)


def test_tensor_parallel_logprobs_gradients_and_weight_stream():
    res = _spawn(tp_worker)
    assert res[0]["forward_err"] < 1e-5, res[0]
    assert res[0]["binned_err"] < 1e-5 and res[0]["binned_micro_batches"] >= 3, res[0]
    assert res[1]["forward_none"]  # only tp rank 0 of the last stage answers for its replica
    # a reward model's scores are transformers' (AutoModelForSequenceClassification), on both backends
    assert res[0]["reward_err"] < 1e-4 and res[0]["reward_fsdp_err"] < 1e-4 and res[0]["reward_scale"] > 0.1, res[0]
    for rank in (0, 1):
        assert res[rank]["grad_rel_err"] < 1e-4, res[rank]
        assert res[rank]["recompute"] == "full" and res[rank]["recompute_grad_err"] < 1e-5, res[rank]
        assert res[rank]["stream_keys_equal"] and res[rank]["stream_bit_identical"]
    # every rank receives what its own shard lacks: the other tp half of the split weights
    for rank in (0, 1):
        assert 0.3 * res[rank]["model_bytes"] < res[rank]["received"] < 0.7 * res[rank]["model_bytes"]


def _dense_dir(path: str, layers: int) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=40, tie_word_embeddings=True,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("layers", [2, 3])
def test_pipeline_stages_compose_to_the_hf_model(layers, tmp_path):
    """2 layers: one a stage; 3 layers: 2 and 1 (stage_split: Megatron's uneven first and last
    stages), the split the planner prices where pp does not divide the layers."""
    source, vocab = (str(asset_dir()), 16) if layers == 2 else (_dense_dir(str(tmp_path), layers), 40)
    res = _spawn(pp_worker, source, vocab)
    assert res[1]["forward_err"] < 1e-5, res[1]
    assert [res[0]["layers"], res[1]["layers"]] == ([1, 1] if layers == 2 else [2, 1])
    for rank in (0, 1):
        assert res[rank]["stream_keys_equal"] and res[rank]["stream_bit_identical"]


def test_roles_on_different_degrees_share_a_pool():
    res = _spawn(mixed_worker)
    assert res[0]["errs"][0] < 1e-5 and res[1]["errs"][0] is None  # tp=2: rank 0 answers
    assert res[0]["errs"][1] < 1e-5 and res[1]["errs"][1] < 1e-5  # dp=2: both answer for their rows
    assert res[0]["errs"][2] < 1e-5  # back on tp=2
    assert res[0]["replica_ok"] and res[1]["replica_ok"]


def test_expert_parallel_moe_model(tmp_path):
    res = _spawn(ep_worker, _moe_dir(str(tmp_path)))
    for rank in (0, 1):
        assert res[rank]["local_experts"] == 2 * 2  # 2 layers x 2 of 4 experts
        assert res[rank]["forward_err"] < 1e-5, res[rank]
        assert res[rank]["stream_keys_equal"] and res[rank]["stream_bit_identical"]
