"""The tiny Hugging Face models live in the package: :mod:`lightning_longctx.testing.hf_models`
(``tiny_model``, ``TokenDataset``, ``HFModule``, ``reference_training``, ...). The test modules import them
from here."""

from __future__ import annotations

from lightning_longctx.testing.hf_models import (  # noqa: F401  (re-exported for the test modules)
    ARCHS,
    TINY_LLAMA,
    HFModule,
    TokenDataset,
    checkpointing_state,
    reference_training,
    tiny_config,
    tiny_model,
)
