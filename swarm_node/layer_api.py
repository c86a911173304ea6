"""Which keyword a family's decoder layer takes its cache by, read from the installed transformers' own signature.

transformers renamed it: layers take ``past_key_values=`` before 5.24 and ``cache=`` from 5.24 on; Falcon and BLOOM
take ``layer_past=``. Every layer also accepts ``**kwargs``, so a cache passed under the wrong name is swallowed
without a word and no key or value is ever written (every decode step then attends to zeros). So the keyword is
chosen once, at span build, from the parameters the layer's ``forward`` names explicitly, and a layer that names
none of them refuses to start instead of serving wrong answers.
"""

from __future__ import annotations

import inspect

import transformers
from torch import nn

from shared.errors import CacheApiMismatch
from shared.families.family import LayerCall

# The keywords each way of calling a layer may take its cache by, newest first (the first one named wins).
CACHE_KEYWORDS: dict[LayerCall, tuple[str, ...]] = {
    "standard": ("cache", "past_key_values"),
    "falcon": ("layer_past",),
    "bloom": ("layer_past",),
}


def cache_keyword(layer_class: type[nn.Module], call: LayerCall) -> str:
    """The keyword ``layer_class.forward`` names for its cache; raises ``CacheApiMismatch`` if it names none."""
    named = inspect.signature(layer_class.forward).parameters
    for keyword in CACHE_KEYWORDS[call]:
        if keyword in named and named[keyword].kind is not inspect.Parameter.VAR_KEYWORD:
            return keyword
    raise CacheApiMismatch(
        f"{layer_class.__name__}.forward in the installed transformers {transformers.__version__} takes none of"
        f" {', '.join(CACHE_KEYWORDS[call])} as its cache argument; install a transformers version pyproject.toml"
        " allows"
    )
