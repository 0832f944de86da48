"""The ``linicl`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


from linicl import compiled
from linicl.reporting import positive_int, writable_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linicl", description="The exact theory of in-context learning.")
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="certify the exact ICLCA conversion on a zoo of random models",
                       description="Convert random prompts on a zoo of random models covering every "
                                   "option and print the errors, conversion time and speed-up; "
                                   "writes OUT/verify.json. Exits 1 if any identity fails.")
    v.add_argument("--out", default="results", help="results folder (default: results)")
    v.add_argument("--prompt-len", type=positive_int, default=500,
                   help="prompt tokens (default: 500, deliberately not a multiple of the chunk size)")
    v.add_argument("--query-len", type=positive_int, default=16, help="query tokens (default: 16)")
    v.add_argument("--batch", type=positive_int, default=4, help="query batch size (default: 4)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--quick", action="store_true", help="short prompts, for CI")
    v.add_argument("--workers", type=positive_int, default=None,
                   help="threads that check models side by side (default: the CPU count, at most 4); "
                        "the timings are taken afterwards, one model at a time")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_data_parser(sub)
    return parser


def _add_data_parser(sub) -> None:
    d = sub.add_parser("data", help="list and download the data sets of the ICL tasks",
                       description="The tasks' data sets: where they are (list) and how to get them (fetch). "
                                   "The data directory is --data-dir, else $LINICL_DATA_DIR, else the "
                                   "per-user cache ~/.cache/linicl/data, which the loaders also read.")
    dsub = d.add_subparsers(dest="data_command", required=True)
    where = dict(default=None, help="data directory (default: $LINICL_DATA_DIR, else ~/.cache/linicl/data)")
    ls = dsub.add_parser("list", help="every task: where its files are, or 'not found', or 'damaged' (size or "
                                      "SHA-256 not its spec's), size, licence")
    ls.add_argument("--data-dir", **where)
    f = dsub.add_parser("fetch", help="download tasks' files from their original public sources",
                        description="Download the files of TASKs (default: every task whose spec has "
                                    "download URLs), verify their SHA-256, skip those already there, "
                                    "resume partial downloads.")
    f.add_argument("tasks", nargs="*", metavar="TASK", help="task names (see `linicl data list`)")
    f.add_argument("--data-dir", **where)
    f.add_argument("--base-url", default=None,
                   help="replace the scheme://host[:port] of every URL, e.g. a mirror "
                        "(default: $LINICL_DATA_BASE_URL, else the URLs in the specs)")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")


def _data(args) -> int:
    from linicl.data import fetch
    from linicl.errors import DataError
    try:
        if args.data_command == "list":
            print(fetch.format_status(args.data_dir))
        else:
            fetch.fetch(args.tasks, args.data_dir, base_url=args.base_url, progress=not args.no_progress,
                        log=print)
    except DataError as e:
        print(f"linicl data {args.data_command}: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "verify":
        try:  # before the run: a results folder that cannot be written would waste it
            writable_dir(args.out)
        except OSError as e:
            parser.error(f"argument --out: cannot write results to {args.out!r}: {e.strerror or e}")
        import jax
        # The entry point owns the process: float64 models need x64 (float32 ones stay float32), and
        # compiled executables are kept on disk across runs (LINICL_COMPILATION_CACHE=off: not).
        jax.config.update("jax_enable_x64", True)
        compiled.enable_persistent_cache()
        from linicl import verify
        return verify.main(out=args.out, prompt_len=args.prompt_len, query_len=args.query_len,
                           batch=args.batch, seed=args.seed, quick=args.quick,
                           progress=not args.no_progress, workers=args.workers)
    if args.command == "data":
        return _data(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
