"""``python -m tokenfan_settings [--write docs/settings.md]``: print or update the settings reference."""

from __future__ import annotations

import sys

from tokenfan_settings import main

sys.exit(main())
