"""`python -m dflash_dist.parity DIR [--device cuda]`, the documented entry point of the parity
checker (dflash_dist/tools/parity.py)."""

from dflash_dist.compile_cache import use_private_cache_dirs
from dflash_dist.tools.parity import main

if __name__ == "__main__":
    use_private_cache_dirs()  # compiled flex attention on CUDA: its caches in a private directory
    raise SystemExit(main())
