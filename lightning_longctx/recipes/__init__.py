"""Recipes: ready-made LightningModules and DataModules built ON the public API of the core.

The core (the strategy, attention, sharding, losses, data plumbing, planner) never imports this
package; a recipe is what a user could have written, kept here so the demo and the example configs
run as they are:

* :mod:`~lightning_longctx.recipes.causal_lm`: :class:`CausalLM`, a Hugging Face causal LM with AdamW
  and :func:`warmup_cosine` (the CLI's default ``--model``);
* :mod:`~lightning_longctx.recipes.recall`: the demo's synthetic key/value recall task,
  :class:`RecallDataset` / :class:`RecallDataModule`, scored by :class:`RecallAccuracy` /
  :func:`recall_accuracy`; the long-context demo's :class:`LongRecallDataset` / :class:`LongRecallDataModule`
  (facts stated thousands of tokens before their questions) and its :class:`LongRecallPrompt` for
  ``NeedleRetrieval``.
"""

from __future__ import annotations

from lightning_longctx.recipes.causal_lm import CausalLM, warmup_cosine
from lightning_longctx.recipes.recall import (
    LongRecallDataModule,
    LongRecallDataset,
    LongRecallPrompt,
    RecallAccuracy,
    RecallDataModule,
    RecallDataset,
    recall_accuracy,
)

__all__ = [
    "CausalLM",
    "LongRecallDataModule",
    "LongRecallDataset",
    "LongRecallPrompt",
    "RecallAccuracy",
    "RecallDataModule",
    "RecallDataset",
    "recall_accuracy",
    "warmup_cosine",
]
