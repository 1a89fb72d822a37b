"""The on-disk contract of a converted BAGEL dataset, shared by the converter and the readers: ``contract`` (names,
the crude WebDataset layout, ``manifest.json`` and its O(1) index), ``columns`` (format 3's tables as numpy columns),
``checksums`` (``ChecksumTable``), ``damage`` (a damaged ``.nv-meta``, ``.tar.idx`` or shard named in one line),
``shards`` (Energon's member-key split). Everything of ``contract`` is re-exported here (``from ...energon.layout
import T2I, load_manifest``): the converter imports this package and nothing else of the runtime.
"""

from .contract import *  # noqa: F401,F403 - the contract's public names
from .contract import __all__  # noqa: F401
