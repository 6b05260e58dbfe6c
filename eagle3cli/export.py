"""``eagle3cli.export`` is ``eagle3cli.publish.export``: the path the README's library example has always used.

The module object is the same one, so patches and isinstance checks see one module.
"""

import sys

from .publish import export as _module

sys.modules[__name__] = _module
