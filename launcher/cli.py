"""The `dflash-dist` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: dflash-dist {demo,parity} ...\n  demo    the tiny core demo\n  parity  check against golden data"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from dflash_dist.demo import main as demo_main

        return demo_main(rest)
    if cmd == "parity":
        from dflash_dist.parity import main as parity_main

        return parity_main(rest)
    print(f"dflash-dist: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
