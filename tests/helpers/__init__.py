"""What the test modules share; no test module imports another.

What the tests share with the benchmarks (or with a user's own tests) lives in the package,
:mod:`lightning_longctx.testing`; ``launch`` and ``hf_models`` here re-export it for the test modules.

* ``launch``: the one way tests AND benchmarks start ranks (a warm gloo ``DistPool``, or ``launch`` of
  fresh processes for one call): :mod:`lightning_longctx.testing.ranks`.
* ``lightning``: :func:`lightning_env` (a pool rank made to look launched to Lightning), a Trainer fit of a tiny
  HF model under the strategy and its comparison with one process.
* ``hf_models``: tiny Hugging Face models from configs, token data, a plain LightningModule and the
  single-process training loop the parallel runs are compared with
  (:mod:`lightning_longctx.testing.hf_models`).
* ``reference``: plain attention in float64, the reference of the attention tests.
* ``lora``: peft LoRA models and their comparison with one process.
"""
