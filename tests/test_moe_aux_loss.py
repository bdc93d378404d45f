"""MoE load-balancing loss under sequence parallelism, on gloo (P = 1, 2, 4): value and gradients equal
transformers' ``load_balancing_loss_func`` on the full sequence, and tiny Mixtral / Qwen3-MoE / OLMoE
train exactly as on one process; the model's own per-shard aux loss does not."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_longctx import enable_sequence_parallel, shard_batch
from lightning_longctx.integrations.moe import (
    MIXTRAL,
    moe_aux_loss_plan,
    sequence_parallel_load_balancing_loss,
)
from lightning_longctx.integrations.transformers import context_of
from lightning_longctx.parallel.comm import all_reduce_no_grad
from lightning_longctx.parallel.sharding import shard_sequence

LAYERS, BATCH, SEQ, EXPERTS = 3, 2, 24, 5
#: tokens per rank for the uneven layout (contiguous, in rank order)
UNEVEN = {1: [24], 2: [9, 15], 4: [3, 7, 7, 7]}
LAYOUTS = ("contiguous", "fpdt", "uneven")
CASES = [(k, masked, layout) for k in (1, 2) for masked in (False, True) for layout in LAYOUTS]


def _float64_reference(logits: torch.Tensor, top_k: int, mask: torch.Tensor | None) -> torch.Tensor:
    """The formula written out in float64 (transformers sums the probabilities in float32):
    ``E * sum_e (C_e / R) * (S_e / R)`` over all layers and (unpadded) tokens. logits: (L, b, N, E)."""
    probs = torch.softmax(logits.flatten(1, 2), dim=-1)  # (L, T, E)
    chosen = torch.zeros_like(probs).scatter(-1, probs.topk(top_k, dim=-1).indices, 1.0)
    m = torch.ones(probs.shape[1], dtype=probs.dtype) if mask is None else mask.reshape(-1).to(probs.dtype)
    rows = probs.shape[0] * m.sum()
    counts = (chosen * m[:, None]).sum((0, 1))
    mass = (probs * m[:, None]).sum((0, 1))
    return EXPERTS * torch.sum(counts / rows * mass / rows)


def _token_index(layout: str, world: int, rank: int) -> torch.Tensor:
    """The global token positions this rank holds, in its local order."""
    if layout == "uneven":
        start = sum(UNEVEN[world][:rank])
        return torch.arange(start, start + UNEVEN[world][rank])
    positions = torch.arange(SEQ)[None]
    return shard_sequence(positions, chunk_size=3 if layout == "fpdt" else None)[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def _function_cases() -> list[dict]:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    full = torch.randn(LAYERS, BATCH, SEQ, EXPERTS, generator=g, dtype=torch.float64)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, 18:] = 0  # right padding: at P = 4 the last rank's shard is ALL padding
    mask[1, 11:] = 0
    out = []
    for top_k, masked, layout in CASES:
        full_mask = mask if masked else None
        # single process, whole sequence: transformers' function and the float64 formula
        ref_in = full.clone().requires_grad_()
        hf = load_balancing_loss_func(tuple(ref_in.flatten(1, 2)), EXPERTS, top_k, full_mask)
        (hf_grad,) = torch.autograd.grad(hf, ref_in)
        ref_in = full.clone().requires_grad_()
        ref = _float64_reference(ref_in, top_k, full_mask)
        (ref_grad,) = torch.autograd.grad(ref, ref_in)

        idx = _token_index(layout, world, rank)
        local = full[:, :, idx].clone().requires_grad_()  # (L, b, n_r, E), n_r differs per rank if uneven
        local_mask = mask[:, idx] if masked else None
        router_logits = tuple(local.flatten(1, 2))  # per layer (b * n_r, E), as outputs.router_logits
        aux = sequence_parallel_load_balancing_loss(router_logits, EXPERTS, top_k, attention_mask=local_mask)
        (local_grad,) = torch.autograd.grad(aux, local)
        grad = torch.zeros_like(full)
        grad[:, :, idx] = local_grad
        grad = all_reduce_no_grad(grad)  # the strategy SUMS gradients over the SP ranks

        # the bug: the model's own aux loss, computed on the shard only
        naive_in = full[:, :, idx].clone().requires_grad_()
        naive = load_balancing_loss_func(tuple(naive_in.flatten(1, 2)), EXPERTS, top_k, local_mask)
        (naive_local,) = torch.autograd.grad(naive, naive_in)
        naive_grad = torch.zeros_like(full)
        naive_grad[:, :, idx] = naive_local
        naive_grad = all_reduce_no_grad(naive_grad)
        out.append(
            {
                "case": (top_k, masked, layout),
                "value": aux.item(),
                "hf_value_err": abs(aux.item() - hf.item()) / hf.item(),
                "hf_grad_err": _rel(grad, hf_grad),
                "value_err": abs(aux.item() - ref.item()) / ref.item(),
                "grad_err": _rel(grad, ref_grad),
                "finite": bool(torch.isfinite(local_grad).all()),
                "empty_shard_grad": local_grad.abs().max().item() if local_mask is not None else None,
                "empty_shard": bool(local_mask is not None and local_mask.sum() == 0),
                "naive_value_err": abs(naive.item() - hf.item()) / hf.item(),
                "naive_grad_err": _rel(naive_grad, hf_grad),
            }
        )
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_load_balancing_loss_value_and_gradient(dist_pool, world):
    results = dist_pool(world).run(_function_cases)
    for per_rank in zip(*results):
        case = per_rank[0]["case"]
        assert len({r["value"] for r in per_rank}) == 1, case  # the same scalar on every rank
        for r in per_rank:
            assert r["finite"], case
            # transformers sums probabilities in float32; the float64 formula is exact
            assert r["hf_value_err"] < 1e-6 and r["hf_grad_err"] < 1e-5, (case, r)
            assert r["value_err"] < 1e-12 and r["grad_err"] < 1e-12, (case, r)
            if r["empty_shard"]:  # a rank holding only padding contributes nothing, never NaN
                assert r["empty_shard_grad"] == 0.0
        if world > 1:  # without the reduction the gradient is wrong (NaN on an all-padding shard)
            assert not (max(r["naive_grad_err"] for r in per_rank) < 0.05), case


def test_degenerate_inputs_without_group():
    assert sequence_parallel_load_balancing_loss(None, 4, 2).item() == 0.0
    assert sequence_parallel_load_balancing_loss((), 4, 2).item() == 0.0
    logits = torch.randn(6, 4, requires_grad=True)
    all_pad = sequence_parallel_load_balancing_loss((logits,), 4, 2, attention_mask=torch.zeros(2, 3))
    all_pad.backward()
    assert all_pad.item() == 0.0 and logits.grad.abs().max().item() == 0.0  # transformers gives NaN
    with pytest.raises(TypeError, match="tuple of per-layer tensors"):
        sequence_parallel_load_balancing_loss(logits, 4, 2)
    with pytest.raises(ValueError, match="expected num_experts=5"):
        sequence_parallel_load_balancing_loss((logits,), 5, 2)
    with pytest.raises(ValueError, match="attention_mask has 4 tokens"):
        sequence_parallel_load_balancing_loss((logits,), 4, 2, attention_mask=torch.ones(2, 2))
    with pytest.raises(ValueError, match="top_k=5"):
        sequence_parallel_load_balancing_loss((logits,), 4, 5)


# --- tiny MoE models end to end -------------------------------------------------------------------------

MODELS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 24}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4}),
}


def _tiny_moe(arch: str, **overrides):
    import transformers

    cfg_name, model_name, extra = MODELS[arch]
    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        output_router_logits=True,
        router_aux_loss_coef=0.1,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).float()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 64, (2, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0  # right padding in the second sample: rank 1 (tokens 8..15) holds 3 real tokens
    ids[1, 11:] = 0
    labels = ids.clone()
    labels[0, :3] = -100
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _summed_grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grads[name] = all_reduce_no_grad(grad)  # the strategy's SUM over the SP ranks
    model.zero_grad(set_to_none=True)
    return grads


def _errors(grads: dict, ref: dict) -> tuple[float, float]:
    """(max over all parameters, max over the router gates) of max|g - g_ref| / max|g_ref|."""
    errs = {name: _rel(grads[name], ref[name]) for name in ref}
    return max(errs.values()), max(e for n, e in errs.items() if n.endswith("mlp.gate.weight"))


def _end_to_end(arch: str, padded_by_shard_batch: bool) -> dict:
    """The model's own call, ``model(**shard_batch(batch)).loss``, after enable_sequence_parallel."""
    batch = _batch()
    if padded_by_shard_batch:  # 15 tokens, no mask: shard_batch pads to 16 and must mark the pad as padding
        batch = {"input_ids": batch["input_ids"][:, :15], "labels": batch["labels"][:, :15]}
    ref_model = _tiny_moe(arch)
    ref = ref_model(**batch)  # one process, whole sequence: CE + coef * aux, the model's own loss
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    out: dict = {"plan": None}
    for mode, chunk in (("ulysses", None), ("fpdt", 4)):
        model = enable_sequence_parallel(_tiny_moe(arch), mode=mode, chunk_size=chunk)
        plan = context_of(model).moe_plan
        out["plan"] = (plan.formula, plan.num_experts, plan.top_k, plan.coef)
        local = shard_batch(batch, chunk_size=chunk)
        result = model(**local)
        result.loss.backward()
        grad_err, gate_err = _errors(_summed_grads(model), ref_grads)
        out[mode] = {
            "loss_err": abs(result.loss.item() - ref.loss.item()) / ref.loss.item(),
            "aux_err": abs(result.aux_loss.item() - ref.aux_loss.item()) / ref.aux_loss.item(),
            "grad_err": grad_err,
            "gate_grad_err": gate_err,
        }
        if mode == "ulysses":  # the bug, for contrast: the model's own forward adds its per-shard aux loss
            naive = type(model).forward(model, **local)
            naive.loss.backward()
            out["naive_gate_grad_err"] = _errors(_summed_grads(model), ref_grads)[1]
    out["aux_share"] = (0.1 * ref.aux_loss / ref.loss).item()
    return out


@pytest.mark.parametrize("padded_by_shard_batch", [False, True], ids=["mask-given", "padded-by-shard-batch"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_moe_model_trains_exactly_under_sp2(dist_pool, arch, padded_by_shard_batch):
    """enable_sequence_parallel wires the exact aux loss into the model's own call, Ulysses and FPDT (MoE
    blocks untiled); padding in one sample, or added by shard_batch: loss, aux loss and every parameter
    gradient (summed over the SP ranks) equal the plain model's on one process."""
    results = dist_pool(2).run(_end_to_end, arch, padded_by_shard_batch)
    for r in results:
        assert r["plan"] == (MIXTRAL, 4, 2, 0.1)
        assert r["aux_share"] > 0.03  # the aux term is not negligible in this test
        for mode in ("ulysses", "fpdt"):
            assert max(r[mode].values()) < 1e-5, (mode, r[mode])
        assert r["naive_gate_grad_err"] > 0.05, r  # dropping the fix is caught


# --- which models are planned, refused or left alone ----------------------------------------------------


def test_plan_reads_the_values_the_forward_uses():
    import transformers

    model = _tiny_moe("mixtral", output_router_logits=False, router_aux_loss_coef=0.02)
    plan = moe_aux_loss_plan(model)
    assert (plan.model_class, plan.formula, plan.num_experts, plan.top_k, plan.coef) == (
        "MixtralForCausalLM",
        MIXTRAL,
        4,
        2,
        0.02,
    )
    assert not plan.active(model.config) and plan.active(model.config, True)
    model.config.output_router_logits = True
    assert plan.active(model.config) and not plan.active(model.config, False)

    jet = transformers.JetMoeForCausalLM(  # JetMoe names its coefficient aux_loss_coef
        transformers.JetMoeConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_local_experts=4
        )
    )
    plan = moe_aux_loss_plan(jet)
    assert (plan.formula, plan.num_experts, plan.top_k, plan.coef) == (
        MIXTRAL,
        4,
        jet.config.num_experts_per_tok,
        jet.config.aux_loss_coef,
    )
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    assert moe_aux_loss_plan(dense) is None


def test_other_formulas_are_refused_only_when_computed():
    import transformers

    config = transformers.DogeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        is_moe=True,
        num_experts=16,
        num_experts_per_tok=2,
        output_router_logits=False,
    )
    doge = transformers.DogeForCausalLM(config)
    plan = moe_aux_loss_plan(doge)  # off in the config: no refusal yet
    assert plan.formula is None and not plan.active(doge.config)
    with pytest.raises(ValueError, match=r"DogeForCausalLM .*output_router_logits=False"):
        plan.active(doge.config, True)  # turned on by the call
    doge.config.output_router_logits = True
    with pytest.raises(ValueError, match=r"DogeForCausalLM .*without sequence parallelism"):
        moe_aux_loss_plan(doge)  # turned on by the config
    doge.config.is_moe = False  # a dense Doge computes no aux loss
    assert not moe_aux_loss_plan(doge).active(doge.config, True)


def test_known_families_are_classified():
    """transformers 5.24: the Mixtral formula is shared verbatim by ~30 models; these differ."""
    from transformers.models.bamba.modeling_bamba import BambaForCausalLM
    from transformers.models.dbrx.modeling_dbrx import DbrxForCausalLM
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssForCausalLM
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeForConditionalGeneration
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
    from transformers.models.switch_transformers.modeling_switch_transformers import (
        SwitchTransformersForConditionalGeneration,
    )

    from lightning_longctx.integrations.moe import _classify, _mixtral_key

    key = _mixtral_key()
    for cls in (DbrxForCausalLM, GptOssForCausalLM, Qwen3VLMoeForConditionalGeneration):
        assert _classify(cls, key)[:2] == (MIXTRAL, "output_router_logits"), cls
    assert _classify(NllbMoeForConditionalGeneration, key)[:2] == (None, "output_router_logits")
    assert _classify(SwitchTransformersForConditionalGeneration, key)[:2] == (None, "call")
    assert _classify(BambaForCausalLM, key)[:2] == (None, "z_loss_coefficient")
