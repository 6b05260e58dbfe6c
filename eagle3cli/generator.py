"""``eagle3cli.generator`` is ``eagle3cli.decode.generator``: the path the README's library example has always used.

The module object is the same one, so patches and isinstance checks see one module.
"""

import sys

from .decode import generator as _module

sys.modules[__name__] = _module
