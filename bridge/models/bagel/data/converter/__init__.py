"""The converter wing: official BAGEL raw formats (t2i/edit parquet, VLM JSONL + images) → Energon crude WebDatasets.

Separate from the runtime (``energon`` readers → ``packing`` → ``external``): nothing in the runtime imports it.
It shares only the on-disk layout contract (``energon.layout``) with the readers. ``demo`` generates the
embedded demo dataset through the same converter.
"""
