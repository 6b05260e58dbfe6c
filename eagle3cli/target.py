"""``eagle3cli.target`` is ``eagle3cli.model.target``: the path the README's library example has always used.

The module object is the same one, so patches and isinstance checks see one module.
"""

import sys

from .model import target as _module

sys.modules[__name__] = _module
