"""Tiny Hugging Face models, token data, a plain LightningModule and the single-process training loop that a
parallel run is compared with.

* :func:`tiny_model` ``(arch)``: a seeded float32 model of :data:`ARCHS` (2 layers, hidden 32, 4 heads, 2 KV
  heads, vocabulary 64; Gemma-2 with soft-capping and a sliding window, Mixtral with 4 experts, the hybrids
  with one linear-attention or Mamba-2 layer), built from its config: no weights, no network.
* :class:`TokenDataset`: deterministic random sequences with HF-style labels, a prompt without loss.
* :class:`HFModule`: the user's code, ``training_step`` returns ``self.model(**batch).loss``.
* :func:`reference_training`: the same global batches in one process, in the order Lightning's
  ``DistributedSampler`` gives them: what a run under the strategy must match, every parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = [
    "ARCHS",
    "TINY_LLAMA",
    "HFModule",
    "TokenDataset",
    "checkpointing_state",
    "reference_training",
    "tiny_config",
    "tiny_model",
]

#: name -> (transformers config class, causal-LM class)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # per-head q_norm / k_norm
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),  # 4 experts, top 2, the aux loss on
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),  # hybrid: conv + gated DeltaNet, then attention
    "bamba": ("BambaConfig", "BambaForCausalLM"),  # hybrid: conv + Mamba-2 SSD, then attention
}

#: ``CausalLM(model_config=...)`` of a tiny Llama (untied, 2 layers, 4 heads, 2 KV heads)
TINY_LLAMA = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def tiny_config(
    arch: str = "llama", *, heads: int = 4, kv_heads: int = 2, layers: int = 2, vocab: int = 64, **extra: Any
) -> Any:
    """The ``transformers`` config of a tiny ``arch`` (a key of :data:`ARCHS`); ``extra`` overrides any
    field."""
    import transformers

    cfg_cls = getattr(transformers, ARCHS[arch][0])
    kw = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if arch in ("mistral", "mixtral"):
        kw["sliding_window"] = None
    if arch == "mixtral":
        kw.update(
            num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1
        )
    if arch == "gemma2":  # soft-capping small enough to matter at this scale, sliding window on layer 0
        kw.update(
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=8,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=3.0,
        )
        kw["layer_types"] = ["sliding_attention", "full_attention"][:layers]
    if arch == "qwen3_5":  # linear attention (causal conv k=4 + gated DeltaNet) on layer 0, attention on 1
        kw.update(
            layer_types=["linear_attention", "full_attention"][:layers],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            head_dim=8,
        )
    if arch == "bamba":  # Mamba-2 (4 heads of 16, state 8, SSD chunks of 8) on layer 0, attention on 1
        kw.update(
            attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8
        )
    kw.update(extra)
    return cfg_cls(**kw)


def tiny_model(arch: str = "llama", seed: int = 0, **kw: Any) -> torch.nn.Module:
    """A float32 causal LM of :func:`tiny_config` ``(arch, **kw)``, its weights drawn after
    ``manual_seed(seed)``."""
    import transformers

    torch.manual_seed(seed)
    model_cls = getattr(transformers, ARCHS[arch][1])
    return model_cls(tiny_config(arch, **kw)).float()


def checkpointing_state(model: torch.nn.Module) -> list[Any]:
    """Every checkpointing flag and function of the model, and whether transformers' input-grad hooks are on:
    what the strategy must hand back unchanged."""
    flags = [
        (name, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func"))
        for name, m in model.named_modules()
        if hasattr(m, "gradient_checkpointing")
    ]
    return [*flags, bool(getattr(model, "_require_grads_hooks", None))]


class TokenDataset(Dataset):
    """Deterministic random token sequences with HF-style (unshifted) labels; some targets ignored."""

    def __init__(self, n: int, seq_len: int, vocab: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, seq_len), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, : seq_len // 5] = -100  # a prompt without loss, different per rank shard

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class HFModule(L.LightningModule):
    """The user's code: training_step returns ``self.model(**batch).loss``, nothing else."""

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 0.5,
        batch_size: int = 1,
        dataset: Dataset | None = None,
        adam: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.batch_size = batch_size
        self.dataset = dataset
        self.adam = adam
        self.losses: list[float] = []

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.adam:  # an optimizer with per-parameter state, to exercise its checkpointing
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)


def reference_training(
    model: torch.nn.Module,
    dataset: Dataset,
    *,
    dp: int,
    batch_size: int,
    steps: int,
    accumulate: int = 1,
    lr: float = 0.5,
    clip: float | None = None,
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> list[float]:
    """Single-process SGD on the same global batches, in the order Lightning's DistributedSampler gives
    them (``num_replicas=dp``, shuffled with seed 0: Lightning always shuffles the training set under a
    distributed sampler); the dp ranks' means are averaged, as DDP does. One epoch at most. ``optimizer``: a
    function of the parameters (default: SGD at ``lr``)."""
    from torch.utils.data import DistributedSampler

    orders = [
        list(DistributedSampler(dataset, num_replicas=dp, rank=j, shuffle=True, seed=0)) for j in range(dp)
    ]
    opt = (optimizer or (lambda params: torch.optim.SGD(params, lr=lr)))(model.parameters())
    losses = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            first = (step * accumulate + micro) * batch_size
            total = 0.0
            for j in range(dp):
                idx = orders[j][first : first + batch_size]
                batch = {k: torch.stack([dataset[i][k] for i in idx]) for k in ("input_ids", "labels")}
                loss = model(**batch).loss / (dp * accumulate)
                loss.backward()
                total += loss.item()
            losses.append(total * accumulate)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return losses
