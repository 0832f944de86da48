"""The ``linicl`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linicl", description="The exact theory of in-context learning.")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="certify the exact ICLCA conversion on a zoo of random models",
                       description="Convert random prompts on a zoo of random models covering every "
                                   "option and print the errors, conversion time and speed-up; "
                                   "writes OUT/verify.json. Exits 1 if any identity fails.")
    v.add_argument("--out", default="results", help="results folder (default: results)")
    v.add_argument("--prompt-len", type=int, default=500,
                   help="prompt tokens (default: 500, deliberately not a multiple of the chunk size)")
    v.add_argument("--query-len", type=int, default=16, help="query tokens (default: 16)")
    v.add_argument("--batch", type=int, default=4, help="query batch size (default: 4)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--quick", action="store_true", help="short prompts, for CI")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "verify":
        import jax
        # The entry point owns the process: float64 models need x64 (float32 ones stay float32).
        jax.config.update("jax_enable_x64", True)
        from linicl import verify
        return verify.main(out=args.out, prompt_len=args.prompt_len, query_len=args.query_len,
                           batch=args.batch, seed=args.seed, quick=args.quick,
                           progress=not args.no_progress)
    return 2


if __name__ == "__main__":
    sys.exit(main())
