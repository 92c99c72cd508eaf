"""``python -m dualkv {demo,info}``."""
from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Optional, Sequence


def _info() -> int:
    import torch

    import dualkv
    print(f"dualkv {dualkv.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"CUDA available: {torch.cuda.is_available()}")
    try:
        import transformers
        print(f"transformers {transformers.__version__}")
    except ImportError:
        print("transformers: not installed (needed by dualkv.integrations.transformers and the demo)")
    try:
        info = dualkv.build_info()
    except Exception as exc:  # the native library may be missing
        print(f"native library: not available ({type(exc).__name__}: {exc})")
        return 1
    print("native library build info:")
    print(json.dumps(info, indent=2, sort_keys=True, default=str))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m dualkv",
                                     description="dualkv: exact shared-prompt attention for GRPO/DAPO training")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print version and native build information")
    demo = sub.add_parser("demo", help="one GRPO policy update, standard vs dualkv, with an equivalence check")
    from .demo import add_arguments
    add_arguments(demo)
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    from .demo import run_cli
    return run_cli(args)


if __name__ == "__main__":
    sys.exit(main())
