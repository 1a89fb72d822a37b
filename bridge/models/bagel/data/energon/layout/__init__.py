"""The on-disk contract of a converted BAGEL dataset, shared by the converter and the readers.

* ``contract``: names, the crude WebDataset layout (shards, sample keys, parts), ``manifest.json`` (formats 1–3)
  and its O(1) index for the readers (``load_manifest_index``);
* ``columns``: manifest format 3's per-file / per-shard tables as numpy columns (``manifest.columns.npy``);
* ``damage``: a damaged ``.nv-meta``, ``.tar.idx`` or shard named with its cause and the remedy, in one line.

Everything of ``contract`` is re-exported here (``from ...energon.layout import T2I, load_manifest``): the converter
imports this package and nothing else of the runtime.
"""

from .contract import *  # noqa: F401,F403 - the contract's public names
from .contract import __all__ as _contract_all

__all__ = list(_contract_all)
