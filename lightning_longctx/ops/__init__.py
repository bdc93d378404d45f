"""Sequence-parallel building blocks around attention: the exact global cross-entropy (``loss``), the chunked
``lm_head`` + loss (``chunked_loss``), the token mean over an accumulation window (``token_mean``), sequence-tiled
MLPs (``tiling``) and activation offload of checkpointed decoder layers (``activation_offload``)."""
