"""The stages after the packer, in chain order, each owning the one before it.

* ``rng``: ``BagelRNGIterator``, private Python/NumPy/torch RNG streams around the packer (data-only RNG).
* ``official_mode``: ``OfficialWorkers``, the official DataLoader's round-robin over emulated workers.
* ``prefetch`` (+ ``shm``): ``PrefetchStage``, packed batches made ahead in a producer process, handed over in
  shared memory whose segments a later job reclaims when their owner died.
* ``loader``: ``BagelExternalLoader``, what Megatron receives (public through ``external``).
* ``valid``: ``BagelValidLoader``, the validation stream: the same batches at every evaluation (no state).
"""
