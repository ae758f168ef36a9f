"""The openai internals kvturn relies on, imported in one place.

openai treats ``_``-prefixed names as private and may change them in a minor release;
``tests/sdk/test_canary.py`` pins every one used here (and every hook the clients override), so
such a release fails loudly in CI instead of misbehaving.
"""

from __future__ import annotations

from openai._base_client import get_platform
from openai._httpx2 import timeout_exceptions
from openai._legacy_response import LegacyAPIResponse
from openai._models import FinalRequestOptions

__all__ = ["FinalRequestOptions", "LegacyAPIResponse", "get_platform", "timeout_exceptions"]
