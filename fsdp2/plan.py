"""``python -m fsdp2.plan MODULE:BUILD [--shard MODULE:SHARD] --world-size 8,64,1024``.

``fsdp2.plan`` itself is the planner function (exported by ``fsdp2/__init__.py``); this module
only makes it runnable. Should it ever be imported as ``fsdp2.plan`` (which replaces the
package attribute), it stays callable as the function."""

from __future__ import annotations

import sys
import types
from typing import Any

from fsdp2.tools.planner import plan as _plan
from fsdp2.tools.planner.cli import main


class _CallablePlanModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePlanModule

if __name__ == "__main__":
    sys.exit(main())
