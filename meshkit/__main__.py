"""``python -m meshkit``: the same as the ``meshkit`` command."""

import sys

from .cli import main

sys.exit(main())
