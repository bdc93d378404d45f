"""``python -m lightning_longctx ...`` = the ``lightning-longctx`` console script."""

from __future__ import annotations

from lightning_longctx.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
