"""``data_parallel="fsdp"``: FSDP2 ``fully_shard`` over all dp x sp ranks, with full-state-dict checkpoints.

The strategy delegates here when FSDP is chosen and keeps DDP's own code path otherwise, so each
path reads straight through. Why the world mesh: FSDP2's reduce-scatter averages gradients over every
rank it shards across; with the loss scaled by ``sp`` (the strategy's ``backward``) the average over
dp x sp ranks is "sum over sp, mean over dp", exactly as DDP's all-reduce over the world.

Checkpoints hold full, unsharded state dicts (gathered on every rank, kept on the CPU), so they load
into the plain Hugging Face model; optimizer state is saved and restored the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class FSDP2Sharding:
    """Shards the transformers models of a LightningModule with ``fully_shard`` over one 1-D mesh."""

    def __init__(self, device_type: str, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_sp",))

    def shard(self, model: nn.Module) -> nn.Module:
        """``fully_shard`` every transformer block (the model's ``_no_split_modules``) and each outermost
        ``PreTrainedModel``; parameters outside them are refused (they would stay unsynchronised)."""
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.5 has it under its composable API only
            from torch.distributed._composable.fsdp import fully_shard
        from transformers import PreTrainedModel

        roots = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
        roots = [m for m in roots if not any(m is not r and m in set(r.modules()) for r in roots)]
        covered = {id(p) for r in roots for p in r.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in covered]
        if not roots or stray:
            raise ValueError(
                "data_parallel='fsdp' shards transformers models; parameters outside them "
                f"({stray[:3] or 'no transformers model found'}) are not handled. Use data_parallel='ddp'"
            )
        for root in roots:
            block_names = set(getattr(root, "_no_split_modules", None) or [])
            for module in root.modules():
                if type(module).__name__ in block_names:
                    fully_shard(module, mesh=self.mesh)
            fully_shard(root, mesh=self.mesh)
        return model

    @staticmethod
    def _options(**kw: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)

    def model_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The full state dict (a collective: every rank calls it)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module, options=self._options())

    def load_model_state_dict(self, module: nn.Module, state: dict[str, Any], strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(module, state, options=self._options(strict=strict))

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optimizer, options=self._options())

    def load_optimizer_state(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not state.get("state"):
            # stateless optimizer (plain SGD, or no step yet): torch's loader needs a state tensor to
            # find the device, so restore the hyper-parameters only.
            for group, saved in zip(optimizer.param_groups, state["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        set_optimizer_state_dict(module, optimizer, state, options=self._options())
