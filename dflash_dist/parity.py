"""`python -m dflash_dist.parity DIR [--device cuda]`, the documented entry point of the parity
checker (dflash_dist/tools/parity.py)."""

from dflash_dist.tools.parity import main

if __name__ == "__main__":
    raise SystemExit(main())
