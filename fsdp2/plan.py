"""``python -m fsdp2.plan MODULE:BUILD [--shard MODULE:SHARD] --world-size 8,64,1024``.

Only the command line's entry point (the CLI itself is ``fsdp2/tools/planner/cli.py``). The name
``fsdp2.plan`` is the planner *function* (``fsdp2/__init__.py``): ``python -m`` runs this file as
``__main__`` and leaves that name alone, whereas importing this file as ``fsdp2.plan`` would
replace the function with this module in the package, so that import is refused.
"""

from __future__ import annotations

import sys

from fsdp2.tools.planner.cli import main

if __name__ == "fsdp2.plan":
    raise ImportError(
        "fsdp2.plan is the planner function (call fsdp2.plan(...) after `import fsdp2`), and "
        "`python -m fsdp2.plan` its command line; the module fsdp2/plan.py is only that entry "
        "point and is not imported. For the command line from Python, use "
        "fsdp2.tools.planner.cli.main(argv)"
    )

if __name__ == "__main__":
    sys.exit(main())
