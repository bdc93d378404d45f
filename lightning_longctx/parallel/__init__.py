"""The parallel runtime, usable without Lightning: the dp x sp x tp device mesh (``mesh``), every collective
(``comm``), the sequence layout and batch sharding (``layout``, ``sharding``), tensor parallelism, FSDP2 and DDP, and
``parallelize`` (the per-run plan: the model half and the batch half of a step), with the self-test that checks it."""
