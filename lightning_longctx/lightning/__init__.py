"""Lightning glue: the strategy, its callbacks, sharded checkpoints, preemption and the first-step fit check.
Everything below this package (``parallel``, ``attention``, ``integrations``, ``ops``) runs without Lightning."""
